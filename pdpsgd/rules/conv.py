"""nn.Conv1d / nn.Conv2d via unfold: a conv is a Linear over patches (any groups, any padding mode)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import Dense, Explicit, Rule, Use, first_input


def _pad(module: nn.Module, k: Tuple[int, ...], dil: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """The symmetric zero padding per spatial dim that unfold can take, or None (asymmetric 'same')."""
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
    """Patches U (B, L, C_in·k) = unfold(x), g (B, L, C_out).

    groups = 1: G_W,i = Σ_l g ⊗ U (C_out, C_in·k), a ``Dense`` use (ghost or explicit route).
    groups = G > 1: output channels of group j (a contiguous block of C_out/G) see only the input
    channels of group j (C_in/G, a contiguous block of C_in/G·k patch entries, unfold being channel
    major), so G_W,i = [Σ_l g_j ⊗ U_j]_j (C_out, C_in/G·k), an ``Explicit`` per-example gradient
    (a grouped / depthwise conv has few weights: C_out·C_in/G·k).
    A padding mode other than zeros (and an asymmetric 'same' padding) pads x as the layer's own
    forward does (``F.pad`` with the layer's ``_reversed_padding_repeated_twice``) before the unfold."""

    name = "conv"
    needs_output = False
    wants_names = True

    def supports(self, module: nn.Module) -> Optional[str]:
        base = nn.Conv1d if isinstance(module, nn.Conv1d) else nn.Conv2d
        if getattr(type(module), "_conv_forward", None) is not base._conv_forward:
            # (e.g. weight standardisation there: the output is not the conv of x with the weight)
            return f"{type(module).__name__} has its own _conv_forward"
        if module.padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            return f"padding_mode={module.padding_mode!r}"
        return None

    def uses(self, module, args, kwargs, output, grad_output, batch_size,
             wanted: Optional[frozenset] = None) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        nd = 1 if isinstance(module, nn.Conv1d) else 2
        if x is None or x.dim() != nd + 2 or x.shape[0] != batch_size:
            return None
        g = grad_output.reshape(batch_size, grad_output.shape[1], -1).transpose(1, 2)  # (B, L, C_out)
        out: Dict[str, Use] = {}
        if module.bias is not None:
            out["bias"] = Dense(g, None)
        if wanted is not None and "weight" not in wanted:
            return out  # a frozen (or parametrized) weight: no patches, no per-example gradient
        k, dil, st = tuple(module.kernel_size), tuple(module.dilation), tuple(module.stride)
        pad = _pad(module, k, dil) if module.padding_mode == "zeros" else None
        if pad is None:  # padded as ``_ConvNd``'s forward pads for a non-zeros mode / F.conv for 'same'
            rp = getattr(module, "_reversed_padding_repeated_twice", None)
            if rp is None or len(rp) != 2 * nd:
                return None
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, tuple(rp), mode=mode)
            pad = tuple(0 for _ in k)
        if nd == 1:  # treat as 2-d with height 1
            x = x.unsqueeze(2)
            k, dil, st, pad = (1,) + k, (1,) + dil, (1,) + st, (0,) + pad
        U = F.unfold(x, k, dilation=dil, padding=pad, stride=st).transpose(1, 2)  # (B, L, C_in·k)
        if U.shape[1] != g.shape[1]:
            return None
        G = module.groups
        if G == 1:
            out["weight"] = Dense(g, U)
        else:
            B, L = g.shape[0], g.shape[1]
            gj = g.reshape(B, L, G, g.shape[2] // G)  # (B, L, G, C_out/G)
            Uj = U.reshape(B, L, G, U.shape[2] // G)  # (B, L, G, C_in/G·k)
            W = torch.einsum("blgo,blgi->bgoi", gj, Uj)  # (B, G, C_out/G, C_in/G·k)
            out["weight"] = Explicit(W.reshape(B, *module.weight.shape))
        return out


TYPES = (nn.Conv1d, nn.Conv2d)
