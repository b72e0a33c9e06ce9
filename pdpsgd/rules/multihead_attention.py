"""torch's nn.MultiheadAttention (and so nn.TransformerEncoder / Decoder layers): its packed input
projection ``in_proj_weight`` (3E, E) and ``in_proj_bias`` (3E,), and the output projection
``out_proj`` (an nn.Linear, captured by the Linear rule).

The layer computes its projections inside ``F.multi_head_attention_forward`` with ``F.linear`` on
its raw parameters, where no module forward sees them. While the engine captures, the rule runs the
layer's own forward with ``torch.nn.functional.linear`` replaced, for this thread and this call
only, by a function that

* for a slice of ``in_proj_weight`` (the whole of it for self-attention, [q | kv] for an
  encoder-decoder call, [q | k | v] otherwise): computes the same ``linear`` and keeps its input
  x (T, B, E) and its output, whose gradient g (T, B, rows) the engine returns: example i's
  gradient is Σ_t g[t,i] ⊗ x[t,i] in those rows (``Dense``, the calls' tokens side by side, rows
  outside a call's slice zero);
* for ``out_proj``'s weight: calls ``out_proj`` itself on the (B, T, E) rows (the same values:
  a linear map acts on each row alone), so the Linear rule captures it.

Exactness guard: the parameters the forward sees are fresh leaves (aliases of the step's values),
so any use of them other than the linear calls above (a future torch computing them another way)
reaches them in the backward: the rule then declines and the exact fallback takes the layer.
Declined up front: separate q/k/v weights (kdim/vdim ≠ embed_dim), ``add_bias_kv``, unbatched
input.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import mha_fastpath_off
from .base import Dense, Rule, Use

__all__ = ["MultiheadAttentionRule", "TYPES"]


@dataclass
class _InProj:
    row0: int  # first row of in_proj_weight this call used
    x: Tensor  # (T, B, E) its input, detached
    out: Tensor  # (T, B, rows) its output (the capture target)


@dataclass
class MHACapture:
    calls: List[_InProj] = field(default_factory=list)
    leaves: List[Tensor] = field(default_factory=list)  # the aliases the forward saw (weight, bias)
    bad: Optional[str] = None

    @property
    def targets(self) -> List[Tensor]:
        return [c.out for c in self.calls] + self.leaves


_LOCAL = threading.local()  # .active: this thread's replacement (None: the original)
_LOCK = threading.Lock()
_ORIGINAL: List[Any] = [None]  # F.linear as it was when first replaced (kept: a reference to the dispatcher
_DEPTH = [0]  # that another thread took while it was installed stays callable)


def _dispatch(input, weight, bias=None):
    orig = _ORIGINAL[0]
    fn = getattr(_LOCAL, "active", None)
    return orig(input, weight, bias) if fn is None else fn(orig, input, weight, bias)


@contextlib.contextmanager
def _linear_replaced(fn) -> Iterator[None]:
    """``F.linear`` is ``fn(original, input, weight, bias)`` in this thread for the block; other
    threads, and this one after it, get the original (one dispatcher, installed while any thread
    is inside such a block, the original put back when the last one leaves)."""
    with _LOCK:
        if _DEPTH[0] == 0:
            if F.__dict__["linear"] is not _dispatch:
                _ORIGINAL[0] = F.__dict__["linear"]
            F.linear = _dispatch
        _DEPTH[0] += 1
    prev = getattr(_LOCAL, "active", None)
    _LOCAL.active = fn
    try:
        yield
    finally:
        _LOCAL.active = prev
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                F.linear = _ORIGINAL[0]


def _view_of(t: Tensor, base: Tensor) -> bool:
    return t is base or t._base is base


class MultiheadAttentionRule(Rule):
    """in_proj_weight / in_proj_bias from each projection call's input and output gradient."""

    name = "multihead_attention"
    custom_forward = True
    probe_forward = True  # (the probe must see out_proj called on (B, T, E) rows, as the capture does)

    def supports(self, module: nn.Module) -> Optional[str]:
        if any(n not in module._parameters for n in ("in_proj_weight", "in_proj_bias")) \
                or getattr(module, "parametrizations", None) is not None:
            return "its input projection is not a plain parameter (a parametrization, weight_norm)"
        if not getattr(module, "_qkv_same_embed_dim", False) or getattr(module, "in_proj_weight", None) is None:
            return "separate q/k/v projection weights (kdim or vdim other than embed_dim)"
        if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
            return "add_bias_kv"
        if not isinstance(getattr(module, "out_proj", None), nn.Linear):
            return "no nn.Linear out_proj"
        return None

    def batch_axis(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[int]:
        """The query's batch axis, as ``forward`` reads it (checked by the batch-dimension probe: a
        (B, T, E) input given as (L, N, E) with T = B reads positions as examples; review, round 34)."""
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, Tensor) or query.dim() != 3:
            return None
        return 0 if module.batch_first else 1

    def forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, Tensor) or query.dim() != 3:
            return None  # unbatched input: the exact fallback
        B = int(query.shape[0] if module.batch_first else query.shape[1])
        W, b = module._parameters["in_proj_weight"], module._parameters["in_proj_bias"]
        grad = torch.is_grad_enabled()
        W2 = W.detach().requires_grad_(grad)
        b2 = None if b is None else b.detach().requires_grad_(grad)
        cap = MHACapture(leaves=[W2] + ([b2] if b2 is not None else []) if grad else [])
        out_w = module.out_proj.weight

        def linear(orig, x, w, bias):
            if _view_of(w, W2):
                row0 = (w.storage_offset() - W2.storage_offset()) // W2.stride(0)
                rows = int(w.shape[0])
                ok = (w.dim() == 2 and w.stride() == W2.stride() and w.shape[1] == W2.shape[1]
                      and x.dim() == 3 and x.shape[1] == B)
                if bias is not None:
                    ok = ok and b2 is not None and _view_of(bias, b2) and bias.dim() == 1 \
                        and bias.storage_offset() - b2.storage_offset() == row0 and bias.shape[0] == rows
                elif b2 is not None:
                    ok = False
                if not ok:
                    cap.bad = cap.bad or "an input projection call of a layout the rule does not know"
                    return orig(x, w, bias)
                y = orig(x, w.detach(), None if bias is None else bias.detach())  # (T, B, rows)
                if grad and not y.requires_grad:  # (nothing upstream is trained: make its gradient reachable)
                    y = torch.sub(y, torch.zeros((), dtype=y.dtype, device=y.device, requires_grad=True))
                cap.calls.append(_InProj(row0, x.detach(), y))
                return y
            if w is out_w and x.dim() == 2 and x.shape[0] % B == 0:
                T = x.shape[0] // B  # rows t·B + b (time-major), as the attention lays them out
                y = module.out_proj(x.view(T, B, x.shape[1]).transpose(0, 1))  # (B, T, E): the Linear rule
                return y.transpose(0, 1).reshape(T * B, y.shape[-1])
            return orig(x, w, bias)

        params = module._parameters
        params["in_proj_weight"], params["in_proj_bias"] = W2, b2
        try:
            with mha_fastpath_off(), _linear_replaced(linear):
                output = type(module).forward(module, *args, **kwargs)
        finally:
            params["in_proj_weight"], params["in_proj_bias"] = W, b
        return output, cap

    def custom_uses(self, module: nn.Module, capture: MHACapture, grads: List[Optional[Tensor]],
                    batch_size: int) -> Optional[Dict[str, Use]]:
        n = len(capture.calls)
        if capture.bad is not None or any(g is not None for g in grads[n:]):
            return None  # the projection was used in a way the capture did not see: exact fallback
        P = int(module.in_proj_weight.shape[0])
        spans = sorted((c.row0, c.row0 + int(c.out.shape[-1])) for c in capture.calls)
        if not spans or spans[0][0] != 0 or spans[-1][1] != P or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            return None  # not one projection of the rows [0, 3E) in slices (self, encoder-decoder, separate)
        Ls, Rs = [], []
        for c, g in zip(capture.calls, grads[:n]):
            if g is None:
                continue  # (this projection does not reach the loss: 0)
            x = c.x.transpose(0, 1)  # (B, T, E)
            gb = g.transpose(0, 1)  # (B, T, rows)
            if x.shape[0] != batch_size or gb.shape[:2] != x.shape[:2]:
                return None
            if gb.shape[-1] != P:  # its rows of the (B, T, 3E) gradient, the others zero
                full = gb.new_zeros(gb.shape[0], gb.shape[1], P)
                full[..., c.row0:c.row0 + gb.shape[-1]] = gb
                gb = full
            Ls.append(gb)
            Rs.append(x)
        if not Ls:
            return {}
        L = Ls[0] if len(Ls) == 1 else torch.cat(Ls, 1)  # (B, ΣT, 3E): the calls' tokens side by side
        R = Rs[0] if len(Rs) == 1 else torch.cat(Rs, 1)  # (B, ΣT, E)
        out: Dict[str, Use] = {"in_proj_weight": Dense(L, R)}
        if module.in_proj_bias is not None:
            out["in_proj_bias"] = Dense(L, None)
        return out


TYPES = (nn.MultiheadAttention,)
