"""RMSNorm: torch ``nn.RMSNorm`` and LLaMA-style custom modules (x·rsqrt(mean(x²)+eps)·w).

Custom modules are matched by class name containing "RMSNorm" with a ``.weight`` and a
``variance_epsilon`` (or ``eps``) attribute, and *verified on every call*: the rule recomputes
w ⊙ x̂ and compares it with the module's output; on mismatch (e.g. Gemma's (1 + w) scaling) it
returns None and the engine falls back to exact vmap for that layer.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from .base import Explicit, Rule, Use, first_input


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class TorchRMSNormRule(Rule):
    """nn.RMSNorm: G_w,i = Σ_t g ⊙ x·rsqrt(mean(x²)+eps) (B, *normalized_shape)."""

    name = "rmsnorm"
    needs_output = False
    eager = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        if module.weight is None:
            return {}
        x = first_input(args, kwargs, "x")
        k = len(module.normalized_shape)
        if x is None or x.dim() < k + 1 or x.shape[0] != batch_size:
            return None
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        dims = tuple(range(x.dim() - k, x.dim()))
        xa = x.to(_acc(x.dtype))
        xhat = xa * torch.rsqrt(xa.pow(2).mean(dims, keepdim=True) + eps)
        red = tuple(range(1, x.dim() - k))
        gw = grad_output.to(xhat.dtype) * xhat
        return {"weight": Explicit(gw.sum(red) if red else gw)}


def is_custom_rmsnorm(module: nn.Module) -> bool:
    """Class name contains "RMSNorm", has a 1-d ``weight`` Parameter and an epsilon attribute."""
    w = getattr(module, "weight", None)
    return (
        "RMSNorm" in type(module).__name__
        and isinstance(w, Tensor)
        and w.dim() == 1
        and set(module._parameters) <= {"weight"}
        and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)), float)
    )


class CustomRMSNormRule(Rule):
    """LLaMA-style: out = w ⊙ (x_f32 · rsqrt(mean(x_f32²)+eps)).to(x.dtype), checked against the output."""

    name = "rmsnorm_custom"

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "hidden_states")
        if x is None or x.dim() < 2 or x.shape[0] != batch_size or not isinstance(output, Tensor):
            return None
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", None)))
        w = module.weight.detach()
        out64 = output.detach().to(torch.float64)
        xhats, errs = [], []
        for compute in dict.fromkeys((torch.float32, _acc(x.dtype))):  # LLaMA: float32, cast back
            h = x.to(compute)
            xhat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
            ref = w * xhat
            if ref.shape != output.shape:
                return None
            xhats.append(xhat)
            errs.append((ref.to(torch.float64) - out64).abs().max() if ref.numel() else out64.new_zeros(()))
        scale = out64.abs().max() if out64.numel() else out64.new_zeros(())
        # one host read for the whole check (each read is a sync on a GPU)
        *errs_h, scale_h = torch.stack([*errs, scale]).tolist()
        tol = 8 * torch.finfo(output.dtype).eps * max(scale_h, 1.0)
        ok = [(e, i) for i, e in enumerate(errs_h) if e <= tol]
        if not ok:
            return None  # not the formula we know: exact fallback
        xhat = xhats[min(ok)[1]]
        acc = _acc(x.dtype)
        gw = grad_output.to(acc) * xhat.to(acc)  # (B, *, d)
        red = tuple(range(1, gw.dim() - 1))
        return {"weight": Explicit(gw.sum(red) if red else gw)}


TYPES = (nn.RMSNorm,)
