"""nn.LayerNorm: y = x̂ ⊙ w + b over the last len(normalized_shape) dims."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Explicit, Rule, Use, first_input


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


_UNIT: Dict[Tuple, Tuple[Tensor, Tensor]] = {}  # (shape, dtype, device) -> (ones, zeros): constants


def _unit_affine(shape, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Unit weight and zero bias of this shape (made once per shape, dtype and device: two fewer
    launches per LayerNorm call on a GPU). Constants, never written."""
    key = (tuple(shape), dtype, device)
    hit = _UNIT.get(key)
    if hit is None:
        ones = torch.ones(shape, dtype=dtype, device=device)
        hit = (ones, torch.zeros_like(ones))
        # cache only plain tensors made in normal mode (not fake/meta tracing tensors, inference-mode
        # tensors, or a CUDA graph capture, whose fills would not run)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if type(ones) is Tensor and not torch.is_inference_mode_enabled() and not capturing:
            _UNIT[key] = hit
    return hit


class LayerNormRule(Rule):
    """G_w,i = Σ_t g ⊙ x̂ and G_b,i = Σ_t g, both (B, *normalized_shape): explicit, always cheap."""

    name = "layernorm"
    needs_output = False
    rowwise = True
    eager = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        k = len(module.normalized_shape)
        if x is None or x.dim() < k + 1 or x.shape[0] != batch_size:
            return None
        acc = _acc(x.dtype)
        red = tuple(range(1, x.dim() - k))  # dims summed per example
        g = grad_output.to(acc)
        out: Dict[str, Use] = {}
        if module.weight is not None:
            # x̂ = layer_norm(x) with unit weight / zero bias: x̂·1 + 0 is exactly x̂, and the affine
            # CPU kernel is ~2x faster than the weight=None path
            ones, zeros = _unit_affine(module.normalized_shape, acc, x.device)
            xhat = F.layer_norm(x.to(acc), module.normalized_shape, ones, zeros, module.eps)
            gw = g * xhat
            out["weight"] = Explicit(gw.sum(red) if red else gw)
        if module.bias is not None:
            out["bias"] = Explicit(g.sum(red) if red else g)
        return out


TYPES = (nn.LayerNorm,)
