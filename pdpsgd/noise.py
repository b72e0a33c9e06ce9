"""Where the noise comes from: an explicit ``torch.Generator``, or one seeded from OS entropy.

The noise itself (one flat N(0, 1) draw in float32 or wider, scaled by σC, added to the clipped
sums and divided by the expected batch size) is ``pdpsgd.fused.noise_and_scale``.
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
