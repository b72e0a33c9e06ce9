"""Where the noise comes from: an explicit ``torch.Generator``, or one seeded from OS entropy.

The noise itself (N(0, (σC/B)²) per coordinate in float32 or wider, added to the clipped sums
divided by the expected batch size B) is ``pdpsgd.fused.noise_and_scale``; on CPU its draws come
from the generator: by default (``noise_rng="auto"``) through pdpsgd's own vectorised Philox stream
keyed from it (``pdpsgd.native_rng``) for float32 noise where that kernel builds, else torch's
``normal_``; or as chosen: ``"torch"``, ``"native"``, or oneMKL's Philox (``"mkl"``, ``pdpsgd.mkl_rng``).
"""
from __future__ import annotations

import secrets
import torch

__all__ = ["entropy_generator"]


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded with 63 bits from the OS's entropy source (``secrets``).

    Each call gives a fresh, unpredictable stream, so restarted runs never repeat noise. (torch's
    generators are not cryptographically secure PRNGs; the seed is.)
    """
    g = torch.Generator(device=device)
    g.manual_seed(secrets.randbits(63))
    return g
