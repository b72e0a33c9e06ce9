"""nn.LayerNorm: y = x̂ ⊙ w + b over the last len(normalized_shape) dims."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import Explicit, Rule, Use, first_input


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class LayerNormRule(Rule):
    """G_w,i = Σ_t g ⊙ x̂ and G_b,i = Σ_t g, both (B, *normalized_shape): explicit, always cheap."""

    name = "layernorm"

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
            xhat = F.layer_norm(x.to(acc), module.normalized_shape, None, None, module.eps)
            gw = g * xhat
            out["weight"] = Explicit(gw.sum(red) if red else gw)
        if module.bias is not None:
            out["bias"] = Explicit(g.sum(red) if red else g)
        return out


TYPES = (nn.LayerNorm,)
