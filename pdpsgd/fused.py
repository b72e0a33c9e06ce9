"""Noise + scale for all parameters in one (optionally ``torch.compile``-fused) function.

The clip is already inside the clipped sums (Σ_i c_i g_i, computed by the engines); what is left
per step is, for every parameter, ``(sum + std · z) / denom`` cast to the parameter's dtype, with
z ~ N(0, I) drawn in float32 or wider. Eager PyTorch runs 3 elementwise kernels per parameter
(hundreds of small launches for a transformer); the compiled version fuses them.

Noise is drawn as ONE flat ``torch.empty(total).normal_(generator)`` (the kernel ``torch.randn``
runs: same stream, same values) of all parameters' total size from the caller's generator, then
split; compiled and eager therefore use the very same z and agree to float rounding. Eager (the CPU
default) then computes each output in place on its slice of that fresh buffer,
``z·(std/denom) + s/denom`` (2 passes, no temporaries; the inputs are never modified).

Formal guarantee: each coordinate of the output is (s + std·z)/denom with z an independent
standard normal drawn in float32 or wider (never in bf16/fp16) from ``generator``; with
std = σC and sums of L2 sensitivity C this is the Gaussian mechanism.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

__all__ = ["noise_and_scale", "default_compile"]

_COMPILED = None


def _apply(sums, zs, std: float, inv_denom: float, dtypes):
    # per tensor: (s + std·z) · (1/denom) -> param dtype; one fused kernel per tensor group when compiled
    return {n: ((s + zs[n] * std) * inv_denom).to(dtypes[n]) for n, s in sums.items()}


def _compiled():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_apply, dynamic=False, fullgraph=True)
    return _COMPILED


def default_compile(device: torch.device) -> bool:
    """Compiled by default on CUDA only (compile time is not worth it on CPU)."""
    return device.type == "cuda"


def noise_and_scale(
    sums: Mapping[str, Tensor],
    std: float,
    generator: Optional[torch.Generator],
    denom: float,
    dtypes: Mapping[str, torch.dtype],
    *,
    compile: Optional[bool] = None,
) -> Dict[str, Tensor]:
    """``{n: ((sums[n] + N(0, std²)) / denom).to(dtypes[n])}``, noise in float32 or wider."""
    if not sums:
        return {}
    first = next(iter(sums.values()))
    if compile is None:
        compile = default_compile(first.device)
    acc = {n: torch.promote_types(s.dtype, torch.float32) for n, s in sums.items()}
    sums = {n: (s if s.dtype == acc[n] else s.to(acc[n])) for n, s in sums.items()}  # no copy when already acc
    inv = 1.0 / float(denom)
    if std == 0:
        if compile:
            zs = {n: torch.zeros((), dtype=acc[n], device=s.device) for n, s in sums.items()}
            return _compiled()(sums, zs, 0.0, inv, dict(dtypes))
        return {n: (s * inv).to(dtypes[n]) for n, s in sums.items()}
    ndt = max(acc.values(), key=lambda d: torch.finfo(d).bits)
    total = sum(s.numel() for s in sums.values())
    dev = generator.device if generator is not None else first.device
    # empty().normal_() is the very kernel randn runs (same stream, same values), one call for all
    flat = torch.empty(total, dtype=ndt, device=dev).normal_(generator=generator).to(first.device)
    zs, off = {}, 0
    for n, s in sums.items():
        zs[n] = flat[off : off + s.numel()].view(s.shape)
        off += s.numel()
    if compile:
        return _compiled()(sums, {n: z.to(acc[n]) for n, z in zs.items()}, float(std), inv, dict(dtypes))
    out: Dict[str, Tensor] = {}
    for n, s in sums.items():
        z = zs[n]
        if z.dtype == acc[n] and z.device == s.device:
            # in place on this tensor's slice of the fresh noise buffer: z·(std/denom) + s/denom, 2 passes
            out[n] = z.mul_(std * inv).add_(s, alpha=inv).to(dtypes[n])
        else:
            out[n] = ((s + z.to(acc[n]) * std) * inv).to(dtypes[n])
    return out
