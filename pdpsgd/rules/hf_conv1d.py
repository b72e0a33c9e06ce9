"""Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2): y = addmm(b, x, W), W (in, out)."""
from __future__ import annotations

import sys
from typing import Dict, Optional

from torch import nn

from .base import Dense, Rule, Use, as_btd, first_input


class HFConv1DRule(Rule):
    """G_W,i = Σ_t a[i,t] ⊗ g[i,t] (in, out), the transpose of Linear's layout; G_b,i = Σ_t g[i,t]."""

    name = "hf_conv1d"
    needs_output = False
    rowwise = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "x")
        if x is None:
            return None
        a = as_btd(x, batch_size)  # (B, T, in)
        g = as_btd(grad_output, batch_size)  # (B, T, out)
        if a is None or g is None or a.shape[1] != g.shape[1]:
            return None
        out: Dict[str, Use] = {"weight": Dense(a, g)}
        if getattr(module, "bias", None) is not None:
            out["bias"] = Dense(g, None)
        return out


def is_hf_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (or a subclass keeping its forward), without importing transformers."""
    mod = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(mod, "Conv1D", None) if mod is not None else None
    return cls is not None and isinstance(module, cls) and type(module).forward is cls.forward
