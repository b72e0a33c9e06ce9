"""nn.Linear, any leading dims: y = x Wᵀ + b, W (out, in)."""
from __future__ import annotations

from typing import Dict, Optional

from torch import nn

from .base import Dense, Rule, Use, as_btd, first_input


class LinearRule(Rule):
    """G_W,i = Σ_t g[i,t] ⊗ a[i,t] (out, in); G_b,i = Σ_t g[i,t]."""

    name = "linear"
    needs_output = False
    rowwise = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        if x is None:
            return None
        a = as_btd(x, batch_size)  # (B, T, in)
        g = as_btd(grad_output, batch_size)  # (B, T, out)
        if a is None or g is None or a.shape[1] != g.shape[1]:
            return None
        out: Dict[str, Use] = {"weight": Dense(g, a)}
        if module.bias is not None:
            out["bias"] = Dense(g, None)
        return out


TYPES = (nn.Linear,)
