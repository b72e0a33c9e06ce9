"""nn.Conv1d / nn.Conv2d (groups=1, zero padding) via unfold: a conv is a Linear over patches."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn.functional as F
from torch import nn

from .base import Dense, Rule, Use, first_input


def _pad(module: nn.Module, k: Tuple[int, ...], dil: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    p = module.padding
    if isinstance(p, str):
        if p == "valid":
            return tuple(0 for _ in k)
        tot = [d * (kk - 1) for d, kk in zip(dil, k)]
        if any(t % 2 for t in tot):
            return None  # asymmetric 'same' padding: not an unfold padding
        return tuple(t // 2 for t in tot)
    return tuple(p)


class ConvRule(Rule):
    """Patches U (B, L, C_in·k) = unfold(x), g (B, L, C_out): G_W,i = Σ_l g ⊗ U (C_out, C_in·k)."""

    name = "conv"
    needs_output = False

    def supports(self, module: nn.Module) -> Optional[str]:
        if module.groups != 1:
            return "groups > 1"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}"
        return None

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        nd = 1 if isinstance(module, nn.Conv1d) else 2
        if x is None or x.dim() != nd + 2 or x.shape[0] != batch_size:
            return None
        k, dil, st = tuple(module.kernel_size), tuple(module.dilation), tuple(module.stride)
        pad = _pad(module, k, dil)
        if pad is None:
            return None
        if nd == 1:  # treat as 2-d with height 1
            x = x.unsqueeze(2)
            k, dil, st, pad = (1,) + k, (1,) + dil, (1,) + st, (0,) + pad
        U = F.unfold(x, k, dilation=dil, padding=pad, stride=st).transpose(1, 2)  # (B, L, C_in·k)
        g = grad_output.reshape(batch_size, grad_output.shape[1], -1).transpose(1, 2)  # (B, L, C_out)
        if U.shape[1] != g.shape[1]:
            return None
        out: Dict[str, Use] = {"weight": Dense(g, U)}
        if module.bias is not None:
            out["bias"] = Dense(g, None)
        return out


TYPES = (nn.Conv1d, nn.Conv2d)
