"""Where the noise comes from: an explicit ``torch.Generator``, or one seeded from OS entropy.

The noise itself (N(0, (σC/B)²) per coordinate in float32 or wider, added to the clipped sums
divided by the expected batch size B) is ``pdpsgd.fused.noise_and_scale``; on CPU its draws come
from the generator: by default (``noise_rng="auto"``) through pdpsgd's own vectorised Philox stream
keyed from it with 128 bits per step (``pdpsgd.native_rng``) where that kernel builds, else numpy's
Philox keyed the same way (``"numpy"``); or as chosen: ``"torch"`` (``normal_``: the generator's own
mt19937 words, which released noise gives back; experiments only, ``fused.TORCH_CPU_WARNING``),
``"native"``, ``"numpy"``, or oneMKL's Philox (``"mkl"``, ``pdpsgd.mkl_rng``).
"""
from __future__ import annotations

import torch

from ._seeding import keyed_generator

__all__ = ["entropy_generator"]


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` keyed with 256 bits from the OS's entropy source (``secrets``),
    expanded into its whole state (CPU: all 19,937 bits of the mt19937; accelerators: the Philox
    seed's 64 bits). (Before round 35 this was ``manual_seed(secrets.randbits(63))``, of which
    the CPU generator keeps 32 bits: 2^32 streams, few enough to try them all against a released
    update and subtract the noise.)

    Each call gives a fresh, unpredictable stream, so restarted runs never repeat noise. (torch's
    generators are not cryptographically secure PRNGs; the key is.)
    """
    return keyed_generator(None, device)
