"""nn.Conv1d / nn.Conv2d / nn.Conv3d, any padding mode: via unfold, a conv being a Linear over patches
(groups = 1), or torch's own weight-gradient kernel run per example (groups > 1)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .base import Dense, Explicit, Rule, Use, first_input


def _patches3d(x, k: Tuple[int, ...], dil: Tuple[int, ...], pad: Tuple[int, ...], st: Tuple[int, ...]):
    """(B, C, D, H, W) -> (B, L, C·kd·kh·kw): ``F.unfold`` for three spatial dims (it takes two), by
    ``Tensor.unfold`` per dim (a window of dil·(k−1)+1, every dil-th element kept); the feature order
    (C, kd, kh, kw) is the weight's flattened (C_in, kd, kh, kw)."""
    if any(pad):
        x = F.pad(x, tuple(q for p in reversed(pad) for q in (p, p)))
    for i, (kk, d, s) in enumerate(zip(k, dil, st)):
        x = x.unfold(2 + i, d * (kk - 1) + 1, s)  # (B, C, ..., window) per dim
        if d > 1:
            x = x[..., ::d]
    B, C = x.shape[:2]
    x = x.permute(0, 2, 3, 4, 1, 5, 6, 7)  # (B, D', H', W', C, kd, kh, kw)
    return x.reshape(B, -1, C * k[0] * k[1] * k[2])  # (B, L, C·k)


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
    channels of group j, so each example's weight gradient is that of a convolution of its own: the
    batch is run as one convolution of B·G groups (x as (1, B·C_in, ...), g as (1, B·C_out, ...)),
    whose weight gradient (B·C_out, C_in/G, *k) is every example's, an ``Explicit`` per-example
    gradient (a grouped / depthwise conv has few weights: C_out·C_in/G·k); no patches (2.6–3.7x
    faster than unfold + einsum at ConvBERT's and a Wav2Vec2-like depthwise shape, no k-fold copy of x).
    A padding mode other than zeros (and an asymmetric 'same' padding) pads x as the layer's own
    forward does (``F.pad`` with the layer's ``_reversed_padding_repeated_twice``) before the unfold."""

    name = "conv"
    needs_output = False
    wants_names = True

    def supports(self, module: nn.Module) -> Optional[str]:
        base = next(t for t in TYPES if isinstance(module, t))
        if getattr(type(module), "_conv_forward", None) is not base._conv_forward:
            # (e.g. weight standardisation there: the output is not the conv of x with the weight)
            return f"{type(module).__name__} has its own _conv_forward"
        if module.padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            return f"padding_mode={module.padding_mode!r}"
        return None

    def uses(self, module, args, kwargs, output, grad_output, batch_size,
             wanted: Optional[frozenset] = None) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        nd = 1 if isinstance(module, nn.Conv1d) else 3 if isinstance(module, nn.Conv3d) else 2
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
        G = module.groups
        if G == 1:
            if nd == 3:
                U = _patches3d(x, k, dil, pad, st)  # (B, L, C_in·k)
            else:
                U = F.unfold(x, k, dilation=dil, padding=pad, stride=st).transpose(1, 2)  # (B, L, C_in·k)
            if U.shape[1] != g.shape[1]:
                return None
            out["weight"] = Dense(g, U)
            return out
        # grouped: the B examples as B·G groups of one convolution, whose weight gradient is then each
        # example's own (B·C_out, C_in/G, *k); no patches (a depthwise conv's unfold is k times its
        # input): torch's own weight-gradient kernel, in float32 at least
        B, C_out = batch_size, module.out_channels
        acc = torch.promote_types(x.dtype, torch.float32)
        xb = x.to(acc).reshape(1, B * x.shape[1], *x.shape[2:])  # (1, B·C_in, H, W) (or D, H, W)
        go = grad_output.unsqueeze(2) if nd == 1 else grad_output  # (B, C_out, H', W') (or D', H', W')
        if go.dim() != len(k) + 2 or go.shape[:2] != (B, C_out):
            return None
        if all(kk == 1 for kk in k) and all(s == 1 for s in st) and not any(pad) and go.shape[2:] == x.shape[2:]:
            # a pointwise grouped conv (SqueezeBERT's q/k/v and FFN): per example and group a Linear over the
            # positions, one batched matmul (B·G, C_out/G, L) x (B·G, L, C_in/G); torch's grouped weight-gradient
            # kernel loops over the B·G groups on CPU (~2.5x the time at SqueezeBERT's shapes)
            L = go[0, 0].numel()
            xg = x.to(acc).reshape(B * G, x.shape[1] // G, L)  # (B·G, C_in/G, L)
            gg = go.to(acc).reshape(B * G, C_out // G, L)  # (B·G, C_out/G, L)
            out["weight"] = Explicit(torch.bmm(gg, xg.transpose(1, 2)).reshape(B, *module.weight.shape))
            return out
        gb = go.to(acc).reshape(1, B * C_out, *go.shape[2:])  # (1, B·C_out, H', W')
        w = xb.new_zeros((B * C_out, module.in_channels // G, *k))  # (its values are not read: only the shape)
        try:
            dw = torch.ops.aten.convolution_backward(gb, xb, w, None, list(st), list(pad), list(dil), False,
                                                     [0] * len(k), B * G, [False, True, False])[1]
        except RuntimeError:
            return None  # (shapes that do not match the layer's own: its exact fallback)
        out["weight"] = Explicit(dw.reshape(B, *module.weight.shape))  # (B, C_out, C_in/G, *k)
        return out


TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
