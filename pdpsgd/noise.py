"""Gaussian noise for the clipped sum, from an explicit generator.

Formal guarantee: ``add_noise`` adds an independent N(0, std²) draw to every coordinate, drawn in
float32 or wider (never bf16/fp16, whose coarse grid would bias the distribution), once per call.
Combined with a clipped sum of L2 sensitivity C and std = σC, this is the Gaussian mechanism.
"""
from __future__ import annotations

import secrets
from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

__all__ = ["entropy_generator", "add_noise", "noise_dtype"]


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` seeded with 63 bits from the OS's entropy source (``secrets``).

    Each call gives a fresh, unpredictable stream, so restarted runs never repeat noise. (torch's
    generators are not cryptographically secure PRNGs; the seed is.)
    """
    g = torch.Generator(device=device)
    g.manual_seed(secrets.randbits(63))
    return g


def noise_dtype(dtype: torch.dtype) -> torch.dtype:
    """Noise and sums are computed in float32 at least."""
    return torch.promote_types(dtype, torch.float32)


def add_noise(
    sums: Mapping[str, Tensor],
    std: float,
    generator: Optional[torch.Generator],
) -> Dict[str, Tensor]:
    """``sums[n] + N(0, std² I)`` for every tensor, float32 or wider. ``std == 0`` adds nothing."""
    if std == 0:
        return {n: s.to(noise_dtype(s.dtype)) for n, s in sums.items()}
    out: Dict[str, Tensor] = {}
    for n, s in sums.items():
        dt = noise_dtype(s.dtype)
        dev = generator.device if generator is not None else s.device
        z = torch.randn(s.shape, dtype=dt, device=dev, generator=generator).to(s.device)
        out[n] = s.to(dt) + z.mul_(std)
    return out
