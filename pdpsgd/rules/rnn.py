"""nn.LSTM / nn.GRU / nn.RNN on padded (B, T, F) or (T, B, F) input: every weight is linear-like.

A recurrent layer applies the same two linear maps at every step t of direction d of layer l:
    gi_t = W_ih x_t + b_ih        gh_t = W_hh h_{t-1} + b_hh
so example i's gradient is an outer-product sum over time, exactly the Linear form:
    G_W_ih,i = Σ_t ∂gi_t ⊗ x_t       G_W_hh,i = Σ_t ∂gh_t ⊗ h_{t-1}
    G_b_ih,i = Σ_t ∂gi_t             G_b_hh,i = Σ_t ∂gh_t
(for LSTM and Elman RNNs ∂gh_t = ∂gi_t, both enter the gates as a sum; GRU's differ).

torch's fused kernel hides gi, gh and h_{t-1}, so during capture this rule runs the layer itself
(``forward``): the input projection for all steps in one matmul, then a loop over time with the
same cell math as ``pdpsgd.rnn`` (tested equal to ``torch._VF`` in float64), keeping gi
(B, T, G·H), every h_{t-1} and, for GRU, every gh_t as capture targets. For LSTM the loop is one
autograd node (``_LSTMLayer``: all directions stacked, hand-written backward through time); GRU and
Elman RNNs use a plain autograd loop. A PackedSequence is run
padded in its length-sorted order, each row keeping its state outside its valid steps (as ATen's
packed kernel does), so padded steps get exactly zero gradient. Declined (-> exact vmap
fallback): unbatched input, ``proj_size`` > 0, dropout between layers in train mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .base import Dense, Rule, Use

__all__ = ["RNNRule", "TYPES"]


@dataclass
class _DirCapture:
    sfx: str  # parameter suffix, e.g. "_l0" or "_l1_reverse"
    x: Tensor  # (B, T, F) input of this layer (detached)
    h_prev: Tensor  # (B, T, H) state entering each step (detached)
    n_gh: int  # number of gh targets (0 when ∂gh = ∂gi)


@dataclass
class RNNCapture:
    targets: List[Tensor]  # what the engine differentiates: per direction gi, then gh_0..gh_{T-1} (GRU)
    dirs: List[_DirCapture]
    has_bias: bool
    order: Optional[Tensor] = None  # packed input: row of example i in the length-sorted layout


def _unpack(x: PackedSequence) -> Tuple[Tensor, Tensor]:
    """PackedSequence -> (padded (B, T, F) in length-sorted order with zeros past each length,
    (B, T) bool mask of the valid steps)."""
    bs = [int(b) for b in x.batch_sizes]
    B, T = bs[0], len(bs)
    steps = torch.arange(T, device=x.data.device).repeat_interleave(x.batch_sizes.to(x.data.device))  # (N,)
    rows = torch.cat([torch.arange(b, device=x.data.device) for b in bs])  # (N,)
    pad = x.data.new_zeros(B, T, x.data.shape[-1])
    pad[rows, steps] = x.data  # (N, F) -> (B, T, F)
    mask = torch.zeros(B, T, dtype=torch.bool, device=x.data.device)
    mask[rows, steps] = True
    return pad, mask


def _leaf_if_constant(t: Tensor) -> Tensor:
    # gi / gh built from detached weights and a constant input (e.g. a frozen embedding or h0 = 0)
    # would not require grad; a leaf lets the engine read its gradient (nothing upstream needs it).
    return t if t.requires_grad or not torch.is_grad_enabled() else t.detach().requires_grad_(True)


def _step(mode: str, gi_t: Tensor, gh: Tensor, state: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """One GRU / Elman cell step given both projections; same math as ``pdpsgd.rnn`` / ATen (the LSTM
    runs in ``_LSTMLayer``)."""
    if mode == "GRU":
        (h,) = state
        i_r, i_z, i_n = gi_t.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return ((h - n) * z + n,)
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return (act(gi_t + gh),)


class _LSTMLayer(torch.autograd.Function):
    """The D directions of one LSTM layer, stacked and run in one loop, given their input
    projections; hand-written backward through time: one graph node instead of ~40 per step and
    direction (the autograd loop's cost on CPU).

    forward(G (D, B, T, 4H), h0 (D, B, H), c0 (D, B, H), W (D, 4H, H), b (D, 4H) | None,
    mask (D, B, T) | None) -> (Y (D, B, T, H), h_T, c_T, h_prev (D, B, T, H)), all in *loop time*
    (the caller flips a reverse direction's time axis in and out). W / b are constants here (BK takes
    the recurrent weights' per-example gradients from ∂G and h_prev), so the backward returns
    gradients for G, h0 and c0 only. A row keeps its state (h, c) where ``mask`` is False (packed
    sequences). Same math as ATen's cell.
    """

    @staticmethod
    def forward(ctx, G, h0, c0, W, b, mask):
        D, B, T, G4 = G.shape
        H = G4 // 4
        Gb = G if b is None else G + b[:, None, None, :]  # (D, B, T, 4H)
        Wt = W.transpose(1, 2)  # (D, H, 4H)
        h, c = h0, c0
        acts, tcs, hps, cps, ys = [], [], [], [], []
        for s in range(T):
            hps.append(h)
            cps.append(c)
            a = torch.baddbmm(Gb[:, :, s], h, Wt)  # (D, B, 4H) gate pre-activations
            a[..., : 2 * H].sigmoid_()
            a[..., 2 * H : 3 * H].tanh_()
            a[..., 3 * H :].sigmoid_()
            i, f, g, o = a.split(H, dim=-1)
            c_new = torch.addcmul(f * c, i, g)  # f·c + i·g
            tc = torch.tanh(c_new)
            h_new = o * tc
            if mask is not None:
                m = mask[:, :, s : s + 1]  # (D, B, 1)
                h_new, c_new = torch.where(m, h_new, h), torch.where(m, c_new, c)
            acts.append(a)
            tcs.append(tc)
            ys.append(h_new)
            h, c = h_new, c_new
        A, TC = torch.stack(acts, 2), torch.stack(tcs, 2)  # (D, B, T, 4H), (D, B, T, H)
        HP, CP, Y = torch.stack(hps, 2), torch.stack(cps, 2), torch.stack(ys, 2)  # (D, B, T, H) each
        ctx.save_for_backward(A, TC, CP, W, mask)
        ctx.mark_non_differentiable(HP)
        return Y, h, c, HP

    @staticmethod
    def backward(ctx, dY, dhT, dcT, _dHP):
        A, TC, CP, W, mask = ctx.saved_tensors
        D, B, T, G4 = A.shape
        H = G4 // 4
        i, f, g, o = A.split(H, dim=-1)  # (D, B, T, H) each
        # ∂gates = ∂act ⊙ act'; ∂act = [∂c·g, ∂c·c_prev, ∂c·i, ∂h·tanh(c)] -> precompute the products
        M = torch.cat([g * i * (1 - i), CP * f * (1 - f), i * (1 - g * g), TC * o * (1 - o)], -1)  # (D, B, T, 4H)
        OT = o * (1 - TC * TC)  # ∂c_new/∂h_new factor, (D, B, T, H)
        dh = torch.zeros_like(TC[:, :, 0]) if dhT is None else dhT
        dc = torch.zeros_like(TC[:, :, 0]) if dcT is None else dcT
        dG = torch.empty_like(A)
        for s in range(T - 1, -1, -1):
            if dY is not None:
                dh = dh + dY[:, :, s]
            if mask is not None:
                m = mask[:, :, s : s + 1]
                keep_h, keep_c = torch.where(m, 0.0, dh), torch.where(m, 0.0, dc)
                dh, dc = torch.where(m, dh, 0.0), torch.where(m, dc, 0.0)
            dct = torch.addcmul(dc, dh, OT[:, :, s])  # total ∂c_new, (D, B, H)
            dg_s = torch.cat([dct, dct, dct, dh], -1).mul_(M[:, :, s])  # (D, B, 4H)
            dG[:, :, s] = dg_s
            dh = torch.bmm(dg_s, W)  # (D, B, 4H) x (D, 4H, H)
            dc = dct * f[:, :, s]
            if mask is not None:
                dh, dc = dh + keep_h, dc + keep_c
        return dG, dh, dc, None, None, None


class RNNRule(Rule):
    """Runs the recurrent layer during capture and returns Linear-form uses for all its weights."""

    name = "rnn"
    custom_forward = True

    def supports(self, module: nn.Module) -> Optional[str]:
        if getattr(module, "proj_size", 0):
            return "LSTM with proj_size > 0 has no BK rule"
        if module.mode not in ("LSTM", "GRU", "RNN_TANH", "RNN_RELU"):
            return f"unknown RNN mode {module.mode}"
        return None

    def forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        """(output as the module returns it, RNNCapture), or why it declines this call (a str)."""
        x = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        if module.dropout > 0 and module.training and module.num_layers > 1:
            # (review, round 37: the reason was not said; the fallback cannot run packed input either)
            return ("inter-layer dropout in training mode (num_layers > 1, dropout > 0) has no rule: the exact "
                    "fallback runs it, which cannot take packed input; set dropout=0, stack one-layer RNNs with "
                    "nn.Dropout between them, or pad the sequences")
        mode, H, L = module.mode, module.hidden_size, module.num_layers
        D = 2 if module.bidirectional else 1
        packed = isinstance(x, PackedSequence)
        mask = None
        if packed:
            if x.data.dim() != 2:
                return "packed input whose data is not 2-d"
            xb, mask = _unpack(x)  # (B, T, F) sorted by length, (B, T)
        elif isinstance(x, Tensor) and x.dim() == 3:
            xb = x if module.batch_first else x.transpose(0, 1)  # (B, T, F)
        else:
            return "unbatched (2-d) input: the rule reads a batch"
        B, T = xb.shape[0], xb.shape[1]
        if hx is None:
            z = torch.zeros(L * D, B, H, dtype=xb.dtype, device=xb.device)
            hx = (z, z) if mode == "LSTM" else z
        h0s = hx if mode == "LSTM" else (hx,)  # each (L·D, B, H)
        if any(not isinstance(h, Tensor) or h.dim() != 3 or h.shape[1] != B for h in h0s):
            return "an initial state that is not (layers·directions, B, hidden)"
        if packed and x.sorted_indices is not None:
            h0s = tuple(h.index_select(1, x.sorted_indices) for h in h0s)  # as nn.RNNBase.permute_hidden
        targets: List[Tensor] = []
        dirs: List[_DirCapture] = []
        finals: List[List[Tensor]] = [[] for _ in h0s]
        layer_in = xb
        for layer in range(L):
            outs = []
            if mode == "LSTM":  # all directions in one loop, hand-written backward (one graph node)
                gs, ws, bs, sfxs = [], [], [], []
                for d in range(D):
                    sfx = f"_l{layer}" + ("_reverse" if d else "")
                    b_ih = getattr(module, "bias_ih" + sfx) if module.bias else None
                    gi = _leaf_if_constant(F.linear(layer_in, getattr(module, "weight_ih" + sfx), b_ih))  # (B, T, 4H)
                    targets.append(gi)
                    gs.append(gi.flip(1) if d else gi)  # a reverse direction runs in flipped time
                    ws.append(getattr(module, "weight_hh" + sfx))
                    bs.append(getattr(module, "bias_hh" + sfx) if module.bias else None)
                    sfxs.append(sfx)
                masks = None if mask is None else torch.stack([mask.flip(1) if d else mask for d in range(D)])
                Y, hT, cT, HP = _LSTMLayer.apply(
                    torch.stack(gs), h0s[0][layer * D:(layer + 1) * D], h0s[1][layer * D:(layer + 1) * D],
                    torch.stack(ws), None if bs[0] is None else torch.stack(bs), masks)
                for d in range(D):
                    dirs.append(_DirCapture(sfxs[d], layer_in.detach(), HP[d].flip(1) if d else HP[d], 0))
                    outs.append(Y[d].flip(1) if d else Y[d])  # (B, T, H) in real time
                    finals[0].append(hT[d])
                    finals[1].append(cT[d])
                layer_in = outs[0] if D == 1 else torch.cat(outs, 2)  # (B, T, D·H)
                continue
            for d in range(D):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
                b_ih = getattr(module, "bias_ih" + sfx) if module.bias else None
                b_hh = getattr(module, "bias_hh" + sfx) if module.bias else None
                gi = _leaf_if_constant(F.linear(layer_in, w_ih, b_ih))  # (B, T, F) -> (B, T, G·H)
                targets.append(gi)
                state = tuple(h[layer * D + d] for h in h0s)  # (B, H) each
                h_prev: List[Tensor] = [None] * T  # type: ignore[list-item]
                gh_t: List[Tensor] = [None] * T  # type: ignore[list-item]
                out: List[Tensor] = [None] * T  # type: ignore[list-item]
                gis = gi.unbind(1)  # T x (B, G·H); one backward node (gi[:, t] would zero-fill (B, T, G·H) per step)
                for t in (range(T - 1, -1, -1) if d else range(T)):
                    h_prev[t] = state[0]
                    gh = F.linear(state[0], w_hh, b_hh)  # (B, H) -> (B, G·H)
                    if mode == "GRU":
                        gh = _leaf_if_constant(gh)
                        gh_t[t] = gh
                    new = _step(mode, gis[t], gh, state)
                    if mask is not None:  # packed: a finished (or not yet started) sequence keeps its state
                        m_t = mask[:, t].unsqueeze(1)  # (B, 1)
                        new = tuple(torch.where(m_t, a, b) for a, b in zip(new, state))
                    state = new
                    out[t] = state[0]
                if mode == "GRU":
                    targets.extend(gh_t)
                dirs.append(_DirCapture(sfx, layer_in.detach(), torch.stack(h_prev, 1).detach(),
                                        T if mode == "GRU" else 0))
                outs.append(torch.stack(out, 1))  # (B, T, H)
                for k, s in enumerate(state):
                    finals[k].append(s)
            layer_in = outs[0] if D == 1 else torch.cat(outs, 2)  # (B, T, D·H)
        hn = tuple(torch.stack(f, 0) for f in finals)  # (L·D, B, H) each
        order = None
        if packed:
            data = layer_in.transpose(0, 1)[mask.t()]  # (T, B, D·H) at valid steps, time-major -> (N, D·H)
            y = PackedSequence(data, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
            if x.unsorted_indices is not None:
                hn = tuple(h.index_select(1, x.unsorted_indices) for h in hn)
                order = x.unsorted_indices
        else:
            y = layer_in if module.batch_first else layer_in.transpose(0, 1)
        return (y, hn if mode == "LSTM" else hn[0]), RNNCapture(targets, dirs, module.bias, order)

    def custom_uses(self, module: nn.Module, capture: RNNCapture, grads: List[Optional[Tensor]],
                    batch_size: int) -> Optional[Dict[str, Use]]:
        out: Dict[str, Use] = {}
        k = 0
        o = capture.order  # packed input: back from the length-sorted rows to example order
        perm = (lambda t: t) if o is None else (lambda t: t.index_select(0, o))
        for dc in capture.dirs:
            gi_target = capture.targets[k]
            g_gi = grads[k] if grads[k] is not None else torch.zeros_like(gi_target)  # (B, T, G·H)
            k += 1
            if dc.n_gh:
                g_gh = torch.stack([g if g is not None else torch.zeros_like(tg)
                                    for g, tg in zip(grads[k:k + dc.n_gh], capture.targets[k:k + dc.n_gh])], 1)
                k += dc.n_gh  # (B, T, G·H)
            else:
                g_gh = g_gi
            g_gi, g_gh = perm(g_gi), (perm(g_gh) if dc.n_gh else None)
            g_gh = g_gi if g_gh is None else g_gh
            out["weight_ih" + dc.sfx] = Dense(g_gi, perm(dc.x))  # (B, T, G·H) x (B, T, F)
            out["weight_hh" + dc.sfx] = Dense(g_gh, perm(dc.h_prev))  # (B, T, G·H) x (B, T, H)
            if capture.has_bias:
                out["bias_ih" + dc.sfx] = Dense(g_gi, None)
                out["bias_hh" + dc.sfx] = Dense(g_gh, None)
        return out


TYPES = (nn.LSTM, nn.GRU, nn.RNN)
