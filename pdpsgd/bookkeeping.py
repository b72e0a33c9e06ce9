"""Book-keeping (BK) engine: exact DP-SGD at about the cost of one forward + one backward.

One batched forward and one backward *through the activations only*. For every layer with a rule
(see ``pdpsgd.rules``) we keep its input a and output gradient g (returned as values from the
backward, never stored on modules or parameters) and build each trained parameter's per-example
gradient in factored form (``rules.base``): Σ_t L[t] ⊗ R[t] per use. Per parameter and per call,
a cost model picks

* **ghost**: ‖G_i‖² = Σ_{u,v} Σ_{t,s} (L_u[t]·L_v[s]) (R_u[t]·R_v[s]) from (B, T, T) Gram
  matrices (time ∝ B·T²·(p+d), memory B·T²), then the clipped sum Σ_t L[t]ᵀ c R[t] as one
  matmul (aᵀ·diag(c)·g); or
* **explicit**: materialise G_i (B, p, d), take its norm, reuse it for Σ_i c_i G_i
  (time ∝ B·T·p·d, memory B·p·d).

A self-Gram X Xᵀ whose operand several ghost-route layers share (BERT's query/key/value input) is
computed once per batch, and on the CPU for T ≥ 128 only as its blocks on and below the diagonal
(``_SymGram``: 5/8 of the products at T = 128); a ghost use's clipped-sum matmul runs over the factor rows that are not
exactly zero (e.g. padded tokens, whose output gradients are exactly 0) when at least 10 % are, the
candidates read off the Gram diagonals and each confirmed exactly. On the CPU, a ghost use whose
factor rows are exactly zero at many positions (padding; a classifier's last layer, where only the
first token's gradient is non-zero) has its Grams computed over each example's non-zero rows
only, the examples grouped by their counts (``_compaction``): Σ_g B_g·K_g² instead of B·T².

A layer that the model calls once for the whole batch and broadcasts (T5's relative attention bias,
looked up on (T, T) position buckets) has no per-example output gradient; a ``CaptureAdapter`` of
the registry (``rules.t5_relative_bias``) replaces the model method around it during the capture
and the probes so that the layer is called on the batch (the same values per example), checked
against the model's own method on every call, and its rule then applies as to any batched call.

Uses of the same parameter (tied weights such as GPT-2's wte/lm_head, a layer called twice) are
summed *before* the norm, so cross terms are included exactly (Embedding × Linear cross terms
are a gather of the logits' gradient at the token ids). Layers without a rule, ruled parameters
also used outside their layer's forward, and layers a rule declines fall back to exact
per-example gradients (``per_sample.per_sample_grads``, vmap) for just those parameters.

Formal guarantee: for every trained parameter, ``sq_norms[n][i]`` is ‖∂loss_i/∂θ_n‖² (the
gradient summed over all uses) and ``clipped_sum[n]`` = Σ_i w_i ∂loss_i/∂θ_n with w from
``weights_fn`` evaluated on those norms; both up to floating-point rounding (tested against the
naive float64 loop at rel. err ≤ 1e-9). Examples with weight 0 (padding, non-finite) contribute
exactly 0: rows that may hold non-finite values are zeroed, never multiplied by 0 (see
``_KeepMemo``; a finite row times 0 is exactly 0). A rule splits its factors by example along the
input's leading dim; one whose size equals B only by coincidence (time-major T == B, a table with
V == B) is detected by a probe and computed by the vmap fallback (``PROBE_B``). No mixing of
examples in the forward (``check_no_batch_mixing``). In float32 a ghost norm that lost its digits
to cancellation (crafted inputs) is replaced by an upper bound (``_Guard``).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math
import numbers
import os
import random
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten



def _edge_fn():
    """``get_gradient_edge`` if this torch's ``autograd.grad`` accepts gradient edges as inputs, else None."""
    try:
        from torch.autograd.graph import get_gradient_edge

        x = torch.ones(1, requires_grad=True)
        y = x * 2
        (g,) = torch.autograd.grad((y * 3).sum(), [get_gradient_edge(y)])
        return get_gradient_edge if float(g) == 3.0 else None
    except Exception:  # pragma: no cover - older torch: outputs are kept as tensors (more memory)
        return None


_gradient_edge = _edge_fn()

from ._compat import mha_fastpath_off
from ._types import Batch, EngineResult, Params, WeightsFn
from ._warn import warn
from .batch_order import _DROPOUT_OFF, DrawWatch, DropoutOff, ReorderWatch
from .clipping import MIN_THRESHOLD, sum_sq_norms
from .functional import LossModule, ParamIndex, model_constants, model_settings, preserve_module_state
from .per_sample import (_LOW, _PRECISION_LOCK, DETACHED_LOSS, OOM_ERRORS, _caller_matmuls, _ieee_matmuls, _matmul_knobs, _rng_state, _same_state, _HeldStates, _held_forked, _model_rngs, SQ_NORM_BLOCK, _device_of, acc_dtype, amp, amp_state, batch_chunks, batch_size, cat_chunks, check_batch_entries,
                         per_sample_grads, select_examples, slice_batch, sq_norm_per_example, stray_parameter_error, trainable_parameters, watch_stray, weighted_dot, weighted_sum)
from .rules import DEFAULT_REGISTRY, RuleRegistry
from .rules.base import Dense, Explicit, Index, Rule, Use, module_attr

__all__ = ["bk_engine", "plan", "fallback_reasons", "cost", "choose_route", "COST_MODELS", "BK_OPTIONS"]

COST_MODELS = ("time", "fastdp", "ghost", "explicit")
BK_OPTIONS = ("registry", "routes", "cost_model", "explicit_max_elems", "elementwise_cost", "explicit_keep_elems",
              "check_order", "hold_paths", "inputs_in_graph")

# Relative cost of one element of an elementwise / memory-bound pass vs one multiply-add inside
# a matmul. Rough estimates (CPU: norm + weighted-sum passes over a (B, p, d) tensor vs bmm
# throughput, single thread; CUDA: HBM bandwidth vs tensor-core rate), not yet calibrated by a
# sweep; override per call with bk_options={"elementwise_cost": x}.
ELEMENTWISE_COST = {"cpu": 24.0, "cuda": 64.0}
# The explicit route materialises a per-example gradient (B·p·d elements) only if it is at most
# this big, or at most EXPLICIT_ACT_FACTOR × the layer's own captured activations B·T·(p+d)
# (which BK holds anyway), so memory stays within a small factor of the non-private step.
EXPLICIT_MAX_ELEMS = 1 << 23
EXPLICIT_ACT_FACTOR = 2
# Explicit per-example gradients kept (for reuse in the clipped sum) per call, in elements; past
# this, the norm is taken and the gradient dropped, and the clipped sum is one matmul aᵀ·diag(c)·g.
EXPLICIT_KEEP_ELEMS = 1 << 23


def _acc(dtype: torch.dtype) -> torch.dtype:
    return acc_dtype(dtype)


# ------------------------------------------------------------------------------------------------
# cost model (pure functions of shapes)
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UseShape:
    kind: str  # "dense", "bias", "index", "explicit"
    T: int
    P0: int  # rows (index: num_rows)
    P1: int  # cols (bias / explicit: numel per example)
    # a dense use whose ghost norm is compacted (padding skipped, ``_compaction``): the Grams' rows²
    # and the clipped sum's rows, per example on average (else T² and T)
    rows2: Optional[float] = None
    rows: Optional[float] = None


def _use_shape(u: Use, param_shape: torch.Size) -> UseShape:
    numel = int(math.prod(param_shape))
    if isinstance(u, Dense):
        if u.R is None:
            return UseShape("bias", u.T, int(u.L.shape[-1]), 1)
        return UseShape("dense", u.T, int(u.L.shape[-1]), int(u.R.shape[-1]))
    if isinstance(u, Index):
        return UseShape("index", u.T, u.num_rows, int(u.R.shape[-1]))
    return UseShape("explicit", 1, numel, 1)


def cost(shapes: List[UseShape], B: int, *, elementwise_cost: float) -> Tuple[float, float]:
    """(ghost, explicit) extra cost of one parameter's norms + clipped sum, in matmul multiply-adds.

    The B·T·p·d matmul of the clipped sum (ghost) equals the materialisation (explicit) and is
    not counted. Ghost: Gram products B·T_u·T_v·(P0+P1) for every pair of uses (cross terms too;
    a compacted use's self pair: B·rows2·(P0+P1)). Explicit: ~(uses + 2) elementwise passes over
    B·P0·P1 (sum, norm, weighted sum), each ``elementwise_cost`` multiply-adds per element, plus,
    for a compacted use, the materialisation over the padded rows that the ghost sum skips.
    """
    ghost = 0.0
    big = [s for s in shapes if s.kind in ("dense", "index")]
    for u in big:
        for v in big:
            tt = u.rows2 if u is v and u.rows2 is not None else u.T * v.T
            ghost += B * tt * ((1 if u.kind == "index" else u.P0) + u.P1)
    P0 = max((s.P0 for s in big), default=1)
    P1 = max((s.P1 for s in big), default=1)
    passes = sum(2 if s.kind == "index" else 1 for s in big) + (len(big) - 1) + 2  # build, add, norm, sum
    explicit = elementwise_cost * B * P0 * P1 * passes
    # a compacted ghost use's clipped sum skips the padded rows; the explicit G is built over all T
    explicit += sum(B * (s.T - s.rows) * s.P0 * s.P1 for s in big if s.rows is not None)
    return ghost, explicit


def factor_elems(shapes: List[UseShape], B: int) -> int:
    """Elements of the captured factors (a, g) of these uses: what keeping G instead frees."""
    n = 0
    for s in shapes:
        if s.kind == "dense":
            n += B * s.T * (s.P0 + s.P1)
        elif s.kind == "bias":
            n += B * s.T * s.P0
        elif s.kind == "index":
            n += B * s.T * (s.P1 + 1)
    return n


def choose_route(shapes: List[UseShape], B: int, cost_model: str, *, elementwise_cost: float,
                 explicit_max_elems: int) -> str:
    """"ghost" or "explicit" for one parameter, from its uses' shapes only (a compacted use's shape
    carries the rows its ghost norm and clipped sum run over: ``UseShape.rows2`` / ``rows``)."""
    big = [s for s in shapes if s.kind in ("dense", "index")]
    if not big:
        return "explicit"  # biases, norm layers: (B, numel) per-example grads, always cheap
    P0 = max(s.P0 for s in big)
    P1 = max(s.P1 for s in big)
    if cost_model in ("ghost", "explicit"):
        return cost_model
    if cost_model == "fastdp":  # Bu et al.: ghost iff 2T² < p·d (memory-minimising)
        T = sum(s.T for s in big)
        return "ghost" if 2 * T * T < P0 * P1 else "explicit"
    acts = max(B * s.T * (s.P0 + s.P1) for s in big)
    if B * P0 * P1 > max(explicit_max_elems, EXPLICIT_ACT_FACTOR * acts):
        return "ghost"
    g, e = cost(shapes, B, elementwise_cost=elementwise_cost)
    return "ghost" if g < e else "explicit"


# ------------------------------------------------------------------------------------------------
# factored per-example gradient algebra (all per example, accumulated in float32 or wider)
# ------------------------------------------------------------------------------------------------
def _materialise(u: Use, shape: torch.Size, acc: torch.dtype) -> Tensor:
    """The use's per-example gradient (B, *shape)."""
    if isinstance(u, Explicit):
        return u.G.to(acc).reshape(u.G.shape[0], *shape)
    if isinstance(u, Dense):
        L = u.L.to(acc)
        B = L.shape[0]
        if u.R is None:
            return L.sum(1).reshape(B, *shape)  # (B, T, P0) -> (B, P0)
        # bmm(Lᵀ, R) writes G contiguous; einsum may return a transposed view that the reshape
        # then copies (measured on CPU, cold cache: bmm 0.33-0.98x einsum's time over T 8-512)
        return torch.bmm(L.transpose(1, 2), u.R.to(acc)).reshape(B, *shape)  # (B,P0,T) x (B,T,P1) -> (B,P0,P1)
    R = u.R.to(acc)
    B, T, d = R.shape
    flat = (u.ids + torch.arange(B, device=R.device).unsqueeze(1) * u.num_rows).reshape(-1)  # (B·T,)
    G = torch.zeros(B * u.num_rows, d, dtype=acc, device=R.device)
    G.index_add_(0, flat, R.reshape(B * T, d))  # scatter rows: (B·T, d) -> (B·V, d)
    return G.reshape(B, *shape)


def _sq_norm(G: Tensor) -> Tensor:
    """(B, *shape) -> (B,) squared norms, float32 or wider, without a squared copy of G (blocked:
    see ``per_sample.sq_norm_per_example`` for why not ``linalg.vector_norm``)."""
    return sq_norm_per_example(G)


def _wsum(w: Tensor, G: Tensor, keep: Optional[Tensor]) -> Tensor:
    """Σ_i w_i G_i; rows with w_i = 0 (``keep`` False; None: there are none) are skipped exactly
    (``weighted_sum``)."""
    if keep is None and G.dtype == _acc(G.dtype):
        return weighted_dot(w, G)  # (B,) x (B, *shape) -> shape
    return weighted_sum(w, G)


class _KeepMemo:
    """``w != 0`` per weight tensor, or None when the rows of weight 0 need no zeroing.

    Zeroing (``torch.where`` on the factors) is what keeps a dropped example's non-finite values
    out of a sum (NaN·0 is NaN). On ``SYNC_DEVICES`` (CPU) it is decided per distinct weight tensor
    (flat clipping: one for all parameters), None when every weight is non-zero; there the mask
    also lets the row compaction skip weight-0 rows. Elsewhere (GPU) one host read per step
    decides it: whether any example's squared norm is non-finite. Only such an
    example can have non-finite factor rows (a non-finite row makes its own Gram/explicit norm
    non-finite), and a finite row times weight 0 adds exactly 0; so normally no factor is copied
    (zeroing always would copy each, e.g. +412 MB for GPT-2 small's logits gradient) and the
    step has one sync instead of one per weight tensor. (``zero``: that read's answer; None on CPU.)"""

    def __init__(self, device: torch.device, sq: Mapping[str, Tensor]):
        self.decide = device.type in SYNC_DEVICES
        # off the CPU: the step's one host read
        self.zero = None if self.decide else bool((~torch.isfinite(sum_sq_norms(sq))).any())
        self.memo: Dict[int, Tuple[Tensor, Optional[Tensor]]] = {}

    def __call__(self, w: Tensor) -> Optional[Tensor]:
        if self.zero is False:
            return None
        hit = self.memo.get(id(w))
        if hit is None or hit[0] is not w:
            keep = w != 0
            hit = (w, None if self.decide and bool(keep.all()) else keep)
            self.memo[id(w)] = hit
        return hit[1]


def _key(X: Tensor):
    return (X.data_ptr(), tuple(X.shape), X.stride(), X.dtype, X.device)


# A self-Gram X Xᵀ is symmetric: on the devices below, for T ≥ SYM_MIN_T, only the blocks on and
# below the diagonal of a recursive halving into blocks of ≥ SYM_BLOCK_MIN rows (at most
# SYM_MAX_LEVELS halvings) are computed (``_SymGram``): at T = 128 (two halvings) 5/8 of the
# products. Measured, one thread, B = 8 (``benchmarks/README.md``, round 14): 0.72–0.92× the full
# bmm's time at T = 128 (widths 256–8192), 0.59–0.73× at T = 256–512; at T = 64 the smaller
# matmuls lose more than the products saved (1.06–1.23×), and so do very wide operands at T = 128
# (GPT-2's (B, 128, 8192) logits gradient: 0.92–1.31× in two runs; 0.94–1.05× in round 20), hence
# below SYM_WIDE_MIN_T at most SYM_MAX_WIDTH columns. Wider operands from T = SYM_WIDE_MIN_T, in
# blocks of ≥ SYM_WIDE_BLOCK_MIN rows (their long thin products lose more on small blocks); round
# 20, one thread, B = 8, widths 4096–32768: 0.76–0.79× at T = 256 (blocks of 64; of 32: 0.79–0.84×),
# 0.67–0.70× at T = 512 (e.g. GPT-2's 50257-wide head on CPU, whose per-example gradients are too
# big for the explicit route). CPU only: on CUDA each block is one more launch, where the step is
# launch-bound (unmeasured there).
SYM_MIN_T = 128
SYM_BLOCK_MIN = 32
SYM_MAX_LEVELS = 3
SYM_MAX_WIDTH = 2048
SYM_WIDE_MIN_T = 256
SYM_WIDE_BLOCK_MIN = 64
SYM_GRAM_DEVICES = ("cpu",)


def _sym_levels(X: Tensor) -> int:
    """Halvings ``_SymGram`` takes for X (B, T, P): 0 (the full Gram) off its devices, for short T,
    wide P at T < SYM_WIDE_MIN_T, or where X is not contiguous (its block views would need a copy
    of X; bmm reads it as it is, e.g. a conv layer's unfolded (B, H·W, C·k²) factor); wide P takes
    blocks of ≥ SYM_WIDE_BLOCK_MIN rows."""
    if X.dim() != 3 or X.device.type not in SYM_GRAM_DEVICES or X.shape[1] < SYM_MIN_T \
            or not X.is_contiguous():
        return 0
    T = X.shape[1]
    block_min = SYM_BLOCK_MIN
    if X.shape[2] > SYM_MAX_WIDTH:
        if T < SYM_WIDE_MIN_T:
            return 0
        block_min = max(block_min, SYM_WIDE_BLOCK_MIN)
    levels = 0
    while levels < SYM_MAX_LEVELS and T % (2 << levels) == 0 and (T >> (levels + 1)) >= block_min:
        levels += 1
    return levels


def _pair_levels(u: Dense) -> int:
    """Halvings for the self pair of a dense use: its two Grams pair up block by block only if both
    factors take the blocks, at the fewer halvings of the two (a wide factor's larger blocks; any
    halvings up to a factor's own are valid for it); else 0, both full (a mixed pair would have
    to assemble the full Gram from the blocks)."""
    lo, ro = _sym_levels(u.L), _sym_levels(u.R)
    return min(lo, ro) if lo and ro else 0


class _SymGram:
    """X Xᵀ (B, T, T) of X (B, T, P) held as its blocks on and below the diagonal of ``levels``
    recursive halvings: ``off[l - 1]``, level l = 1..levels, is the lower-left block of each of the
    B·2^(l-1) diagonal blocks of the level above, (B·2^(l-1), T/2^l, T/2^l); ``diag`` the B·2^levels
    diagonal blocks of the last level, (B·2^levels, T/2^levels, T/2^levels). The blocks above the
    diagonal are these transposed (not computed): ⟨A, A'⟩ = Σ diag·diag' + 2 Σ off·off' exactly."""

    __slots__ = ("B", "T", "off", "diag")

    def __init__(self, X: Tensor, levels: int):
        B, T, P = X.shape
        X = X.contiguous()  # (no copy where ``_sym_levels`` chose the levels: the blocks below are views)
        self.B, self.T = B, T
        self.off: List[Tensor] = []
        for lv in range(1, levels + 1):
            h = T >> lv
            Xv = X.view(B << (lv - 1), 2, h, P)  # (B, T, P) -> (B·2^(l-1), 2, h, P): halves of each block
            self.off.append(torch.bmm(Xv[:, 1], Xv[:, 0].transpose(1, 2)))  # (B·2^(l-1), h, h)
        h = T >> levels
        Xd = X.view(B << levels, h, P)  # (B, T, P) -> (B·2^levels, h, P)
        self.diag = torch.bmm(Xd, Xd.transpose(1, 2))  # (B·2^levels, h, h)

    def diagonal(self) -> Tensor:
        """The Gram's diagonal ‖X_t‖² (B, T)."""
        return self.diag.diagonal(dim1=1, dim2=2).reshape(self.B, self.T)

    def inner(self, other: "_SymGram") -> Tensor:
        """Σ_{t,s} A[t, s] A'[t, s] per example (B,), for a Gram of the same blocks."""
        def per_example(x: Tensor) -> Tensor:  # (B·m, h, h) -> (B,)
            return x.reshape(self.B, x.numel() // self.B).sum(1) if self.B else x.new_zeros(0)

        out = per_example(self.diag * other.diag)
        for a, b in zip(self.off, other.off):
            out = out + 2 * per_example(a * b)
        return out

    def full(self) -> Tensor:
        """The whole Gram (B, T, T)."""
        B, T = self.B, self.T
        G = self.diag.new_zeros(B, T, T)
        h = self.diag.shape[-1]
        n = T // h  # 2^levels diagonal blocks per example
        d = self.diag.view(B, n, h, h)
        for j in range(n):
            G[:, j * h:(j + 1) * h, j * h:(j + 1) * h] = d[:, j]
        for lv, o in enumerate(self.off, start=1):
            m, h = 1 << (lv - 1), T >> lv
            o = o.view(B, m, h, h)
            for j in range(m):
                r, c = (2 * j + 1) * h, 2 * j * h
                G[:, r:r + h, c:c + h] = o[:, j]
                G[:, c:c + h, r:r + h] = o[:, j].transpose(1, 2)
        return G


def _gdiag(g) -> Tensor:
    """The diagonal (B, T) of a Gram, full (B, T, T) or ``_SymGram``."""
    return g.diagonal() if isinstance(g, _SymGram) else g.diagonal(dim1=1, dim2=2)


def _ginner(a, b) -> Tensor:
    """Σ_{t,s} a[t, s] b[t, s] per example (B,) of two Grams, full or ``_SymGram``."""
    if isinstance(a, _SymGram) and isinstance(b, _SymGram) and a.diag.shape == b.diag.shape \
            and len(a.off) == len(b.off):
        return a.inner(b)
    a = a.full() if isinstance(a, _SymGram) else a
    b = b.full() if isinstance(b, _SymGram) else b
    return (a * b).sum((1, 2))  # (B, T, S) -> (B,)


def _gram(X: Tensor, Y: Tensor, acc: Optional[torch.dtype] = None, cache: Optional["_GramMemo"] = None,
          levels: int = 0):
    """(B, T, k) x (B, S, k) -> (B, T, S), in ``acc`` if given; with ``cache`` and X the same tensor
    as Y, the memo's self-Gram (a ``_SymGram`` of ``levels`` halvings if > 0)."""
    if cache is not None and (X is Y or _key(X) == _key(Y)):
        return cache.self_gram(X, acc, levels=levels)
    if acc is not None:
        X, Y = X.to(acc), Y.to(acc)
    return torch.bmm(X, Y.transpose(1, 2))  # (B, T, k) x (B, k, S) -> (B, T, S)


def _compact_grams(X: Tensor, acc: Optional[torch.dtype], comp: "_Compact") -> List[Tensor]:
    """Per group of ``comp``: the self-Gram of its examples' non-zero rows, (B_g, K_g, K_g)."""
    out = []
    for _, flat, K in comp.groups:
        Xg = _take_rows(X, flat, K)  # (B_g, K_g, P)
        Xg = Xg.to(acc) if acc is not None else Xg
        out.append(torch.bmm(Xg, Xg.transpose(1, 2)))  # (B_g, K_g, P) x (B_g, P, K_g) -> (B_g, K_g, K_g)
    return out


def _gram_key(X: Tensor, acc: Optional[torch.dtype], comp: Optional["_Compact"] = None, levels: int = 0) -> Tuple:
    return (_key(X), acc, None if comp is None else id(comp), 0 if comp is not None else levels)


class _GramMemo:
    """Self-Gram X Xᵀ of operands shared by several ghost-route uses (e.g. BERT's query/key/value
    share their input a), computed once and dropped after its last consumer; compacted uses with
    the same non-zero rows (one ``_Compact``) share their groups' Grams the same way. Keys are
    addresses of tensors that ``col.uses`` holds alive for the whole batch, and ids of the batch's
    compactions (alive as long), so they cannot be reused meanwhile."""

    def __init__(self, counts: Dict):
        self.left = {k: c for k, c in counts.items() if c > 1}  # consumers still to come
        self.memo: Dict = {}

    def self_gram(self, X: Tensor, acc: Optional[torch.dtype], comp: Optional["_Compact"] = None,
                  levels: int = 0):
        """X Xᵀ: per group of ``comp`` (a list), else a ``_SymGram`` of ``levels`` halvings (> 0: a
        self pair's ``_pair_levels``), else (B, T, T); the forms are memoised apart."""
        levels = 0 if comp is not None else levels
        k = _gram_key(X, acc, comp, levels)
        g = self.memo.get(k)
        if g is None:
            if comp is not None:
                g = _compact_grams(X, acc, comp)
            else:
                Xa = X.to(acc) if acc is not None else X
                g = _SymGram(Xa, levels) if levels else torch.bmm(Xa, Xa.transpose(1, 2))
        left = self.left.get(k, 1) - 1
        if left > 0:
            self.memo[k] = g
            self.left[k] = left
        else:
            self.memo.pop(k, None)
            self.left.pop(k, None)
        return g


# Compact the clipped-sum matmul to the rows (tokens) with non-zero factors when at most this
# fraction of rows remains (e.g. padded positions of BERT, whose output gradients are exactly 0).
# Near it the gather of both factors' rows costs about what the shorter matmul saves (measured,
# one thread, BERT's shapes with 82 % of the rows kept: 256x256 1.03x and 256x1024 0.93x the full
# sum's time; with 50 % kept 0.51-0.65x).
ACTIVE_ROWS_FRACTION = 0.9
# Below this many multiply-adds of the full clipped-sum matmul (B·T·P0·P1) the check is not tried:
# what it could save is less than its own ~15 small ops (a tiny layer's step is launch-bound).
ACTIVE_ROWS_MIN_WORK = 1 << 22
# Devices where that compaction is tried. Deciding it is a host sync per ghost-route layer; on CUDA
# each sync drains the launch queue (the GPU idles while Python queues the next kernels), which
# costs more than the padded rows it saves, so there the sums run over all rows (exact either way).
ACTIVE_ROWS_DEVICES = ("cpu",)
# Devices on which the engine reads tensor values on the host to skip work (are all weights
# non-zero? is a chunk all padding?). On CUDA each such read is a sync that drains the launch
# queue, so there the engine does the (exact, cheap) work instead of deciding.
SYNC_DEVICES = ("cpu",)  # elsewhere: one host read per step (see _KeepMemo)


CONFIRM_BLOCK = 1 << 18  # elements copied at a time to confirm zero rows (memory: ~1 MiB in float32)


def _confirm_zero_rows(X: Tensor, idx: Tensor, zero: Tensor) -> Tensor:
    """Sets ``zero[j]`` for each candidate row j of X (n, P) (indices ``idx``) that is exactly zero
    (NaN / ±inf rows are not), reading the candidates in blocks of ``CONFIRM_BLOCK`` elements (a
    bounded temporary); returns ``zero``."""
    step = max(1, CONFIRM_BLOCK // max(1, X.shape[1]))
    for i in range(0, idx.numel(), step):
        j = idx[i:i + step]
        zero[j[X.index_select(0, j).abs_().amax(1) == 0]] = True
    return zero


def _active_rows(u: Dense, dl: Tensor, dr: Tensor, counts: Optional[Tensor] = None) -> Optional[Tensor]:
    """Indices into the B·T rows of u's factors where neither L[t] nor R[t] is exactly zero, or
    None if that keeps more than ``ACTIVE_ROWS_FRACTION`` or the matmul is too small to pay for the
    check (``ACTIVE_ROWS_MIN_WORK``). The self-Gram diagonals ``dl`` = ‖L_t‖², ``dr`` = ‖R_t‖² (B, T)
    (free here) give the candidates; each candidate is then checked exactly (a tiny non-zero row
    whose square underflows to 0 is kept). ``counts`` (B,), if given: each example's number of
    rows t with ‖L_t‖²‖R_t‖² ≠ 0 (``_bound``'s); when they add up to all B·T rows, no row is a
    candidate (a zero row has a zero term) and nothing more is read."""
    n = dl.shape[0] * dl.shape[1]
    if n * u.L.shape[-1] * u.R.shape[-1] < ACTIVE_ROWS_MIN_WORK:
        return None
    if counts is not None and int(counts.sum()) == n:  # (one small reduction instead of the candidates' four ops)
        return None
    need = (1 - ACTIVE_ROWS_FRACTION) * n
    cands = [(dx == 0).reshape(-1) for dx in (dl, dr)]  # ‖X_t‖² == 0: ⊇ zero rows
    if int((cands[0] | cands[1]).sum()) < need:  # too few candidates: no need to confirm any
        return None
    zero = torch.zeros(n, dtype=torch.bool, device=dl.device)
    for X, cand in ((u.L, cands[0]), (u.R, cands[1])):
        if not bool(cand.any()):
            continue
        _confirm_zero_rows(X.reshape(n, -1), cand.nonzero().squeeze(1), zero)
    if int(zero.sum()) < need:
        return None
    return (~zero).nonzero().squeeze(1)


# Ghost norms over the rows (tokens) that are not exactly zero (padded positions; a classifier's last
# layer, where only the first token's output gradient is non-zero): each example's non-zero rows are
# gathered first, and examples of similar counts share one Gram batch (B_g, K_g, ·), K_g the largest
# count in the group, instead of (B, T, ·) for all. Taken when the Gram work Σ_g B_g·K_g² (plus a
# fixed cost per group) is at most this fraction of B·T².
COMPACT_MAX_FRACTION = 0.85
COMPACT_GROUP_COST = 0.125  # per group, in units of one T² Gram (gathers, a few small ops)
COMPACT_MAX_GROUPS = 4
COMPACT_GATHER_COST = 40  # gathering a row, in units of one row of one Gram's products (measured, CPU)
CONFIRM_FULL_FRACTION = 0.3  # confirm zero rows by one pass over the whole factor when candidates are this many
COMPACT_MIN_T = 64  # below this the Grams are cheap and the check would not pay
COMPACT_SAMPLES = 8  # positions looked at first, to estimate whether the compaction may pay


@dataclass
class _Compact:
    # per group: (its examples, or None for all; flat row indices into the B·T rows, or None when the
    # group is all examples and each one's non-zero rows come first: a view X[:, :K_g]; K_g)
    groups: List[Tuple[Optional[Tensor], Optional[Tensor], int]]
    rows: Tensor  # flat indices into the B·T rows of the non-zero ones (for the clipped sum)
    counts: Tensor  # (B,) each example's non-zero rows (the cancellation guard's token count)
    cost: float  # its Grams' work in rows² (gathers and per-group costs included; ``_groups``)


def _groups(counts: List[int], T: int, prefix: bool) -> Optional[Tuple[List[List[int]], float]]:
    """Examples (indices) grouped by their non-zero row counts for the compacted Grams: contiguous
    runs of the sorted counts, at most ``COMPACT_MAX_GROUPS``, split at equal quantiles, the
    cheapest by Σ_g B_g·K_g² (+ the gather of B_g·K_g rows where the rows cannot be a view:
    ``prefix`` says whether each example's non-zero rows come first) + a fixed cost per group,
    with that cost (in rows² of one Gram); None when none saves enough."""
    B = len(counts)
    order = sorted(range(B), key=lambda i: counts[i])
    best, best_cost = None, COMPACT_MAX_FRACTION * B * T * T
    for G in range(1, min(COMPACT_MAX_GROUPS, B) + 1):
        cuts = sorted({round(B * j / G) for j in range(1, G)} | {B})
        parts, lo = [], 0
        for hi in cuts:
            if hi > lo:
                parts.append(order[lo:hi])
                lo = hi
        cost = len(parts) * COMPACT_GROUP_COST * T * T
        for g in parts:
            K = max(1, counts[g[-1]])
            cost += len(g) * K * (K + (0 if prefix and len(g) == B else COMPACT_GATHER_COST))
        if cost <= best_cost:
            best, best_cost = parts, cost
    return None if best is None else (best, best_cost)


def _compaction(u: Dense, finite: Dict, shared: Dict) -> Optional[_Compact]:
    """Where a dense use's rows t with one factor exactly zero (the output gradient's, e.g. at
    padded positions: L in the Linear rule, R in HF Conv1D's) make the Grams much smaller, the
    positions of the others, per example, grouped (``_groups``); None otherwise. Such a row adds
    exactly 0 to G_i = Σ_t L[t] ⊗ R[t] when the other factor's row is finite (checked, else None:
    0·inf is not 0; a non-finite row of the zero factor is not zero, so it is kept), so the norm
    and the sum over the others are exact. A look at the rows at ``COMPACT_SAMPLES`` inner
    positions and at each factor's first column decides whether to go on, and which factor; that
    factor's rows that are 0 at three columns are the candidates, and only they are then read in
    full (in blocks, or in one pass when many) to confirm them exactly. ``finite``: this batch's memo of
    whole-factor finiteness checks (q/k/v share their input). ``shared``: this batch's compactions
    by their rows, so uses with the same non-zero rows share one (and their shared operand's Grams)."""
    L, R = u.L, u.R
    if R is None or L.dim() != 3 or R.dim() != 3:
        return None
    B, T = L.shape[0], L.shape[1]
    if T < COMPACT_MIN_T or B == 0 or L.shape[2] == 0 or R.shape[2] == 0:
        return None
    # A first look at the first column of COMPACT_SAMPLES evenly spaced rows inside (0, T − 1) picks
    # the factors that may have zero rows there (a zero row at an end alone, as the last position of
    # a causal LM loss, does not make the compaction pay); then their rows that are 0 at the first
    # column (strided reads of B·T values, ⊇ the zero rows) say whether it may pay, and which factor
    pk = ("positions", T, L.device)
    if pk not in shared:
        shared[pk] = torch.linspace(1, T - 2, min(T - 2, COMPACT_SAMPLES), device=L.device).round().long()
    pos = shared[pk]
    zs = [X[:, pos, 0] == 0 for X in (L, R)]  # (B, S) each
    seen = torch.cat(zs, 1).reshape(-1).tolist()
    if not any(seen):
        return None
    # uses whose samples look alike (q/k/v/... of one padded batch) mostly decide alike: one that
    # found it does not pay spares the others the reads (a decision of speed, and for ``auto`` of
    # routes, never of values: both ways are exact)
    look = ("declined", B, T, tuple(seen))
    if look in shared:
        return None
    best = None
    for X, z in zip((L, R), zs):
        if not bool(z.any()):
            continue
        est = (T - (X[:, :, 0] == 0).sum(1)).tolist()  # (B,): at most this many zero rows each
        cost = sum(c * c for c in est)
        if best is None or cost < best[0]:
            best = (cost, X, est)
    if best is None or _groups(best[2], T, True) is None:  # not worth it even if every candidate is a zero row
        shared[look] = True
        return None
    zero = best[1]
    other = R if zero is L else L
    P = zero.shape[2]
    cand = (zero[:, :, 0] == 0) & (zero[:, :, P // 2] == 0) & (zero[:, :, P - 1] == 0)  # 0 at three columns
    # (one column would take e.g. ReLU outputs); ⊇ the zero rows (NaN is not 0): strided reads of B·T values
    n = B * T
    Z, O = zero.reshape(n, -1), other.reshape(n, -1)
    idx = cand.reshape(-1).nonzero().squeeze(1)
    if idx.numel() >= CONFIRM_FULL_FRACTION * n:  # many: one pass over the whole factor
        zrow = (Z.amax(1) == 0) & (Z.amin(1) == 0)  # exactly zero rows (NaN / ±inf: not 0); aminmax is 5x slower
    else:  # few: read just the candidates, in blocks
        zrow = _confirm_zero_rows(Z, idx, torch.zeros(n, dtype=torch.bool, device=L.device))
    zidx = zrow.nonzero().squeeze(1)
    if zidx.numel() >= CONFIRM_FULL_FRACTION * n:  # the skipped rows' other factor: finite (0·inf is not 0)
        k = _key(other)  # (held alive by col.uses for the whole batch: the address is not reused meanwhile)
        if k not in finite:
            finite[k] = bool(torch.isfinite(O.sum()))  # (an overflow to inf only declines: safe)
        if not finite[k]:
            return None
    else:
        step = max(1, CONFIRM_BLOCK // max(1, O.shape[1]))
        for i in range(0, zidx.numel(), step):
            if not bool(torch.isfinite(O.index_select(0, zidx[i:i + step]).sum())):  # (overflow: declines, safe)
                return None
    active = ~zrow.view(B, T)
    counts = active.sum(1)
    cl = counts.tolist()
    same = shared.setdefault((B, T, tuple(cl)), [])
    for a, c in same:
        if torch.equal(a, active):
            return c
    prefix = bool(torch.equal(active, torch.arange(T, device=active.device) < counts.unsqueeze(1)))
    grouped = _groups(cl, T, prefix)
    comp = None
    if grouped is None:
        shared[look] = True
    else:
        parts, gcost = grouped
        order = torch.argsort((~active).to(torch.int8), dim=1, stable=True)  # active positions first, in order
        groups: List[Tuple[Optional[Tensor], Optional[Tensor], int]] = []
        for g in parts:
            K = max(1, cl[g[-1]])
            if len(g) == B and prefix:
                groups.append((None, None, K))  # a view: X[:, :K]
                continue
            ex = None if len(g) == B else torch.tensor(g, dtype=torch.long, device=L.device)
            pos = order[:, :K] if ex is None else order.index_select(0, ex)[:, :K]  # (B_g, K)
            base = torch.arange(B, device=L.device) if ex is None else ex
            groups.append((ex, (base.unsqueeze(1) * T + pos).reshape(-1), K))
        comp = _Compact(groups, active.reshape(-1).nonzero().squeeze(1), counts, gcost)
    same.append((active, comp))
    return comp


def _take_rows(X: Tensor, flat: Optional[Tensor], K: int) -> Tensor:
    B, T, P = X.shape
    if flat is None:
        return X[:, :K]  # (B, T, P) -> (B, K, P), a view
    return X.reshape(B * T, P).index_select(0, flat).view(-1, K, P)  # (B, T, P) at B_g·K rows -> (B_g, K, P)


def _bound(u: Use, terms: Tensor, bounds: Dict[int, Tensor], tokens: Optional[Dict[int, Tensor]],
           squared: bool = True, slack: Optional[Tensor] = None) -> None:
    """From the per-row terms (B, T) ‖L_t‖²‖R_t‖² (or ‖L_t‖‖R_t‖, ``squared=False``): the bound
    Σ_t ‖L_t‖‖R_t‖ ≥ ‖G_u,i‖ (B,) and, if ``tokens`` is given, each example's count of non-zero terms.
    ``slack``: :func:`_underflow_slack` (B,), kept under the key ("slack", id(u))."""
    bounds[id(u)] = (terms.sqrt() if squared else terms).sum(1)
    if slack is not None:
        bounds[("slack", id(u))] = slack  # type: ignore[index]
    if tokens is not None:
        tokens[id(u)] = torch.count_nonzero(terms, dim=-1)  # one kernel (a GPU step is launch-bound)


def _factor_bound(u: Use, shape: torch.Size, acc: torch.dtype, bounds: Dict[int, Tensor],
                  tokens: Dict[int, Tensor]) -> None:
    """``_bound`` of a use from its factors, Σ_t ‖L_t‖‖R_t‖ ≥ ‖G_u,i‖ (B,) and the counts of non-zero
    terms, for an explicit-route parameter whose clipped sum is taken from the factors (its G not
    kept): the cancellation guard then treats its norm as a ghost route's. (An ``Explicit`` use is
    summed from its own G: its bound is its norm.)"""
    if isinstance(u, Dense) and u.R is not None:
        nl = torch.linalg.vector_norm(u.L, dim=-1, dtype=acc)  # ‖L_t‖ (B, T)
        nr = torch.linalg.vector_norm(u.R, dim=-1, dtype=acc)  # ‖R_t‖ (B, T)
        _bound(u, nl * nr, bounds, tokens, squared=False)
    elif isinstance(u, Dense):
        _bound(u, torch.linalg.vector_norm(u.L, dim=-1, dtype=acc), bounds, tokens, squared=False)  # ‖L_t‖
    elif isinstance(u, Index):
        _bound(u, torch.linalg.vector_norm(u.R, dim=-1, dtype=acc), bounds, tokens, squared=False)  # ‖R_t‖
    else:
        bounds[id(u)] = _sq_norm(_materialise(u, shape, acc)).sqrt()


# The ghost norm of a weight is a product of two factors' Grams: an example whose activations are
# tiny (2.5e-23: their squares underflow float32 to 0) and whose output gradients are huge (5e17)
# has a Gram LLᵀ of 0 and so a norm of 0, while its gradient Lᵀ R (computed by the clipped sum's
# matmul, without squares) is real: at C = 1 it contributed 1.64 C, at T = 512 ~13 C (found by
# review, round 32). Underflow takes less than tiny (the dtype's smallest normal; flush-to-zero
# included) from each product, so each Gram entry is off by at most p·tiny and the product sum
# ⟨A, B⟩ = Σ_ts A_ts B_ts by at most p0·tiny·Σ_ts|B_ts| + p1·tiny·Σ_ts|A_ts| + T²·tiny·(1 + p0·p1·tiny),
# with Σ_ts|A_ts| ≤ (Σ_t ‖L_t‖)². That much (in float64, from the Gram diagonals, each row's norm²
# taken + p·tiny for what it may have lost) is added to the squared norm: an upper bound whatever
# underflowed, and ~1e-35 relative for ordinary activations.
def _underflow_slack(dl: Tensor, dr: Tensor, p0: int, p1: int, acc: torch.dtype) -> Tensor:
    """The bound above (..., B) from the diagonals dl = ‖L_t‖², dr = ‖R_t‖² (..., B, T). Float64 too
    (round 33): activations of 1e-163 (squares 0) with output gradients of 5e153 had a norm of 0 and
    contributed 80 C at C = 1e-10; the products below are taken left to right (p·tiny first), so
    they stay finite wherever the Grams are."""
    tiny = torch.finfo(acc).tiny
    sl = (dl.double() + p0 * tiny).sqrt().sum(-1)  # Σ_t ‖L_t‖
    sr = (dr.double() + p1 * tiny).sqrt().sum(-1)  # Σ_t ‖R_t‖
    T = dl.shape[-1]
    slack = p0 * tiny * sr * sr + p1 * tiny * sl * sl + T * T * tiny * (1.0 + p0 * p1 * tiny)
    # A slack δ ≤ (eps·MIN_THRESHOLD)² cannot move a contribution past C by more than eps² relative
    # (C ≥ MIN_THRESHOLD: √(C² + δ) ≤ C·(1 + eps²/2)): dropped, so that an example whose gradient is
    # exactly 0 (no loss tokens) keeps a norm of exactly 0, not ~1e-152 (float64).
    return torch.where(slack > (torch.finfo(acc).eps * MIN_THRESHOLD) ** 2, slack, 0.0)


# Two index uses (an embedding's lookups) take the equal-ids mask (B, T, S) while T·S is at most this
# many times the elements of the per-example tables they would otherwise build (B, rows, d), one
# table for a self pair, two for a cross pair; beyond it (a few rows looked up at many positions:
# T5's relative bias, 32 buckets at T² positions) the tables are the smaller and cheaper ones. A word
# embedding (rows·d in the millions) keeps the mask at any practical T.
INDEX_GHOST_MAX_RATIO = 4


def _index_tables(u: Index, v: Index) -> bool:
    """Whether ``_inner`` of these two index uses builds the per-example tables (else the mask)."""
    tables = (1 if u is v else 2) * u.num_rows * int(u.R.shape[-1])
    return u.T * v.T > INDEX_GHOST_MAX_RATIO * tables


def _inner(u: Use, v: Use, shape: torch.Size, acc: torch.dtype, cache: Optional[_GramMemo] = None,
           rows: Optional[Dict[int, Tensor]] = None, bounds: Optional[Dict[int, Tensor]] = None,
           compact: Optional[Dict[int, _Compact]] = None, tokens: Optional[Dict[int, Tensor]] = None) -> Tensor:
    """Per-example ⟨G_u, G_v⟩ (B,) without materialising G when a ghost formula exists (``cache``:
    this batch's ``_GramMemo``; ``rows``: filled with ``_active_rows`` of self pairs, by id(use);
    ``bounds``: filled, for self pairs of Gram formulas, with Σ_t ‖L_t‖‖R_t‖ ≥ ‖G_u,i‖ (B,), read
    off the Gram diagonals, by id(use); ``compact``: ``_compaction`` of self pairs, by id(use);
    ``tokens``: filled, where ``bounds`` is, with each example's count of rows t whose term
    ‖L_t‖‖R_t‖ is not 0 (B,), for the cancellation guard's threshold)."""
    if isinstance(u, Index) and isinstance(v, Dense):
        u, v = v, u
    comp = compact.get(id(u)) if compact is not None and u is v else None
    if comp is not None:  # only the rows that are not exactly zero, by groups (see ``_compaction``)
        memo = cache if cache is not None else _GramMemo({})
        gls, grs = memo.self_gram(u.L, acc, comp), memo.self_gram(u.R, acc, comp)
        full: Dict[str, Dict[int, Tensor]] = {"out": {}, "bound": {}, "count": {}}  # (B,) each, by id(use)
        for (ex, _, _), gl, gr in zip(comp.groups, gls, grs):
            part: Dict[str, Dict[int, Tensor]] = {"out": {id(u): (gl * gr).sum((1, 2))}, "bound": {}, "count": {}}
            if bounds is not None:  # over the group's rows (the others are zero rows: terms 0)
                dgl, dgr = gl.diagonal(dim1=1, dim2=2), gr.diagonal(dim1=1, dim2=2)
                _bound(u, dgl * dgr, part["bound"], part["count"] if tokens is not None else None,
                       slack=_underflow_slack(dgl, dgr, u.L.shape[-1], u.R.shape[-1], acc))
            for k, d in part.items():  # the group's (B_g,) values into their examples' places
                if id(u) in d:
                    x = d[id(u)]
                    f = full[k].setdefault(id(u), torch.empty(u.L.shape[0], dtype=x.dtype, device=x.device))
                    f.copy_(x) if ex is None else f.index_copy_(0, ex, x)
        if bounds is not None:
            bounds.update(full["bound"])
        if tokens is not None:
            tokens.update(full["count"])
        if rows is not None:
            rows[id(u)] = comp.rows
        return full["out"][id(u)]
    if isinstance(u, Dense) and isinstance(v, Dense) and u.R is not None and v.R is not None \
            and u.L.shape[-1] == v.L.shape[-1] and u.R.shape[-1] == v.R.shape[-1]:
        # (a self pair's Grams may both be ``_SymGram``s: only their blocks on and below the diagonal)
        levels = _pair_levels(u) if u is v else 0
        gl = _gram(u.L, v.L, acc, cache, levels)  # (B, T, P0) x (B, S, P0) -> (B, T, S)
        gr = _gram(u.R, v.R, acc, cache, levels)  # (B, T, P1) x (B, S, P1) -> (B, T, S)
        if u is v and (bounds is not None or rows is not None):
            dl, dr = _gdiag(gl), _gdiag(gr)  # ‖L_t‖², ‖R_t‖² (B, T)
            if bounds is not None:
                # Σ_t ‖L_t‖‖R_t‖ (B,): √(‖L_t‖²‖R_t‖²), the Gram diagonals (sums of squares: ≥ 0)
                _bound(u, dl * dr, bounds, tokens, slack=_underflow_slack(dl, dr, u.L.shape[-1], u.R.shape[-1], acc))
            if rows is not None:
                act = _active_rows(u, dl, dr, tokens.get(id(u)) if tokens is not None else None)  # (_bound's counts)
                if act is not None:
                    rows[id(u)] = act
        return _ginner(gl, gr)  # (B, T, S) x (B, T, S) -> (B,)
    if isinstance(u, Dense) and u.R is None and isinstance(v, Dense) and v.R is None:
        if u is v and bounds is not None:
            _bound(u, torch.linalg.vector_norm(u.L.to(acc), dim=-1), bounds, tokens, squared=False)  # ‖L_t‖ (B, T)
        return (u.L.to(acc).sum(1) * v.L.to(acc).sum(1)).sum(1)  # (B, P0) · (B, P0) -> (B,)
    if isinstance(u, Index) and isinstance(v, Index) and u.R.shape[-1] == v.R.shape[-1] \
            and u.num_rows == v.num_rows and _index_tables(u, v):
        Gu = _materialise(u, shape, acc)  # (B, rows, d)
        Gv = Gu if u is v else _materialise(v, shape, acc)
        if u is v and bounds is not None:
            # the bound from the rows' terms ‖R_t‖, as on the mask path: the clipped sum is taken from the
            # factors, so a table that cancels (+M and -M on one row) must not count as a small norm
            _bound(u, u.R.to(acc).pow(2).sum(-1), bounds, tokens)  # ‖e_{id_t}‖²‖R_t‖² (B, T)
        return (Gu.reshape(Gu.shape[0], -1) * Gv.reshape(Gv.shape[0], -1)).sum(1)  # (B, rows·d) · -> (B,)
    if isinstance(u, Index) and isinstance(v, Index) and u.R.shape[-1] == v.R.shape[-1]:
        eq = (u.ids.unsqueeze(2) == v.ids.unsqueeze(1)).to(acc)  # (B, T, 1) == (B, 1, S) -> (B, T, S)
        gr = _gram(u.R.to(acc), v.R.to(acc))  # (B, T, d) x (B, S, d) -> (B, T, S)
        if u is v and bounds is not None:
            _bound(u, gr.diagonal(dim1=1, dim2=2), bounds, tokens)  # ‖e_{id_t}‖²‖R_t‖² (B, T)
        return (eq * gr).sum((1, 2))  # (B, T, S) -> (B,)
    if isinstance(u, Dense) and u.R is not None and isinstance(v, Index) \
            and u.L.shape[-1] == v.num_rows and u.R.shape[-1] == v.R.shape[-1]:
        # ⟨Σ_s L[s] ⊗ R[s], Σ_t e_{id_t} ⊗ R'[t]⟩ = Σ_{s,t} L[s, id_t] (R[s]·R'[t])
        B, S, _ = u.L.shape
        idx = v.ids.unsqueeze(1).expand(B, S, v.ids.shape[1])  # (B, S, T)
        gath = torch.gather(u.L, 2, idx).to(acc)  # (B, S, V) at ids -> (B, S, T)
        return (gath * _gram(u.R.to(acc), v.R.to(acc))).sum((1, 2))  # (B, S, d) x (B, T, d) -> (B,)
    Gu = _materialise(u, shape, acc)
    Gv = _materialise(v, shape, acc)
    out = (Gu.reshape(Gu.shape[0], -1) * Gv.reshape(Gv.shape[0], -1)).sum(1)  # (B, n) · (B, n) -> (B,)
    if u is v and bounds is not None:
        bounds[id(u)] = out.clamp_min(0).sqrt()  # ‖G_u,i‖ itself, materialised
    return out


# Ghost norms of equal-shaped layers, taken together. The self pair of a dense use whose Grams no
# other use shares, held full (B, T, T) (no ``_SymGram`` halvings, no compaction), is computed with
# the other such uses of the same shapes and dtypes (e.g. every block's attention output projection):
# their Grams are written into one (2, m, B, T, T) tensor, one bmm per factor as before, and the
# norms, the cancellation guard's bounds and token counts are then read off it in ~6 ops for the
# whole group instead of ~8 per layer, with far less Python per layer (a GPU step is launch-bound;
# ``launch-proxy`` in benchmarks/README.md, round 26). Exact: the same products and sums per
# example as ``_inner``. A group holds at most GROUP_MAX_ELEMS Gram elements (larger ones split),
# so at long T, where the Grams are big and the work compute-bound, each layer goes alone.
GROUP_MAX_ELEMS = 1 << 22


def _groupable(u: Use, counts: Mapping, acc: torch.dtype, comp: Optional["_Compact"]) -> Optional[Tuple]:
    """The group key of a ghost-route parameter's single use ``u`` if its self pair can be taken in a
    group (``_ghost_groups``), else None."""
    if not (isinstance(u, Dense) and u.R is not None and comp is None and u.L.dim() == 3 and u.R.dim() == 3
            and u.L.shape[:2] == u.R.shape[:2] and u.L.shape[0] > 0 and u.L.shape[1] > 0 and _pair_levels(u) == 0):
        return None
    if counts.get(_gram_key(u.L, acc, None, 0), 0) > 1 or counts.get(_gram_key(u.R, acc, None, 0), 0) > 1:
        return None  # a Gram shared with another use (q/k/v's input): the memo computes it once
    return (tuple(u.L.shape), tuple(u.R.shape), u.L.dtype, u.R.dtype, acc, u.L.device)


def _ghost_groups(items: Sequence[Tuple[str, Dense, Tuple]], rows: Optional[Dict[int, Tensor]],
                  tokens: Dict[int, Tensor]) -> Dict[str, Tuple[Tensor, Tensor]]:
    """For the ``(name, use, key)`` items (``_groupable`` keys), in groups of 2 or more of one key:
    name -> (‖G_i‖² (B,), the bound Σ_t ‖L_t‖‖R_t‖ (B,)) of each use's self pair, as ``_inner`` gives
    them; fills ``tokens`` (non-float64) and ``rows`` (``_active_rows``) by id(use) as ``_inner`` does.
    Items left alone (a group of one) are not in the result."""
    by: Dict[Tuple, List[Tuple[str, Dense]]] = {}
    for n, u, k in items:
        by.setdefault(k, []).append((n, u))
    out: Dict[str, Tuple[Tensor, Tensor]] = {}
    for (ls, rs, _, _, acc, device), members in by.items():
        B, T = ls[0], ls[1]
        per = GROUP_MAX_ELEMS // (2 * B * T * T)
        if per < 2 or len(members) < 2:
            continue
        for s in range(0, len(members), per):
            part = members[s:s + per]
            if len(part) < 2:
                break  # (a last one alone: ``_inner``)
            G = torch.empty((2, len(part), B, T, T), dtype=acc, device=device)
            for j, (_, u) in enumerate(part):
                for f, X in enumerate((u.L, u.R)):
                    X = X.to(acc)
                    torch.bmm(X, X.transpose(1, 2), out=G[f, j])  # (B, T, P) x (B, P, T) -> (B, T, T)
            d = G.diagonal(dim1=3, dim2=4)  # (2, m, B, T): ‖L_t‖², ‖R_t‖²
            terms = d[0] * d[1]  # (m, B, T)
            slack = _underflow_slack(d[0], d[1], ls[2], rs[2], acc)  # (m, B) (see ``_underflow_slack``)
            bound = terms.sqrt().sum(2)  # (m, B): Σ_t ‖L_t‖‖R_t‖
            cnt = torch.count_nonzero(terms, dim=2)  # (m, B), as ``_bound``
            sq = (G[0] * G[1]).sum((2, 3))  # (m, B, T, T) -> (m, B): ⟨L Lᵀ, R Rᵀ⟩ per example
            check = rows is not None and B * T * ls[2] * rs[2] >= ACTIVE_ROWS_MIN_WORK
            if check and cnt is not None and int(cnt.sum()) == len(part) * B * T:
                check = False  # every row of every use has a non-zero term: no zero rows (one host read)
            d = d.clone() if check else None  # (the diagonals alone: the Grams are freed before the next group)
            del G, terms
            for j, (n, u) in enumerate(part):
                out[n] = (sq[j], bound[j], slack[j])
                if cnt is not None:
                    tokens[id(u)] = cnt[j]
                if check:
                    act = _active_rows(u, d[0, j], d[1, j], None if cnt is None else cnt[j])
                    if act is not None:
                        rows[id(u)] = act
    return out


# Float32 ghost norms (a sum of T² products of Gram entries) can lose their digits to cancellation
# when large token terms nearly cancel, which an example can be crafted to do (activations ≈ 1e4
# with opposing output gradients: a norm of 7.5 computed as 0), while the clipped sum is computed
# by a separate matmul: the example would escape its clip. κ_i = (Σ_t ‖L_t‖‖R_t‖)² / ‖G_i‖² says how
# much cancels; measured on GPT-2 / BERT / OPT at T = 32 and 128 it stays below 1.3·n_i for every
# weight, n_i the example's rows whose term ‖L_t‖‖R_t‖ is not 0 (its tokens: padding does not
# count; a use without per-row terms counts T). An example with κ_i > KAPPA_MAX_PER_T · n_i
# (summed over a parameter's uses) in float32 (or narrower) is clipped with the bound
# (Σ_t ‖L_t‖‖R_t‖)² ≥ ‖G_i‖² (triangle inequality) as its squared norm: clipped harder, never more
# than C. No host read decides it (torch.where). Float64 is guarded too (round 33: activations of
# 1e12 cancel the same way), at a threshold 2²⁹ times higher (its rounding unit is 2⁻²⁹ float32's).
KAPPA_MAX_PER_T = 16
# Below that threshold rounding can still leave a norm short: by up to ~0.27·u·(Σ_t ‖L_t‖‖R_t‖)²
# (u = 2⁻²⁴ for float32) in a search over crafted cancelling examples just under it (d, p from 16
# to 3072, T from 16 to 2048; round 33), i.e. up to ~κ·0.27·u relative, 0.1–0.5 % of C at T = 1024–
# 4096. So every guarded squared norm gets ROUNDING_ALLOWANCE·u·(Σ_t ‖L_t‖‖R_t‖)² added (capped at
# that bound itself, which is ≥ ‖G_i‖², up to its own float rounding where κ ≈ 1 and nothing cancels):
# the rounding is made one-sided, on the clipped-harder side,
# with a 15x margin over the largest error found (an empirical allowance, not a proof for every
# summation order). Ordinary examples (κ ≤ 1.3·n) get ~5·u·n relative: 2e-5 of a norm at n = 128
# in float32, 4e-14 in float64 (inside the oracle tests' 1e-9).
ROUNDING_ALLOWANCE = 4.0
# Review, round 37: structured inputs (rows of one constant value) round one-sided in the Gram dot
# products, ~100·u relative at p = 4096-16384 in float32, which κ then multiplies: a contribution
# 0.03-0.4 % over C in float32 just under the threshold, and 2.4 % in float64, whose threshold lets κ
# reach 2²⁹·16·n. In float64 the allowance now follows a bound, at little cost to ordinary examples
# (~1e-11-1e-10 of a norm at T = 128-512): a Gram entry ⟨x, y⟩ of length P is off by at most
# γ_P·‖x‖‖y‖ whatever the summation order (BLAS blocks), so S = Σ_ts A_ts B_ts is off by at most
# (γ_P0 + γ_P1 + γ_P0·γ_P1)·b² from the Grams and u·b² from the products, plus its own sum of
# n = (Σ_u T_u)² products, which torch reduces by cascade (pairwise) summation: ~log₂(n)·u·b² (a
# sequential sum would need n·u·b², T³·u relative: the 1e-9 oracle checks failed at T = 512 with it;
# review of round 37's diff); and b, from the Gram diagonals, is low by at most ((P0 + P1)/2 + Σ_u T_u
# + 2)·u relative: ``_rigorous_allowance(P0 + P1, ΣT)`` covers it, and the cap at b² is raised by b's
# own error. (A norm from a materialised G, an explicit route's whose G is not kept, is a sum of
# P0·P1 squares, cascade-summed as well.) In float32
# the same bound costs ordinary examples ~(2(P0 + P1) + 2T)·u·κ relative (κ ≈ n: 2-11 % of the
# squared norm at T = 128-512 for GPT-2's widths), so float32 keeps the empirical allowance, whose margin the structured inputs above
# exceed by up to ~0.4 % of C: a limit left open (float64 Grams for float32 models, or the proof's
# allowance for the few examples whose κ is large, would close it).


def _rigorous_allowance(dims: int, rows: int) -> Tuple[float, float]:
    """(the squared norm's allowance, the cap's) in units of u·b² for Grams over ``dims`` = P0 + P1
    coordinates and ``rows`` = Σ_u T_u rows (float64; see above: the sum of rows² products and of a
    materialised G's squares cascade-summed, ~2·log₂ of their count each)."""
    sums = 2 * (max(1, rows * rows).bit_length() + max(1, dims * dims).bit_length())
    return float(2 * dims + sums + 2 * rows + 16), float(dims + 2 * rows + 8)


class _Guard:
    """The cancellation guard above, for all ghost-route parameters of a batch at once: their
    squared norms are collected (``add``) and guarded in a few stacked ops per (dtype, device, T)
    group (``done``), instead of ~5 small ops per parameter (launches, on a GPU)."""

    def __init__(self):
        self.groups: Dict[Tuple, List[Tuple[str, Tensor, Optional[Tensor]]]] = {}

    def add(self, n: str, tot: Tensor, uses: List[Use], bounds: Dict[int, Tensor], acc: torch.dtype,
            tokens: Optional[Dict[int, Tensor]] = None) -> None:
        b = None
        if uses and all(id(u) in bounds for u in uses):
            b = bounds[id(uses[0])]
            for u in uses[1:]:
                b = b + bounds[id(u)]  # Σ over uses: ‖Σ_u G_u,i‖ ≤ Σ_u Σ_t ‖L_t‖‖R_t‖
        # tokens over all uses (``tokens``: per example (B,), the rows whose term ‖L_t‖‖R_t‖ is not 0,
        # e.g. not padding: a tighter threshold than T; a use without: its T)
        T: Any = 0
        if b is not None:
            T = sum((tokens or {}).get(id(u), getattr(u, "T", 1)) for u in uses)
        per_example = isinstance(T, Tensor)
        # the underflow slack over all uses (``_underflow_slack``): pairs' cross terms included, (Σ_u √Δ_u)²
        sl = [bounds[("slack", id(u))] for u in uses if ("slack", id(u)) in bounds]  # type: ignore[operator]
        slack = None
        if sl:
            slack = sl[0] if len(sl) == 1 else torch.stack(sl).sqrt().sum(0) ** 2
        allow = None  # (float64 only: see ``_rigorous_allowance``)
        if tot.dtype == torch.float64:
            allow = _rigorous_allowance(max((_factor_dims(u) for u in uses), default=0),
                                        sum(int(getattr(u, "T", 1)) for u in uses))
        self.groups.setdefault((tot.dtype, tot.device, "per example" if per_example else T), []).append(
            (n, tot, b, T if per_example else None, slack, allow))

    def done(self, sq: Dict[str, Tensor]) -> None:
        for (_, _, T), items in self.groups.items():
            # a sum of squares; rounding may dip below 0 only when ~0
            S = torch.stack([it[1] for it in items], 1).clamp_min_(0)  # m x (B,) -> (B, m)
            if T:  # T = 0: no bounds (a use without one): the norms as they are
                b = torch.stack([it[2] for it in items], 1)
                b2 = b * b
                if T == "per example":
                    # counts (int64, ≤ T: exact in float32), stacked first: one conversion, not one per parameter
                    T = torch.stack([it[3].to(S.device) for it in items], 1).to(S.dtype).clamp_min_(1)  # (B, m)
                u = torch.finfo(S.dtype).eps / 2
                kmax = KAPPA_MAX_PER_T * max(1.0, 2.0 ** -24 / u)  # float64: 2²⁹·16 (its rounding is 2⁻²⁹ float32's)
                if S.dtype == torch.float64:  # the bound's allowance (``_rigorous_allowance``)
                    k = torch.tensor([it[5] for it in items], dtype=S.dtype, device=S.device)  # (m, 2)
                    allow, cap = (k[:, 0] * u) * b2, b2 * (1 + k[:, 1] * u)
                else:
                    allow, cap = (ROUNDING_ALLOWANCE * u) * b2, b2
                S = torch.where(S * (kmax * T) < b2, cap, torch.minimum(S + allow, cap))
            if any(it[4] is not None for it in items):  # (it: name, S, b, T, slack, allowances)
                # + what underflow can have taken (float64; a sum beyond S's range becomes inf: the example
                # is then dropped as non-finite)
                zero = torch.zeros(S.shape[0], dtype=torch.float64, device=S.device)
                D = torch.stack([zero if it[4] is None else it[4].to(S.device) for it in items], 1)  # (B, m)
                S = (S.double() + D).to(S.dtype)
            for j, item in enumerate(items):
                sq[item[0]] = S[:, j]
        self.groups.clear()


def _factor_dims(u: Use) -> int:
    """P0 + P1: the lengths of the dot products in a use's two Grams (an Index use's id Gram is exact)."""
    if isinstance(u, Dense):
        return int(u.L.shape[-1]) + (int(u.R.shape[-1]) if u.R is not None else 0)
    if isinstance(u, Index):
        return int(u.R.shape[-1])
    return 0


def _zero_rows(x: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


# A clipped sum Lᵀ R (P0, k) x (k, P1) with a wide P0 (a language-model head's vocabulary, e.g.
# (8192, B·T) x (B·T, 256)) runs as row blocks of SUM_BLOCK_ROWS output rows, each written in place
# into its slice of the result: the same products and sums, and on CPU faster than one matmul
# that writes the whole (P0, P1) output (measured, one thread, oneMKL on AMD EPYC, B·T = 256–4096,
# P0 = 8192, P1 = 256: 0.84–0.89× its time; no gain at P0 ≤ 1024, hence SUM_BLOCK_MIN_ROWS;
# ``benchmarks/README.md``, round 16). CPU only (on CUDA each block is one more launch).
SUM_BLOCK_ROWS = 512
SUM_BLOCK_MIN_ROWS = 4096
SUM_BLOCK_DEVICES = ("cpu",)


def _tmm(L: Tensor, R: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Lᵀ R for L (k, P0) and R (k, P1): (P0, P1); added into ``out`` (P0, P1) in place if given."""
    P0 = L.shape[1]
    if P0 < SUM_BLOCK_MIN_ROWS or L.device.type not in SUM_BLOCK_DEVICES:
        return torch.mm(L.t(), R) if out is None else out.addmm_(L.t(), R)
    if out is None:
        out = torch.empty(P0, R.shape[1], dtype=torch.promote_types(L.dtype, R.dtype), device=L.device)
        for i in range(0, P0, SUM_BLOCK_ROWS):
            torch.mm(L[:, i:i + SUM_BLOCK_ROWS].t(), R, out=out[i:i + SUM_BLOCK_ROWS])  # (b, k) x (k, P1)
        return out
    for i in range(0, P0, SUM_BLOCK_ROWS):
        out[i:i + SUM_BLOCK_ROWS].addmm_(L[:, i:i + SUM_BLOCK_ROWS].t(), R)  # += (b, k) x (k, P1)
    return out


def _weighted_use_sum(u: Use, w: Tensor, keep: Optional[Tensor], shape: torch.Size, acc: torch.dtype,
                      rows: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
    """Σ_i w_i G_u,i (param shape) from the factors; rows with keep False are zeroed first.

    ``rows`` (dense uses): indices of the B·T factor rows that are not exactly zero; the matmul then
    runs over those rows only (the others contribute exactly 0). ``out``: a sum of the same
    parameter's other uses, owned by the caller (fresh, contiguous): this use's sum is added into
    it in place and it is returned (no zero-filled or summed parameter-sized copy)."""
    if isinstance(u, Explicit):
        t = _wsum(w, u.G.to(acc).reshape(u.G.shape[0], *shape), keep)
        return t if out is None else out.add_(t)
    w = w.to(acc)
    if isinstance(u, Dense) and u.R is not None and rows is not None:
        B, T, P0 = u.L.shape
        P1 = u.R.shape[-1]
        ex = torch.div(rows, T, rounding_mode="floor")  # example of each row
        if keep is not None:  # drop rows of weight-0 examples (never multiplied by 0)
            sel = keep.index_select(0, ex)
            rows, ex = rows[sel], ex[sel]
        L = u.L.reshape(B * T, P0).index_select(0, rows).to(acc)  # (k, P0)
        R = u.R.reshape(B * T, P1).index_select(0, rows).to(acc)  # (k, P1)
        wr = w.index_select(0, ex).unsqueeze(1)  # (k, 1)
        if P0 <= P1:
            L = L.mul_(wr)
        else:
            R = R.mul_(wr)
        if out is not None:
            _tmm(L, R, out.view(P0, P1))  # += (P0, k) x (k, P1)
            return out
        return _tmm(L, R).reshape(shape)  # (P0, k) x (k, P1) -> (P0, P1)
    if isinstance(u, Dense):
        L = u.L.to(acc)
        if keep is not None:
            L = _zero_rows(L, keep)
        if u.R is None:
            t = torch.einsum("b,btp->p", w, L).reshape(shape)  # (B,) x (B, T, P0) -> (P0,)
            return t if out is None else out.add_(t)
        R = u.R.to(acc)
        if keep is not None:
            R = _zero_rows(R, keep)
        P0, P1 = L.shape[-1], R.shape[-1]
        if P0 <= P1:  # scale the smaller factor by w
            L = L * w.view(-1, 1, 1)  # (B, T, P0) * (B, 1, 1)
        else:
            R = R * w.view(-1, 1, 1)  # (B, T, P1) * (B, 1, 1)
        if out is not None:
            _tmm(L.reshape(-1, P0), R.reshape(-1, P1), out.view(P0, P1))  # += (P0, B·T) x (B·T, P1)
            return out
        return _tmm(L.reshape(-1, P0), R.reshape(-1, P1)).reshape(shape)  # (P0, B·T) x (B·T, P1) -> (P0, P1)
    R = u.R.to(acc)
    if keep is not None:
        R = _zero_rows(R, keep)
    d = R.shape[-1]
    if out is None:
        out = torch.zeros(shape, dtype=acc, device=R.device)
    out.view(u.num_rows, d).index_add_(0, u.ids.reshape(-1), (R * w.view(-1, 1, 1)).reshape(-1, d))  # (B·T, d) -> (V, d)
    return out


# ------------------------------------------------------------------------------------------------
# capture: one forward, one backward through the activations
# ------------------------------------------------------------------------------------------------


def _plain(v: Any, depth: int = 0) -> Any:
    """``v`` if it is a plain value (a number, numpy's included, a string, None, or a tuple / list of
    them, torch.Size and named tuples included), else a marker."""
    if isinstance(v, (numbers.Number, str, bytes, type(None))):
        return v
    if isinstance(v, (tuple, list)) and depth < 2:
        return tuple(_plain(x, depth + 1) for x in v)
    return _NOT_PLAIN


_NOT_PLAIN = object()
_PLAIN_TYPES = frozenset({int, float, bool, str, type(None)})  # (the common case, by exact type)
_SKIP_TYPES = frozenset({dict, collections.OrderedDict, set})  # (a module's own tables: parameters, hooks, ...)


def _settings(module: nn.Module) -> Tuple[Any, ...]:
    """What a rule may read from ``module`` besides its parameters, as it is now: its plain attributes
    (stride, padding, dilation, eps, ...) and its buffers (identity and version: running statistics).
    Rules read them when the gradient is ready, after the forward; a call made with other settings
    (a layer switched and restored inside the forward; review, round 37: a shared conv at two dilations
    was read at one, 37 % off) is seen by comparing the call's record with the module after it."""
    attrs = []
    for k, v in module.__dict__.items():
        t = type(v)
        if t in _PLAIN_TYPES:
            attrs.append((k, v))
        elif t not in _SKIP_TYPES:  # (numpy scalars, tuples, torch.Size, ...: review, round 37)
            v = _plain(v)
            if v is not _NOT_PLAIN:
                attrs.append((k, v))
    bufs = module._buffers
    return tuple(attrs), (tuple((n, id(b), b._version) for n, b in bufs.items() if b is not None) if bufs else ())


def _same_settings(a: Any, b: Any) -> bool:
    try:
        return a == b
    except Exception:  # (a value whose comparison raises: not the same, safely)
        return False


@dataclass
class _Call:
    module: nn.Module
    mname: str
    rule: Rule
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    output: Optional[Tensor]  # None for a custom-forward rule (its targets are in ``capture``)
    versions: Tuple[int, ...]
    capture: Any = None  # custom-forward rules: what ``rule.forward`` returned beside the output
    edge: Any = None  # the output's gradient edge, once ``output`` is released (see ``_release_outputs``)
    k: int = -1  # this call's index among its module's calls (for the batch-dimension probe)
    gshape: Optional[torch.Size] = None  # the output's shape, when ``edge`` is its base's (gradient reshaped)
    rows: int = 0  # > 0: the input is the batch flattened, (B·rows, ...), example-major (see ``_flat_rows``)
    roots: Tuple[Tuple[str, int], ...] = ()  # (module name, call index) of the calls whose inputs showed the flattening
    chain: Tuple[int, ...] = ()  # calls (indices) whose outputs the flattened input was traced through
    bcast: bool = False  # its (1, T, ...) or batch-free (T, ...) output was expanded to the batch (``Rule.broadcast_batch``)
    lift: int = 0  # > 0: batch-free ids (T,) of this length, expanded (``bcast``); the rule reads them as (1, T)
    # the probe may read this call otherwise: "time", a (B, B, ...) input (T = B) or a (1, B, ...) one
    # (T = 1) that is time-major; "free", 1-d (B,) ids that are batch-free (nanoGPT's positions with
    # T = B). Then the capture runs again.
    retry: str = ""
    bdim: int = 0  # 1: a time-major call, (T, B, ...) with T ≠ B (``_time_major``); its rule reads it as (B, T, ...)
    ok: bool = True  # the rule's check of the call as it ran (``Rule.verify``) passed
    amp: Optional[torch.dtype] = None  # the autocast dtype in force for its device when it ran, if any
    settings: Any = None  # the module's settings when it ran (``_settings``), compared after the forward
    # rows picked from a batch-first tensor by an index or mask (``h[mask]``, ``h[idx]``; ``_picked_rows``): a
    # ``_Pick`` (each row's example; the call whose output they were picked from), read as (B, K, ...), K the most
    # rows of one example, zeros elsewhere (``_unflatten``)
    pick: Any = None

    @property
    def targets(self) -> List[Any]:
        if self.capture is not None:
            return list(self.capture.targets)
        return [self.edge if self.edge is not None else self.output]


def _run_verify(verify, module: nn.Module, args, kwargs, output) -> bool:
    """``Rule.verify`` of one call, as it ran: False if it fails or raises. Run with the dispatch
    modes in force set aside (its ops are not the model's: a selective-checkpoint policy, which
    records the forward's ops to replay them in the recomputation, must not see them), without
    autograd."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover - older torch
        _disable_current_modes = contextlib.nullcontext
    try:
        with torch.no_grad(), _disable_current_modes():
            return bool(verify(module, args, kwargs, output))
    except Exception:  # (not the call it knows: exact fallback)
        return False


def _edge_source(output: Tensor, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[Tensor]:
    """The tensor whose gradient edge stands for ``output``'s, or None (keep the output itself).

    A non-view output: itself. A view output (``F.linear`` / HF ``Conv1D`` on 3-D inputs return
    ``addmm(...).view(B, T, p)``): its base, when the view is the whole base in the same element
    order (the gradient is then the base's, reshaped) and the base was made by this layer (shares
    no storage with an input). The view's own edge would be wrong: an in-place edit of a view
    reroutes the backward from the base's node past the view's node (``CopySlices``), so that
    edge would receive none or part of the gradient. Any other view: None."""
    if _gradient_edge is None or not output.requires_grad:
        return None
    if not output._is_view():
        return output
    base = output._base
    if base is None or not base.requires_grad or base.numel() != output.numel() or base.dtype != output.dtype \
            or not (base.is_contiguous() and output.is_contiguous()) or base.storage_offset() != output.storage_offset():
        return None
    ptr = base.untyped_storage().data_ptr()
    for x in (*args, *kwargs.values()):
        if isinstance(x, Tensor) and x.untyped_storage().data_ptr() == ptr:
            return None
    return base


def _release_outputs(calls: List[_Call]) -> None:
    """Keep only the gradient edge of each captured output whose rule does not read the output's
    values (``Rule.needs_output``): ``autograd.grad`` accepts the edge in place of the tensor, so
    an output nobody else saves (e.g. the (B, T, V) logits, a GELU input once its backward ran) is
    freed during the backward instead of living until every g has been computed (memory only;
    the gradients are the same)."""
    if _gradient_edge is None:
        return
    for c in calls:
        if c.capture is None and c.output is not None and c.output.requires_grad \
                and not getattr(c.rule, "needs_output", True):
            c.edge = _gradient_edge(c.output)
            c.output = None


# Flattened batches. Some models run layers on the batch flattened to rows, e.g. OPT's
# ``hidden_states.reshape(-1, d)`` before its feed-forward fc1/fc2: a (B·T, d) input. Its rows
# are example-major (row r belongs to example r // T) when, and only when, it is traced to a view
# that covers a contiguous (B, ...) tensor in its own element order (a "root"; that the root's first
# dimension is the batch is confirmed by the batch-dimension probe, as for any (B, ...) input),
# through row-wise steps only: ruled layers that act on each row alone (``Rule.rowwise``: Linear,
# HF Conv1D, LayerNorm, RMS norms, Embedding) and elementwise ops with one input that has a gradient
# (``_ROWWISE_NODES``, by their autograd node; the tensor at the end of such a chain must have the
# shape of the layer output it started from, so no broadcast added a dimension in front of the rows).
# Anything else (a permutation, a transpose, an op between two such tensors, a time-major
# (T, B, d) base) breaks the chain and the layer takes the exact vmap fallback as before. Such a
# call is given to its rule as (B, rows, ...): input, output and output gradient reshaped.
_ROWWISE_NODES = frozenset({  # elementwise; binary ones only with a constant (no gradient) or a number
    "GeluBackward0", "ReluBackward0", "TanhBackward0", "SigmoidBackward0", "SiluBackward0", "MishBackward0",
    "LeakyReluBackward0", "EluBackward0", "HardtanhBackward0", "NativeDropoutBackward0", "CloneBackward0",
    "ToCopyBackward0", "NegBackward0", "PowBackward0", "MulBackward0", "MulBackward1", "DivBackward0",
    "DivBackward1", "AddBackward0", "AddBackward1", "SubBackward0", "SubBackward1", "WhereBackward0",
    "MaskedFillBackward0",
})
_FLAT_HOPS = 8  # elementwise ops between two row-wise layers that are followed
_FLAT_NODES = 32  # elementwise nodes walked in all (both operands of products: a tree)


def _functorch_wrapped(x: Tensor) -> bool:
    """Whether x lives inside a torch.func transform (a batched or grad-tracking wrapper)."""
    f = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(f(x)) if f is not None else False


def _whole_view_of(x: Tensor) -> Optional[Tensor]:
    """x's base, when x is a contiguous view covering all of a contiguous base in the same order."""
    base = x._base if x._is_view() else None
    if base is None or base.dim() < 1 or not (base.is_contiguous() and x.is_contiguous()) \
            or base.numel() != x.numel() or base.storage_offset() != x.storage_offset():
        return None
    return base


def _normalised_dims(module: nn.Module) -> int:
    """How many trailing dims the layer normalises over (0: none; an int ``normalized_shape``: 1)."""
    ns = module_attr(module, "normalized_shape", None)  # (a missing one: no AttributeError raised)
    if isinstance(ns, int):
        return 1
    return len(ns) if isinstance(ns, (tuple, list, torch.Size)) else 0


_Flat = Tuple[int, Tuple[int, ...], Tuple[Tuple[str, int], ...], Tuple[int, ...]]  # rows, shape, root calls, chain
_NO_ROWS: Tuple[int, Tuple[Tuple[str, int], ...], Tuple[int, ...]] = (0, (), ())
# binary elementwise nodes followed into both operands when both carry a gradient (a gated MLP on the flattened
# rows, act(gate(x)) * up(x), as Qwen2-MoE's shared expert): row r of the result is a function of row r of each,
# so it is example r // rows's when both are traced to such rows (same rows per example, same shape). Not
# ``where``: its condition (no gradient) is not seen.
_ROW_PAIR_NODES = frozenset({"MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0"})


def _flat_rows(x: Tensor, B: int, flat: Dict[Tuple[Any, int], _Flat],
               here: Tuple[str, int]) -> Tuple[int, Tuple[Tuple[str, int], ...], Tuple[int, ...]]:
    """(rows per example, root calls, chain) if x (first dim N = B·rows, N ≠ B) is the batch flattened
    example-major (see above), else (0, (), ()). ``flat``: (autograd node, output nr) -> (rows,
    shape, roots, chain) of the flattened row-wise layer outputs seen so far in this forward; the
    chain lists the calls (indices into the step's calls) traced through, each of which must have
    its rule verify the call (``uses`` not None) for the trace to hold; each root's flattening is
    confirmed by the batch-dimension probe."""
    N = int(x.shape[0])
    base = _whole_view_of(x)
    if base is not None:
        return (N // B, (here,), ()) if int(base.shape[0]) == B else _NO_ROWS
    return _flat_trace((x.grad_fn, x.output_nr), tuple(x.shape), flat, _FLAT_HOPS, [_FLAT_NODES])


def _flat_trace(edge: Tuple[Any, int], shape: Tuple[int, ...], flat: Dict[Tuple[Any, int], _Flat], hops: int,
                nodes: List[int]) -> Tuple[int, Tuple[Tuple[str, int], ...], Tuple[int, ...]]:
    """``_flat_rows`` from an autograd edge back to the flattened layer outputs in ``flat``: at most ``hops``
    elementwise nodes on each path, ``nodes[0]`` in all (shared by both operands of a ``_ROW_PAIR_NODES`` node)."""
    for _ in range(hops):
        node, _nr = edge
        if node is None:
            return _NO_ROWS
        hit = flat.get(edge)
        if hit is not None:
            return (hit[0], hit[2], hit[3]) if hit[1] == shape else _NO_ROWS
        name = type(node).__name__
        nodes[0] -= 1
        if name not in _ROWWISE_NODES or nodes[0] < 0:
            return _NO_ROWS
        nxt = [(n, i) for n, i in node.next_functions if n is not None]
        if len(nxt) == 2 and name in _ROW_PAIR_NODES:
            hops -= 1
            a = _flat_trace(nxt[0], shape, flat, hops, nodes)
            b = _flat_trace(nxt[1], shape, flat, hops, nodes) if a[0] else _NO_ROWS
            if not (a[0] and a[0] == b[0]):
                return _NO_ROWS
            return a[0], tuple(dict.fromkeys(a[1] + b[1])), tuple(sorted(set(a[2] + b[2])))
        if len(nxt) != 1:
            return _NO_ROWS
        edge = nxt[0]
        hops -= 1
    return _NO_ROWS


class _Pick(NamedTuple):
    """Rows of a layer's input picked from a batch-first tensor (see ``_picked_rows``)."""

    n: int  # rows picked
    K: int  # the most rows picked from one example (1 at least)
    dest: Tensor  # (n,): row r's place in the (B·K, ...) padded rows, example-major
    src: int  # the call (index) whose output the rows were picked from, through elementwise ops; -1: the batch's input
    examples: Tensor  # (n,): row r's example


def _pick_of(e: Tensor, B: int, src: int) -> _Pick:
    """Each picked row's place among its example's rows: example e[r], in the order of r."""
    n = int(e.numel())
    counts = torch.bincount(e, minlength=B)
    K = max(1, int(counts.max())) if n else 1
    order = torch.argsort(e, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(e)
    rank[order] = torch.arange(n, dtype=e.dtype) - starts[e[order]]
    return _Pick(n, K, e * K + rank, src, e)


_MIXED_PICK = ("its input's rows were picked by an index or mask and passed an op whose other operand may hold other "
               "examples' values (a tensor multiply, add, where or masked_fill with a per-example tensor): they are "
               "not credited to their examples. Apply that op to the layer's output, or run the layer on every row "
               "and pick from its output (head(h)[mask])")


def _own_rows_op(node, dims: int) -> bool:
    """Whether an elementwise node (``_ROWWISE_NODES``) keeps each row of its tensor (``dims`` dims) a function of that
    row alone: unary ops, and binary ones whose other operand (no gradient) is a number or the same for every row (a
    0-d tensor, fewer dims, or a first dim of 1). Review of round 52: ``(x * m.flip(0)[..., None])[mask]``, a 0/1 mask of
    other examples (out of the graph), credited each picked row to its example while its value held another's (one
    example replaced moved the sum by 1.27 C). An add or ``where`` (their other operand not saved), or a mask read
    from a saved-tensor hook: not known, refused."""
    name = type(node).__name__
    if name in ("MulBackward0", "DivBackward0", "MaskedFillBackward0"):
        try:
            if name == "MaskedFillBackward0":
                raw = node._raw_saved_mask
            else:
                none = [i for i, (n, _) in enumerate(node.next_functions) if n is None]
                if len(none) != 1:
                    return False
                raw = node._raw_saved_self if none[0] == 0 else node._raw_saved_other
            if raw is None or raw.unpack_hook is not None:
                return False
            t = raw.data
        except (AttributeError, RuntimeError, TypeError):
            return False
        return isinstance(t, Tensor) and (t.numel() == 1 or t.dim() < dims or int(t.shape[0]) == 1)
    return name in _ROWWISE_NODES and name not in ("AddBackward0", "SubBackward0", "WhereBackward0")


def _picked_rows(x: Tensor, B: int, outs: Optional[Mapping[Tuple[Any, int], Tuple[int, Tuple[int, ...]]]] = None,
                 calls: Optional[Sequence["_Call"]] = None) -> Union[None, str, _Pick]:
    """Rows of x picked by an index from the rows of a tensor whose first dim is the batch (or the batch flattened,
    B·k rows): ``h[mask]``, ``h[idx]``, ``index_select(h, 0, idx)``, through elementwise ops. None where x was not
    picked so (or its index cannot be read), or where its B rows are one of each example in order
    (``h[torch.arange(B), last]``, a mask with one True per example); a ``_Pick`` where h (B, ...) is the output
    of a captured batch-first call (``outs``: output edge -> (call index, output shape), through elementwise ops
    too): each row read as its example's (its gradient reaches that example's row of h only), the call on its
    rules if that call's batch dim is confirmed (``_check_picks``; round 52: before, the exact fallback, which
    cannot run ``h[mask]``: the step raised); else why the rows cannot be read as the batch's (a str). Review of
    round 50: a head run on the tokens with a label, ``head(h[labels != -100])``, took its B picked rows for the B
    examples where the picks happened to number B (one example with 2, one with 0): the row of one example
    credited to another, one example replaced moved the sum by 1.12 × 2C."""
    edge, mixed = (x.grad_fn, x.output_nr), False
    for _ in range(_FLAT_HOPS):
        node = edge[0]
        if node is None:
            return None
        hit = outs.get(edge) if outs else None
        if hit is not None:  # a captured call's output: its picked rows, the same (the shape kept), or none
            pk = calls[hit[0]].pick if hit[0] >= 0 else None  # (-1: one of the batch's inputs)
            if pk is not None and mixed:
                return _MIXED_PICK
            return pk if pk is not None and tuple(hit[1]) == tuple(x.shape) else None
        name = type(node).__name__
        if name in ("IndexBackward0", "IndexSelectBackward0"):
            # (the index as autograd saved it, read only where no saved-tensor hook packed it: unpacking one would
            # run a checkpoint's segment again, or break a one-shot hook; review of round 48)
            try:
                if name == "IndexBackward0":
                    sizes = tuple(int(n) for n in node._saved_self_sym_sizes)
                    raws = list(node._raw_saved_indices)
                    raw = raws[0] if raws else None
                    if any(r is not None and r.unpack_hook is not None for r in raws):
                        return None
                    rest = [r.data for r in raws[1:] if r is not None]
                else:
                    if int(node._saved_dim) != 0:
                        return None
                    sizes, raw, rest = tuple(int(n) for n in node._saved_self_sym_sizes), node._raw_saved_index, []
                if raw is None or raw.unpack_hook is not None:
                    return None
                i0 = raw.data
            except (AttributeError, RuntimeError, TypeError):
                return None
            if not isinstance(i0, Tensor) or not sizes or sizes[0] % B:  # (dim 0 taken whole; or not the batch's rows)
                return None
            if i0.dtype == torch.bool:
                src = i0.nonzero()[:, 0] if i0.dim() > 0 else None
            elif i0.dim() == 1 and not i0.is_floating_point():
                src = i0
            else:
                return None
            if src is None:
                return None
            k = sizes[0] // B
            src = (torch.where(src < 0, src + sizes[0], src) // k).cpu()  # (each picked row's example)
            if src.numel() == B and bool((src == torch.arange(B)).all()):
                return None  # (each example once, in order)
            # (one row per index entry: a mask, or 1-d indices of one length; h's first dim the batch's, or the batch
            # flattened by a view of the layer's output)
            # (review: with a bool mask, ``h[mask, idx]`` with idx (n, 1) broadcast to (n, n) rows, row r holding every
            # example's elements)
            plain = int(src.numel()) == int(x.shape[0]) and x.dim() >= 2 and all(
                isinstance(t, Tensor) and t.dim() == 1 and t.dtype != torch.bool and t.numel() == src.numel()
                for t in rest)
            j = _picked_from(node, sizes, B, outs, calls) if plain and outs else None
            if j is not None:
                return _pick_of(src.to(torch.long), B, j) if not mixed else _MIXED_PICK
            if src.numel() == B and bool((src.sort().values == torch.arange(B)).all()):
                return None  # (each example once, reordered: the example-order check sees it)
            return ("its input's rows were picked by an index or mask (h[mask], h[idx]) from a tensor not traced to "
                    f"a batch-first layer's output or the batch's input, and are not one row of each example in order (its "
                    f"{int(x.shape[0])} rows came from examples {src.tolist()[:8]}"
                    f"{'...' if src.numel() > 8 else ''}): book-keeping would credit row b to example b. Run the layer "
                    "on every row and pick from its output (head(h)[mask]), or pick from a layer's output (h = "
                    "norm(x); head(h[mask]))")
        if name not in _ROWWISE_NODES:
            return None
        mixed = mixed or not _own_rows_op(node, x.dim())
        nxt = [(n, i) for n, i in node.next_functions if n is not None]
        if len(nxt) != 1:
            return None
        edge = nxt[0]
    return None


def _picked_from(node, sizes: Tuple[int, ...], B: int, outs, calls) -> Optional[int]:
    """The call whose (B, ...) batch-first output the index node picked from (its input of shape ``sizes``),
    through at most ``_FLAT_HOPS`` elementwise ops with one input that has a gradient (the shape kept: no
    broadcast) and views of it as (B·k, ...) rows (a reshape keeps the elements' order: row r is example r // k's);
    -1 where they were picked from one of the batch's float inputs (``_batch_in_graph``; each leaf's first dim is
    the examples', the dim the naive loop and vmap split); None if none."""
    nxt = [(n, i) for n, i in node.next_functions if n is not None]
    if len(nxt) != 1:
        return None
    edge, want = nxt[0], tuple(sizes)
    for _ in range(_FLAT_HOPS):
        hit = outs.get(edge)
        if hit is not None:
            j, shape = hit
            if j < 0:  # one of the batch's float inputs ((B, ...): its first dim the examples', as the oracle's)
                return j if tuple(shape) == want and want[0] == B else None
            c = calls[j]
            # (a (B, B, ...) call that may be time-major, ``retry`` "time", is read batch-first unless the probe says
            # otherwise: then the capture runs again, and this pick is refused there)
            if tuple(shape) != want or want[0] != B or c.rows or c.bcast or c.lift or c.bdim \
                    or c.retry not in ("", "time") or c.pick is not None:
                return None
            return j
        node = edge[0]
        name = type(node).__name__
        if name in ("ViewBackward0", "UnsafeViewBackward0"):
            try:
                before = tuple(int(n) for n in node._saved_self_sym_sizes)
            except (AttributeError, RuntimeError, TypeError):
                return None
            if not before or before[0] != B or want[0] % B or math.prod(before) != math.prod(want):
                return None
            want = before
        elif not _own_rows_op(node, len(want)):
            return None
        nxt = [(n, i) for n, i in node.next_functions if n is not None]
        if len(nxt) != 1:
            return None
        edge = nxt[0]
    return None


def _check_picks(calls: Sequence[_Call], ruled, real_dims, fallback: Dict[str, str], B: int) -> None:
    """A call on picked rows (``_Call.pick``) stays on its rules only where the call it picked them from read its
    first dim as the batch, confirmed by the batch-dimension probe (``_check_batch_dims`` sent none of that call's
    module's parameters to the fallback); else its parameters fall back too, naming why."""
    for c in calls:
        if c.pick is None or c.pick.src < 0:  # (picked from the batch's input: nothing to confirm)
            continue
        s = calls[c.pick.src]
        local = ruled[s.module][2]
        if real_dims[s.mname][s.k] != B or any(n in fallback for n in local.values()):
            for n in ruled[c.module][2].values():
                fallback.setdefault(n, f"{type(c.module).__name__} ({c.mname}): its input's rows were picked by an "
                                       f"index or mask from {s.mname}'s output, whose batch dim was not confirmed "
                                       "(its parameters take the exact fallback)")


def _time_major(rule: Rule, module: nn.Module, args, kwargs, output, B: int) -> bool:
    """Whether a call reads as time-major, batch in dim 1: a row-wise rule (``Rule.rowwise``) whose
    only tensor argument x is (T, B, ...) (T = B too: the caller asks the probe) and at least two leading (row) dims (ids: all
    dims; float input: all but the features, or the normalised dims), and an output (T, B, ...).
    Torch's ``batch_first=False`` layout (nn.TransformerEncoder's default, time-major RNN models).
    Moving dim 1 to the front of input, output and output gradient is exact for a layer that acts
    on each row alone, if dim 1 is the batch: the batch-dimension probe confirms that (dim 1
    follows the probe's size, dim 0 does not), else the layer falls back."""
    if not getattr(rule, "rowwise", False) or not isinstance(output, Tensor) or output.dim() < 2:
        return False
    ts = [x for x in list(args) + list(kwargs.values()) if isinstance(x, Tensor)]
    if len(ts) != 1:
        return False
    x = ts[0]
    ids = not x.is_floating_point() and not x.is_complex()
    lead = x.dim() - (0 if ids else max(1, _normalised_dims(module)))
    return (lead >= 2 and x.shape[1] == B and tuple(output.shape[:2]) == tuple(x.shape[:2])
            and _dim1_steps_examples(x, B))


def _dim1_steps_examples(x: Tensor, B: int) -> bool:
    """False when x is a view of a contiguous batch-first base ((B, ...), dim 0 the examples) whose
    index along dim 1 is not the base's example: a reshape (B, T, d) -> (T, B, d) (a view, not a
    transpose; the probe sees only sizes, and dim 1 follows the batch's) puts example (t·B + b) // T
    in row (t, b) (review, round 36: norms 14 % off, removing an example moved the sum by 1.3 C).
    In a transpose dim 1 steps through the base's dim 0, and the other dims stay within one example."""
    base = x._base if x._is_view() else None
    if base is None or base.dim() < 1 or int(base.shape[0]) != B or not base.is_contiguous() \
            or x.dim() < 2 or int(x.shape[0]) == B or x.stride(1) == 0:
        # (not a view of batch-first memory; or T = B, where a (T, B, ...) base has B rows too: the
        # probe, whose size is not T, decides; or dim 1 broadcast: no example's data in it)
        return True
    row = base.stride(0)
    start = x.storage_offset() - base.storage_offset()
    span = sum((n - 1) * st for k, (n, st) in enumerate(zip(x.shape, x.stride())) if k != 1 and n > 1)
    return x.stride(1) == row and 0 <= start < row and start + span < row


def _unflatten(c: "_Call", B: int, args, kwargs, output, g):
    """A flattened call (``c.rows``) as its rule reads it: every (B·rows, ...) tensor as (B, rows, ...);
    a time-major one (``c.bdim``): its input, output and output gradient (T, B, ...) as (B, T, ...)."""
    if c.bdim:
        def m(x):
            return x.movedim(c.bdim, 0) if isinstance(x, Tensor) else x

        return tuple(m(x) for x in args), {k: m(x) for k, x in kwargs.items()}, m(output), m(g)
    if c.pick is not None:
        pk = c.pick

        def put(x):  # (n, ...) -> (B, K, ...): row r at (its example, its rank among that example's rows)
            if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[0] != pk.n:
                return x
            out = x.new_zeros((B * pk.K,) + tuple(x.shape[1:]))
            return out.index_copy_(0, pk.dest.to(x.device), x).view(B, pk.K, *x.shape[1:])

        return tuple(put(x) for x in args), {k: put(x) for k, x in kwargs.items()}, put(output), put(g)
    if not c.rows:
        return args, kwargs, output, g
    N = B * c.rows

    def f(x):
        return x.reshape(B, c.rows, *x.shape[1:]) if isinstance(x, Tensor) and x.dim() >= 1 and x.shape[0] == N else x

    return tuple(f(x) for x in args), {k: f(x) for k, x in kwargs.items()}, f(output), f(g)


@dataclass
class _Collected:
    losses: Tensor
    uses: Dict[str, List[Use]]  # canonical name -> uses (ruled params only)
    fallback: Dict[str, str]  # canonical name -> reason it is computed by vmap
    owner: Dict[str, List[Tuple[str, nn.Module]]] = field(default_factory=dict)
    # parameters the example-order check found zero but for rounding, or negligible, whose gradient in
    # this step is not within its own triangle bound: kept on their rules only if negligible against
    # every example's norm over the passed parameters of their clip group (``_settle_pending``), with
    # the fallback reason otherwise (with the step's squared norms, (B,)); and the parameters that passed the check
    pending: Dict[str, Tuple[str, Tensor]] = field(default_factory=dict)
    passed: Set[str] = field(default_factory=set)
    reached: bool = True  # (whether the losses required grad: some ruled parameter reached them)
    rng: Any = None  # the random streams as the capture's forward began (``_rng_now``; ``_rng_replay``)
    attrs: Any = None  # the modules' attributes then, for a forward that changes them (``_attrs_replayed``)
    # a parameter the example-order check had stopped asking about (no gradient in its runs of this batch shape,
    # ORDER_RETRIES times), or was never asked about, has one in this step: asked on this batch (``_collect_once``,
    # ``_rearm``)
    recheck: bool = False


def _model_layout(model: nn.Module, params: Params, registry: RuleRegistry, overrides: Mapping[str, str]):
    """Which modules get their forward wrapped, with their (local name -> canonical name) trained params.

    One walk over the modules: a parameter's canonical name is the first name it is met under,
    as in ``ParamIndex`` (named_modules visits modules in the same order with or without
    duplicates, so the first sighting is the same)."""
    first: Dict[int, str] = {}  # id(parameter) -> canonical name
    ruled: Dict[nn.Module, Tuple[str, Rule, Dict[str, str]]] = {}
    fallback: Dict[str, str] = {}
    owner: Dict[str, List[Tuple[str, nn.Module]]] = {}
    unruled: Dict[str, str] = {}  # parameters held by a module without a rule -> that reason
    for mname, m in model.named_modules(remove_duplicate=True):
        local = {}
        for pn, p in m._parameters.items():
            if p is None:
                continue
            c = first.setdefault(id(p), f"{mname}.{pn}" if mname else pn)
            if c in params:
                local[pn] = c
                owner.setdefault(c, []).append((mname, m))
        if not local:
            continue
        rule = registry.lookup(m)
        reason = None
        if rule is None:
            # decided after the walk: a parameter that a ruled module also holds (e.g. BERT's MLM
            # decoder bias, tied to its head's own ``bias``) is captured there, and a use of it in
            # this module's forward reaches its leaf and is found ("also used outside its layer's
            # forward"); one held by no ruled module falls back for this reason
            for c in local.values():
                unruled.setdefault(c, f"no rule for {type(m).__name__} ({mname or '<root>'})")
            continue
        elif "forward" in m.__dict__:
            # e.g. accelerate's hooks, functools.partial: it may change the layer's input or output,
            # which the rule, computing the layer's own forward, would not know about
            reason = f"{type(m).__name__} ({mname}) has its own instance-level forward (not its class's)"
        else:
            reason = rule.supports(m)
            if reason is not None:
                reason = f"{type(m).__name__} ({mname}): {reason}"
        forced = _override(overrides, mname, m)
        if reason is None and forced == "vmap":
            reason = "route override"
        if reason is not None:
            for c in local.values():
                fallback.setdefault(c, reason)
            continue
        ruled[m] = (mname, rule, local)
    held = {c for (_, _, local) in ruled.values() for c in local.values()}
    for c, reason in unruled.items():
        if c not in held:
            fallback.setdefault(c, reason)
    for c in params:
        if c not in owner:
            fallback.setdefault(c, "not owned by a module")  # cannot happen for nn.Module params
        o = overrides.get(c)
        if o == "vmap":
            fallback.setdefault(c, "route override")
    return ruled, fallback, owner


_REENTRANT = (
    "{} with use_reentrant=True (reentrant activation checkpointing), which book-keeping cannot capture: "
    "the checkpointed layers run without gradients in the forward. Use use_reentrant=False (Hugging "
    "Face's default; model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
    "False}})), or turn checkpointing off for the DP step."
)


def _no_checkpoint_early_stop():
    try:
        from torch.utils.checkpoint import set_checkpoint_early_stop

        return set_checkpoint_early_stop(False)
    except ImportError:  # pragma: no cover - older torch: no early stop to turn off
        return contextlib.nullcontext()


class _Scope(nn.Module):
    """``forward(fn) = fn()`` with ``m`` (the loss module) as a submodule, so that ``functional_call``
    keeps the parameters swapped in for everything ``fn`` runs: the forward *and* the backward."""

    def __init__(self, loss_module: LossModule):
        super().__init__()
        self.m = loss_module

    def forward(self, fn):  # type: ignore[override]
        return fn()


_NOT_REACHED = object()


class _Wrapped:
    """A ruled layer's forward while the engine captures (an instance attribute of the layer). A
    deep copy of the layer made meanwhile (e.g. a frozen target network built lazily in the forward)
    gets its class's forward back, bound to the copy, not this capture's wrapper of the original."""

    __slots__ = ("fn", "module", "rule")

    def __init__(self, fn, module: nn.Module, rule: Optional[Rule] = None):
        # ``rule``: the rule whose forward this is (read by capture adapters that hand a ruled layer
        # per-example input only while that layer's rule runs it, e.g. ``rules/deberta_v1.py``)
        self.fn, self.module, self.rule = fn, module, rule

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        new = memo.get(id(self.module))
        if new is None:  # copied on its own, not as part of its module: the same capture
            return self
        return types.MethodType(type(new).forward, new)

    def __reduce__(self):
        raise TypeError("a layer cannot be pickled while pdpsgd's book-keeping step is capturing its forward")


@dataclass
class _Early:
    call: _Call
    got: Any = _NOT_REACHED  # the rule's uses, once its output gradient has been seen


def _eager_calls(calls: List[_Call], leaves: List[Tensor]) -> Dict[int, _Early]:
    """Calls whose (small, explicit) uses are taken *inside* the backward (``Rule.eager``): a
    pre-hook on the output's node reads g as the engine reaches it, the rule runs there, and the
    layer's input and g are released at once instead of living until the whole backward is done
    (e.g. every LayerNorm's input and output gradient). Only calls whose node lies on a path to
    another requested gradient qualify — the engine runs exactly those nodes; the others are
    requested as before."""
    cand = [i for i, c in enumerate(calls) if c.edge is not None and getattr(c.rule, "eager", False)]
    if not cand:
        return {}
    idx = set(cand)
    goals = set()  # nodes whose gradients autograd.grad is asked for (hold them: stable identity)
    for i, c in enumerate(calls):
        if i not in idx:
            for t in c.targets:
                if not isinstance(t, Tensor):
                    goals.add(t.node)
                elif t.requires_grad:
                    goals.add(_gradient_edge(t).node)
    for t in leaves:
        goals.add(_gradient_edge(t).node)
    dead: Set[Any] = set()  # nodes proven to reach no goal

    def reaches(node) -> bool:
        # the node itself being requested is not enough: the engine captures a requested gradient
        # without running the node, so its pre-hook would not fire
        stack, seen = [node], {node}
        while stack:
            for nxt, _ in stack.pop().next_functions:
                if nxt is None or nxt in seen or nxt in dead:
                    continue
                if nxt in goals:
                    return True
                seen.add(nxt)
                stack.append(nxt)
        dead.update(seen)
        return False

    return {i: _Early(calls[i]) for i in cand if reaches(calls[i].edge.node)}


_CREATE_GRAPH = ("the loss takes gradients inside itself (torch.autograd.grad / backward with create_graph=True, "
                 "e.g. a gradient penalty, score matching, torch.func.grad): the capture cannot follow its "
                 "parameters' second-order terms")


_FORWARD_AD = ("it ran under forward-mode AD (a torch.autograd.forward_ad dual level, torch.func.jvp): a "
               "tangent's path to its weight (W·v) is no term of the captured aᵀg")


class _Watched:
    def __init__(self):
        self.create_graph = False
        self.modified: Set[Tuple[Any, int]] = set()  # (grad_fn, output_nr) of non-leaf tensors whose hook changed g
        self.leaf_hooks: Set[int] = set()  # ids of leaf tensors given a hook (a ruled parameter's leaf: fallback)


_WATCH: contextvars.ContextVar = contextvars.ContextVar("pdpsgd_watch_autograd", default=None)
_WATCH_LOCK = threading.Lock()
_WATCH_STATE: Dict[str, Any] = {"depth": 0, "orig": None, "active": []}


def _watcher() -> Optional[_Watched]:
    """This context's capture; in a thread of the model's own (a pool its forward uses, which does not
    inherit the context) the one capture running, if only one is (review, round 33)."""
    w = _WATCH.get()
    if w is None:
        active = _WATCH_STATE["active"]
        w = active[0] if len(active) == 1 else None
    return w


def _watch_register_hook(self, hook):
    w = _watcher()
    if w is not None and self.grad_fn is None:
        w.leaf_hooks.add(id(self))
    elif w is not None:
        key, inner = (self.grad_fn, self.output_nr), hook

        def hook(g):  # noqa: F811 - the user's hook, observed: did it change the gradient?
            r = inner(g)
            if r is not None and r is not g:  # (returning g itself changes nothing)
                w.modified.add(key)
            return r

    return _WATCH_STATE["orig"][0](self, hook)


def _watch_engine(t_outputs, *args, **kwargs):
    """torch's one Python entry to the autograd engine (``torch.autograd.grad`` / ``backward`` /
    ``Tensor.backward`` however imported: ``from torch.autograd import grad`` binds the function, not
    this name, which it looks up when called). ``create_graph`` is its fourth argument."""
    w = _watcher()
    if w is not None and (kwargs.get("create_graph", False) or (len(args) > 2 and args[2])):
        w.create_graph = True
    return _WATCH_STATE["orig"][1](t_outputs, *args, **kwargs)


def _watch_grad(*args, **kwargs):  # (torch without ``_engine_run_backward``)
    w = _watcher()
    if w is not None and (kwargs.get("create_graph", False) or (len(args) > 4 and args[4])):
        w.create_graph = True
    return _WATCH_STATE["orig"][1](*args, **kwargs)


def _watch_backward(*args, **kwargs):  # (torch without ``_engine_run_backward``)
    w = _watcher()
    if w is not None and (kwargs.get("create_graph", False) or (len(args) > 3 and args[3])):
        w.create_graph = True
    return _WATCH_STATE["orig"][2](*args, **kwargs)


def _dual_level_active() -> bool:
    fwad = getattr(torch.autograd, "forward_ad", None)
    return getattr(fwad, "_current_level", -1) >= 0


_ENGINE = hasattr(torch.autograd, "_engine_run_backward") and hasattr(torch.autograd.graph, "_engine_run_backward")


def _install_watch() -> Tuple[Any, ...]:
    if _ENGINE:
        orig = (torch.Tensor.register_hook, torch.autograd._engine_run_backward, None)
        torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward = _watch_engine
    else:
        orig = (torch.Tensor.register_hook, torch.autograd.grad, torch.autograd.backward)
        torch.autograd.grad, torch.autograd.backward = _watch_grad, _watch_backward
    torch.Tensor.register_hook = _watch_register_hook
    return orig


def _uninstall_watch(orig: Tuple[Any, ...]) -> None:
    torch.Tensor.register_hook = orig[0]
    if _ENGINE:
        torch.autograd._engine_run_backward = torch.autograd.graph._engine_run_backward = orig[1]
    else:
        torch.autograd.grad, torch.autograd.backward = orig[1], orig[2]


@contextlib.contextmanager
def _watch_autograd() -> Iterator[_Watched]:
    """While the capture's forward runs (in this thread / context): records the non-leaf tensors
    whose gradient hook (``Tensor.register_hook``) *changes* their gradient (when the backward runs
    it) and whether a gradient is taken with ``create_graph=True``, which the capture cannot follow
    (review, round 33: a hook on a layer's output scaled g after the engine read it; a gradient
    penalty's second-order terms were dropped; both silently. Round 34: the engine's one Python
    entry is watched, so ``from torch.autograd import grad`` is seen too). The functions are
    wrapped while any capture runs (reference-counted, under a lock); the wrappers record only for
    the capture of their own context, so other threads are unaffected."""
    w = _Watched()
    with _WATCH_LOCK:
        if _WATCH_STATE["depth"] == 0:
            _WATCH_STATE["orig"] = _install_watch()
        _WATCH_STATE["depth"] += 1
        _WATCH_STATE["active"].append(w)
    token = _WATCH.set(w)
    try:
        yield w
    finally:
        try:
            _WATCH.reset(token)
        except ValueError:  # (reset from another context: the value is this context's to drop)
            _WATCH.set(None)
        with _WATCH_LOCK:
            _WATCH_STATE["active"].remove(w)
            _WATCH_STATE["depth"] -= 1
            if _WATCH_STATE["depth"] == 0:
                _uninstall_watch(_WATCH_STATE["orig"])
                _WATCH_STATE["orig"] = None


def _edge_key(c: "_Call") -> Optional[Tuple[Any, int]]:
    if c.edge is not None:
        return (c.edge.node, c.edge.output_nr)
    if c.output is not None and c.output.grad_fn is not None:
        return (c.output.grad_fn, c.output.output_nr)
    return None


def _eager_hook(st: _Early, B: int):
    c = st.call
    nr = c.edge.output_nr

    def hook(grad_outputs):
        g = grad_outputs[nr]
        if g is not None and c.gshape is not None:
            g = g.view(c.gshape)
        if g is not None:
            args = tuple(x.detach() if isinstance(x, Tensor) else x for x in c.args)
            kwargs = {k: (x.detach() if isinstance(x, Tensor) else x) for k, x in c.kwargs.items()}
            args, kwargs, _, g = _unflatten(c, B, args, kwargs, None, g.detach())
            st.got = _mark_src(c.rule.uses(c.module, args, kwargs, None, g, B), args, kwargs, g, c.amp)
            del args, kwargs
        c.args, c.kwargs = (), {}  # the layer's input is no longer needed here
        return None

    return c.edge.node.register_prehook(hook)


def _override(overrides: Mapping[str, str], mname: str, m: nn.Module) -> Optional[str]:
    return overrides.get(mname) or overrides.get(type(m).__name__)


# The rules split a layer's factors by example along the first dimension of its input, taken to be
# the batch when it has size B. A first dimension that only happens to equal B (a time-major layer
# with T == B, a layer applied to a (V, d) table with V == B) would credit rows to the wrong
# examples, and a padded example would leak into the sum. So the first dimensions are checked
# against a probe: a no-grad forward of PROBE_B (or PROBE_B + 1 when B == PROBE_B) examples of the
# batch, where a batch dimension follows the probe's size and a fixed one does not. A call whose
# dimension did not follow goes to the exact vmap fallback. The probe is a function of the model's
# code and the batch's shapes; ``DPStep`` memoises it per shape signature and train/eval mode
# (``probe_memo``). Not covered: a layer whose row count depends on tensor *values* (tokens
# selected by a mask: mixture-of-experts routing, unpadded/varlen packing), whose count can equal
# B in the step and PROBE_B in the probe by coincidence; book-keeping does not support such layers
# (vmap refuses their data-dependent shapes outright), except rows picked from a captured layer's
# batch-first output by an index autograd saved (``_picked_rows``: credited by that index, not
# compared with the probe; their source call is). The probe calls ``loss_fn`` once more.
PROBE_B = 2
PROBE_MEMO_MAX = 64
# Each call is matched to the probe's by its call site too, not by its count alone (``_call_site``;
# round 46: a layer applied at one of two sites chosen at random, to the batch or to a (V, d) table
# with V == B, had the probe's call on the batch confirm the capture's call on the table). A forward
# that draws random numbers is probed on PROBE_DRAWS more seeds on its first step, and a call with no
# probe record from its own site (LayerDrop skipped its layer in the probes) on up to PROBE_RETRIES
# more per step, PROBE_MAX probes in all per batch shape; a call is confirmed only if every probe record from
# the same sites, on the batch's path (``_shape_agrees``), confirms it; one still unconfirmed gets a probe of the
# whole batch, once per path (a forward whose calls or sizes depend on the batch's values; round 50).
PROBE_DRAWS = 2
PROBE_RETRIES = 3
PROBE_MAX = 8


# id(code) -> (code, 0 kept, 1 skipped, 2 the end, {PRECALL offset: its CALL's}) (``_call_site``)
_SITE_KIND: Dict[int, Tuple[types.CodeType, int, Dict[int, int]]] = {}
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TORCH_MODULES_DIR = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _precalls(code: types.CodeType) -> Dict[int, int]:
    """CPython 3.11's PRECALL offsets -> the offset of the CALL that follows: a frame calling a builtin
    that calls back into Python (``sum(head(h) for head in heads)``) stands at the CALL until the code
    is specialised, then at the PRECALL (its specialised form makes the call itself; review, round 46:
    a probe from before and captures from after never matched). Empty on other versions."""
    if sys.version_info[:2] != (3, 11):
        return {}
    import dis

    ins = list(dis.get_instructions(code))
    return {a.offset: b.offset for a, b in zip(ins, ins[1:]) if a.opname == "PRECALL"}


def _site_kind(code: types.CodeType) -> Tuple[types.CodeType, int, Dict[int, int]]:
    got = _SITE_KIND.get(id(code))  # (by id, the code object kept beside: a code object's hash reads its contents)
    if got is None or got[0] is not code:
        f = code.co_filename
        f = os.path.abspath(f) if not f.startswith("<") else f  # (cached per code object)
        if code is LossModule.forward.__code__:
            kind = 2
        elif f.startswith(_OWN_DIR) or (f.startswith(_TORCH_DIR) and not (
                f.startswith(_TORCH_MODULES_DIR) and os.path.basename(f) != "module.py")):
            # pdpsgd's own code (the capture's wrappers, the probe's hooks, the checks' function modes,
            # the rules' forwards: a function of the call) and torch's machinery (Module.__call__,
            # checkpoint, autograd functions, functional_call, function modes): not the model's code,
            # and not the same in the capture and the probe. torch's layers (nn/modules: a Sequential,
            # a TransformerEncoder, nn.MultiheadAttention) are the model's.
            kind = 1
        else:
            kind = 0
        if len(_SITE_KIND) > 65536:  # (code made at run time, exec'd or compiled, comes and goes)
            _SITE_KIND.clear()
        got = _SITE_KIND[id(code)] = (code, kind, _precalls(code) if kind == 0 else {})
    return got


def _call_site() -> Tuple[Tuple[types.CodeType, int], ...]:
    """Where the model called the layer now running: (code, instruction offset) of each frame of
    the model's own code (and of torch's layers) between the loss's forward and this call, innermost
    first. Two calls of one layer from different places (or on different paths) differ, also on one
    line; the capture and the probe calling it from one place agree."""
    out, kinds = [], _SITE_KIND
    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        got = kinds.get(id(code))
        if got is None or got[0] is not code:
            got = _site_kind(code)
        if got[1] == 2:
            break
        if got[1] == 0:
            out.append((code, got[2].get(f.f_lasti, f.f_lasti) if got[2] else f.f_lasti))
        f = f.f_back
    return tuple(out)


def _first_tensor(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[Tensor]:
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, Tensor):
            return x
    return None


def _lift_first(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """args, kwargs with their first tensor given a leading dimension of 1 (a view)."""
    x = _first_tensor(args, kwargs)
    args = tuple(a.unsqueeze(0) if a is x else a for a in args)
    kwargs = {k: (v.unsqueeze(0) if v is x else v) for k, v in kwargs.items()}
    return args, kwargs


def _first_dim(args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[int]:
    x = _first_tensor(args, kwargs)
    return int(x.shape[0]) if x is not None and x.dim() > 0 else None


@contextlib.contextmanager
def _own_rng(params: Params, seed: Optional[int] = None, *, model: nn.Module) -> Iterator[None]:
    """The extra forwards of the checks and probes draw from forked random streams (CPU, the
    parameters' CUDA devices, Python's ``random`` and numpy's global one since round 38, the
    generators ``model`` holds since round 47 (``_model_rngs``); seeded with ``seed`` if given): the
    user's streams, and so the step's noise, are as without them. The modules' plain attributes (a
    counter the forward advances) are put back after the block too (round 47): every extra forward
    starts from the state the step's own capture starts from."""
    state = _CHECK_REPLAY.get()
    if state is not None:  # (a step's new path confirmed and checked: from the state its capture began in)
        with _rng_replay(params, state), _attrs_kept(model):
            yield
        return
    devs = _rng_devices(params)
    with torch.random.fork_rng(devices=devs), _host_rngs(seed=seed), _held_forked(_model_rngs(model), seed=seed), \
            _attrs_kept(model):
        if seed is not None:  # (only the forked streams)
            torch.default_generator.manual_seed(seed)
            for d in devs:
                torch.cuda.default_generators[d].manual_seed(seed)
        yield


def _streams(params: Params, model: nn.Module) -> Tuple[Any, ...]:
    """The random streams a forward on the parameters' devices may draw from, now (``_rng_state`` of
    each device, the CPU's when there are no parameters; with the generators ``model`` holds):
    compared before and after a check's forward."""
    devices = sorted({p.device for p in params.values()}, key=str) or [torch.device("cpu")]
    held = _model_rngs(model)
    return tuple(_rng_state(d, held) for d in devices)


def _drew(before: Tuple[Any, ...], after: Tuple[Any, ...]) -> bool:
    return not all(_same_state(a, b) for a, b in zip(before, after))


def _rng_devices(params: Params) -> List[int]:
    return sorted({p.device.index or 0 for p in params.values() if p.device.type == "cuda"})


def _rng_now(params: Params, model: nn.Module) -> Tuple[Tensor, Dict[int, Tensor], Any, Any, _HeldStates]:
    """The CPU and the parameters' CUDA random states, Python's ``random`` and numpy's legacy global
    one (if imported), and the generators ``model`` holds (``_model_rngs``): what the capture's
    forward draws from (round 38: Python's and numpy's too; a LayerDrop on ``random.random()`` gave
    the fallback the other branch, 1.27 off; round 47: held generators, the same)."""
    np_ = sys.modules.get("numpy")
    return (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in _rng_devices(params)},
            random.getstate(), np_.random.get_state() if np_ is not None else None,
            _HeldStates.of(_model_rngs(model)))


@contextlib.contextmanager
def _host_rngs(state: Optional[Tuple[Any, Any]] = None, seed: Optional[int] = None) -> Iterator[None]:
    """Python's ``random`` and numpy's legacy global state forked for the block: set to ``state``
    (``_rng_now``'s last two) or seeded with ``seed``, if given; the caller's put back after."""
    np_ = sys.modules.get("numpy")
    saved = (random.getstate(), np_.random.get_state() if np_ is not None else None)
    try:
        if state is not None:
            random.setstate(state[0])
            if np_ is not None and state[1] is not None:
                np_.random.set_state(state[1])
        elif seed is not None:
            random.seed(seed)
            if np_ is not None:
                np_.random.seed(seed % 2 ** 32)
        yield
    finally:
        random.setstate(saved[0])
        if np_ is not None and saved[1] is not None:
            np_.random.set_state(saved[1])


@contextlib.contextmanager
def _rng_replay(params: Params, state: Optional[Tuple[Tensor, Dict[int, Tensor]]]) -> Iterator[None]:
    """The exact fallback's forwards draw what the capture's forward drew (``state``: ``_rng_now``
    as it began), in forked streams: in training mode its dropout masks are the capture's, so an
    example's gradient is that of one network, its ruled and its fallback parameters alike (review,
    round 34: the fallback drew new masks, 1.27 off the batch's gradient for MPNet's relative bias).
    vmap's per-example draws ("different") are the batched op's, in order, while the fallback runs
    the batch in one vmap chunk and its random ops are the forward's (``nn.Dropout``: yes; kernels
    with their own sampling, e.g. fused attention dropout, may draw differently). The caller's
    streams go on from where the capture left them."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=_rng_devices(params)), _host_rngs(state[2:4]), \
            _held_forked(state[4].rngs, state=state[4]):
        torch.set_rng_state(state[0])
        for d, st in state[1].items():
            torch.cuda.set_rng_state(st, d)
        yield


# Review, round 47: a forward whose path depends on state the model keeps (a counter attribute, a
# generator it holds) took, at the capture of a later step, a path that the batch shape's memoised
# probe had not seen: a layer given, at the same call site, a frozen table of B rows instead of the
# batch had the table's rows credited to examples (up to 4.2 C between neighbours, a counter choosing
# every 16th forward). Such a forward (``_Probed.stateful``: a probe saw it change a module's plain
# attributes or draw from a held generator) is probed again at every step, from the state its
# capture began in (``_attrs_replayed``, ``_rng_replay``), and its exact fallback runs from there too.
# (not kept: nn.Module's own tables, which ``preserve_module_state`` keeps; the instance ``forward`` the
# engine sets while it captures or probes; the mode, which the checks set themselves)
_UNKEPT = frozenset({"_parameters", "_buffers", "_modules", "forward", "training"})
_ABSENT = object()


def _module_attrs(model: nn.Module) -> List[Tuple[nn.Module, Dict[str, Any]]]:
    """Each module's own attributes (``vars``, shallow, but for ``_UNKEPT``): for ``_restore_attrs``."""
    return [(m, {k: v for k, v in vars(m).items() if k not in _UNKEPT}) for m in model.modules()]


def _restore_attrs(saved: List[Tuple[nn.Module, Dict[str, Any]]]) -> None:
    """Each module's attributes as ``_module_attrs`` found them: one a forward set or replaced (a lazily
    built cache, made float32 by the check's float32 run; a counter) is undone, a cache and the key it was
    made for alike (review of round 47: putting back the plain ones alone left a tensor cache built for
    the probe's size beside the batch size it was keyed by); one mutated in place is not."""
    for m, d in saved:
        cur = vars(m)
        for k in [k for k in cur if k not in d and k not in _UNKEPT]:
            del cur[k]
        for k, v in d.items():
            if cur.get(k, _ABSENT) is not v:
                cur[k] = v


def _settings_changed(model: nn.Module, a: List[Dict[str, Any]], b: List[Dict[str, Any]]) -> List[str]:
    """The plain attributes (``<module type>.<name>``) that differ between two ``model_settings``."""
    mods = list(model.modules())
    if not len(a) == len(b) == len(mods):
        return ["(the model's modules)"]
    return [f"{type(m).__name__}.{k}" for m, da, db in zip(mods, a, b) if da != db
            for k in sorted(da.keys() | db.keys()) if da.get(k, _ABSENT) is not db.get(k, _ABSENT)
            and (k not in da or k not in db or da[k] != db[k])]


@contextlib.contextmanager
def _attrs_kept(model: nn.Module) -> Iterator[None]:
    """The modules' attributes as the block found them are put back after it."""
    now = _module_attrs(model)
    try:
        yield
    finally:
        _restore_attrs(now)


@contextlib.contextmanager
def _attrs_replayed(model: nn.Module, snap: Optional[List[Tuple[nn.Module, Dict[str, Any]]]]) -> Iterator[None]:
    """The block runs with the modules' attributes as in ``snap`` (a ``_module_attrs``; None: as they
    are); those the block found are put back after."""
    if snap is None:
        yield
        return
    with _attrs_kept(model):
        _restore_attrs(snap)
        yield


def _side_collect(loss_module, params, constants, batch, registry, overrides, probe_memo, weights: Tensor,
                  no_expand=None, seed: Optional[int] = None, own_mode: bool = False) -> "_Collected":
    """A check's capture: module flags in eval mode (dropout masks would differ between its runs; as
    they are, with dropout at rate 0, with ``own_mode``), forked random streams, losses weighted, no
    nested checks."""
    with _EvalFlags(loss_module.model, keep=own_mode), _own_rng(params, seed, model=loss_module.model):
        return _collect(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast=False,
                        loss_weights=weights, no_expand=no_expand, check_order=False)


def _memo_put(memo: Optional[Dict], key, value) -> None:
    """Store in the probe memo; when full, the oldest entries go (not all of them)."""
    if memo is None:
        return
    if key in memo:
        memo[key] = value
        return
    while len(memo) >= PROBE_MEMO_MAX:
        memo.pop(next(iter(memo)))
    memo[key] = value


class _EvalFlags:
    """Every module's ``training`` flag False for the block, then restored, by assignment: no module's
    own ``train()`` override runs (loralib's merges its LoRA weights into the frozen one on eval).
    ``keep``: the flags stay as they are and torch's dropouts run at rate 0 (``DropoutOff``: the
    example-order check of a model whose own mode draws nothing else, ``_draws_nothing``)."""

    def __init__(self, model: nn.Module, keep: bool = False):
        self.modes = [(m, m.training) for m in model.modules()]
        self.keep = keep
        self.dropout_off = DropoutOff() if keep else None

    def __enter__(self):
        if self.dropout_off is not None:
            self.dropout_off.__enter__()
            return
        for m, _ in self.modes:
            m.training = False

    def __exit__(self, *exc):
        if self.dropout_off is not None:
            self.dropout_off.__exit__(*exc)
        for m, mode in self.modes:
            m.training = mode
        return False




# Set (for the duration of one capture, its checks and probes included) when a capture with the
# registry's adapters failed and runs again without them (see ``_collect``).
_ADAPTERS_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("pdpsgd_adapters_off", default=False)
# While a step's new path is confirmed (``_hold_to_paths``): the random state the extra forwards start from
# (the capture's, ``_rng_now``; instead of their seeds), and the paths their captures take (``_path_of``).
_CHECK_REPLAY: contextvars.ContextVar[Any] = contextvars.ContextVar("pdpsgd_check_replay", default=None)
_CHECK_PATHS: contextvars.ContextVar[Optional[List]] = contextvars.ContextVar("pdpsgd_check_paths", default=None)


def _adapters_apply(model: nn.Module, registry: RuleRegistry) -> bool:
    """Whether some module of the model would get a ``CaptureAdapter`` (and adapters are on)."""
    return (not _ADAPTERS_OFF.get() and registry.has_adapters()
            and any(registry.adapter_for(m) is not None for m in model.modules()))


@contextlib.contextmanager
def _adapted(model: nn.Module, registry: RuleRegistry, B: int) -> Iterator[None]:
    """The registry's ``CaptureAdapter`` methods installed (instance attributes) on the modules they
    accept, for a capture or probe of B examples; removed after, also on error. A module that has
    its own instance attribute of that name already is left as it is. Nothing while a capture runs
    without adapters (``_ADAPTERS_OFF``)."""
    done: List[Tuple[nn.Module, str]] = []
    if registry.has_adapters() and not _ADAPTERS_OFF.get():
        for m in model.modules():
            a = registry.adapter_for(m)
            if a is not None and a.method not in m.__dict__:
                m.__dict__[a.method] = a.wrap(m, B)
                done.append((m, a.method))
    try:
        yield
    finally:
        for m, name in done:
            m.__dict__.pop(name, None)


def _out_dim(output: Any) -> Optional[int]:
    return int(output.shape[0]) if isinstance(output, Tensor) and output.dim() > 0 else None


def _probe_key(batch: Batch, B: int, training: bool):
    leaves, spec = tree_flatten(batch)
    return (B, training, str(spec), tuple((tuple(x.shape), x.dtype, x.device.type) if isinstance(x, Tensor)
                                          else _leaf_sig(x) for x in leaves))


def _batch_in_graph(batch: Batch, B: int, memo: Optional[Dict] = None) -> Batch:
    """The batch as a capture's forward takes it: each floating tensor with the batch's rows (B in its first
    two dims: time-major too) that needs no gradient as itself times a scalar 1 that needs one (the same values,
    signed zeros included; one node), so that what the forward or ``loss_fn`` computes from the raw inputs
    leaves nodes in the autograd graph, which the path hold reads (``_path_of``): a sum over the batch's inputs
    or input mixup in ``loss_fn`` chosen by a random draw or hidden state left none, and a step that took it
    looked like a clean one (review of round 48: 2.44 × 2C, mixup 1.30 × 2C). No gradient is asked for there
    (the backward stops at the captured layers' outputs and the parameters). Integer inputs (token ids) stay as
    they are: mixing them leaves no node still. So do masks (shaped as one, ``_mask_shaped``, and every value 0, 1,
    -inf or the dtype's lowest, as Hugging Face's additive ones): a mask that needs a gradient turns
    scaled_dot_product_attention from its
    fused kernel to the plain one (slower, and memory ∝ T² per head). Whether a tensor is a mask is read on the
    host once per batch shape (``memo``; the checks' captures of the step take the same), not at every step."""
    if B < 2 or _INPUTS_OUT.get():
        return batch
    leaves, spec = tree_flatten(batch)
    out = []
    for i, x in enumerate(leaves):
        if isinstance(x, Tensor) and x.is_floating_point() and not x.requires_grad and x.dim() >= 1 \
                and B in tuple(x.shape[:2]):
            key = ("mask-like", len(leaves), i, tuple(x.shape), x.dtype, x.device)
            mask = memo.get(key) if memo is not None else None
            if mask is None:
                mask = _mask_shaped(x, leaves) and _mask_like(x)
                _memo_put(memo, key, mask)
            if not mask:  # (x · 1: exact, signed zeros included; a product node, not the difference node
                # the engine gives a ruled output that needs no gradient: inputs taken out of the graph on some step,
                # a no_grad block mixing them, give the first layer's output that node instead)
                x = torch.mul(x, torch.ones((), dtype=x.dtype, device=x.device, requires_grad=True))
        out.append(x)
    return tree_unflatten(out, spec)


# Set while a capture takes the batch as it is (``_batch_in_graph`` does nothing): ``bk_options={"inputs_in_graph":
# False}``, or a batch shape whose first capture failed with its inputs in the graph (``_collect``).
_INPUTS_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("pdpsgd_inputs_out", default=False)
# What torch says when a forward cannot take an input that needs a gradient: NumPy of it (``x.numpy()``,
# ``np.asarray(x)``), or its requires_grad flag set (Hugging Face's speech encoders: ``input_values[:, None]``
# then ``.requires_grad = True``, a leaf's flag only).
_INPUTS_REFUSED = ("Can't call numpy() on Tensor that requires grad", "only change requires_grad flags of leaf variables")
_INPUTS_OUT_WARNING = ("book-keeping: the model (or loss_fn) failed with the batch's float inputs in the autograd graph "
                       "({why}), so they are left out of it for this batch shape: mixing of the raw inputs chosen at "
                       "random or by hidden state (input mixup in loss_fn on some steps, say) is not seen on its steps. "
                       "bk_options={{'inputs_in_graph': False}} says so from the start")
_INPUTS_REFUSED_LATER = ("the model (or loss_fn) failed with the batch's float inputs in the autograd graph ({why}) on this "
                         "batch, where earlier batches of its shape ran with them: book-keeping cannot run it again "
                         "without them on the same random draws in every case (a generator it cannot see), so it does "
                         "not. Pass bk_options={{'inputs_in_graph': False}} (mixing of the raw inputs chosen at random "
                         "is then not seen), or read the inputs without NumPy (x.detach().numpy()).")


class _InputsRefused(RuntimeError):
    """A capture's forward refused its float inputs in the graph (``_INPUTS_REFUSED``: ``why``); ``rng``: the
    random streams as its forward began (``_rng_now``), for the capture run again without them."""

    def __init__(self, why: str, rng: Any):
        super().__init__(why)
        self.why, self.rng = why, rng


def _rewind(params: Params, state: Any) -> None:
    """The caller's random streams (CPU, the parameters' CUDA devices, Python's, numpy's, the model's held
    generators) set to ``state`` (``_rng_now``): a draw that the refusal of one batch's forward took (a dropout
    before it), and another batch's did not, would have given the two different masks."""
    if state is None:
        return
    torch.set_rng_state(state[0])
    for d, st in state[1].items():
        torch.cuda.set_rng_state(st, d)
    np_ = sys.modules.get("numpy")
    random.setstate(state[2])
    if np_ is not None and state[3] is not None:
        np_.random.set_state(state[3])
    state[4].put()


def _mask_shaped(x: Tensor, leaves: Sequence[Any]) -> bool:
    """Whether a float tensor of the batch has an attention mask's shape: (B, T) or (..., T, T) beside another
    tensor of the batch whose first two dims are (B, T) (the ids, the embeddings). 0/1 float features (one-hot or
    binarised columns, (B, F) alone; binarised square images) are not masks: they go into the graph (review of
    round 49: taken for masks, their mixup stayed unseen, 1.57 and 1.08 × 2C)."""
    if x.dim() == 2:
        T = int(x.shape[1])
    elif x.dim() >= 3 and x.shape[-1] == x.shape[-2]:
        T = int(x.shape[-1])
    else:
        return False
    return any(isinstance(o, Tensor) and o is not x and o.dim() >= 2 and tuple(o.shape[:2]) == (x.shape[0], T)
               for o in leaves)


def _mask_like(x: Tensor) -> bool:
    """Every value of the float tensor 0, 1, -inf or its dtype's lowest (a mask, binary or additive)."""
    with torch.no_grad():
        return bool(((x == 0) | (x == 1) | (x == float("-inf")) | (x == torch.finfo(x.dtype).min)).all())


def _detached(out: Any) -> Any:
    """A check forward's losses without their graph (freed with the forward's saved tensors)."""
    return out.detach() if isinstance(out, Tensor) else out


def _plain_forward(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                   leaves: bool = False):
    """The loss's forward at the step's values (detached), no capture: the checks' extra forwards.
    ``leaves``: the (floating) parameters as fresh leaves that require grad, as in the capture."""
    return functional_call(loss_module, LossModule.prefixed({**constants, **{
        n: (v.detach().requires_grad_(True) if leaves and v.is_floating_point() else v.detach())
        for n, v in params.items()}}), (batch,))


def _probe_first_dims(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                      ruled: Dict[nn.Module, Tuple[str, Rule, Dict[str, str]]], B: int, registry: RuleRegistry,
                      seed: Optional[int] = None, replay: Optional[Tuple[Any, Any]] = None,
                      whole: bool = False):
    """(probe size, {module name: (first dim, its whole-view base's first dim, second dim, call site, first
    input's shape) of its calls, in order}, whether the forward drew random numbers, what of the model's state it
    changed: module plain attributes by name, "(a generator it holds)"), or (probe size, error
    text, False, ()). ``seed``: the forked random streams seeded with it (else they go on from the
    caller's). ``replay``: (``_rng_now``, ``_module_attrs``) as the capture began: the probe runs from
    there (its streams and the attributes it finds are put back after). ``whole``: the probe is the
    whole batch and its first example again (B + 1 examples; see ``_check_batch_dims``)."""
    Bp = B + 1 if whole else PROBE_B if B != PROBE_B else PROBE_B + 1
    idx = torch.arange(Bp) % B  # examples 0, 1, ... (repeated when B is smaller)
    probe = select_examples(batch, idx)
    seen: Dict[str, List[Tuple[Optional[int], Optional[int], Optional[int], Any, Any]]] = {}

    def hook(module, args, kwargs, output):  # (first dim, first dim of the base it is a whole view of, second dim,
        # site, the first input's shape (``_input_shape``))
        if getattr(ruled[module][1], "batch_dim_of_output", False):
            seen.setdefault(ruled[module][0], []).append((_out_dim(output), None, None, _call_site(), None))
            return
        x = _first_tensor(args, kwargs)
        base = _whole_view_of(x) if x is not None and x.dim() > 0 else None
        # (a second dim whose memory is not the examples' (a reshaped view, ``_dim1_steps_examples``) is
        # recorded as None: not confirmed as the batch)
        seen.setdefault(ruled[module][0], []).append((_first_dim(args, kwargs), None if base is None else int(base.shape[0]),
                                                      int(x.shape[1]) if x is not None and x.dim() > 1
                                                      and _dim1_steps_examples(x, Bp) else None, _call_site(),
                                                      _input_shape(ruled[module][1], args, kwargs)))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m, (_, rule, _) in ruled.items()
               if not getattr(rule, "custom_forward", False)]  # (custom-forward rules check their own layout)
    # custom-forward rules that ask for it (``probe_forward``) run their forward in the probe too, as
    # in the capture (their layers' children then see the calls the capture makes)
    probed = [m for m, (_, rule, _) in ruled.items()
              if getattr(rule, "custom_forward", False) and getattr(rule, "probe_forward", False)
              and "forward" not in m.__dict__]
    def custom(rule, module, *args, **kwargs):  # (the axis a custom-forward rule reads as the batch)
        if getattr(rule, "batch_axis", None) is not None:
            seen.setdefault(ruled[module][0], []).append((_rule_batch_dim(rule, module, args, kwargs), None, None,
                                                          _call_site(), None))
        return _probe_custom_forward(rule, module, *args, **kwargs)

    for m in probed:
        m.__dict__["forward"] = _Wrapped(functools.partial(custom, ruled[m][1], m), m, ruled[m][1])
    try:
        # (in grad mode, with the parameters as leaves that require grad, as the capture runs: a forward
        # that takes another path without gradients calls from other sites: Hugging Face's activation
        # checkpointing on ``torch.is_grad_enabled()``, torchvision's DenseNet or mmcv's blocks on
        # ``x.requires_grad``; review, round 46. The graph is dropped with the output.)
        model = loss_module.model
        rngs = (_rng_replay(params, replay[0]) if replay is not None
                else _own_rng(params, seed, model=model))
        with torch.enable_grad(), mha_fastpath_off(), preserve_module_state(model), rngs, \
                _attrs_replayed(model, None if replay is None else replay[1]), _adapted(model, registry, Bp):
            # (the attributes it changes are put back after: by ``_own_rng``, or ``_attrs_replayed``)
            before, settings, held = _streams(params, model), model_settings(model), _HeldStates.of(_model_rngs(model))
            _plain_forward(loss_module, params, constants, probe, leaves=True)
            drew = _drew(before, _streams(params, model))
            changed = _settings_changed(model, settings, model_settings(model))
            if held != _HeldStates.of(held.rngs):
                changed.append("(a generator it holds)")
            stateful = tuple(changed)
    except Exception as err:  # a model that cannot run the probe: nothing is verified
        return Bp, f"{type(err).__name__}: {str(err)[:200]}", False, ()
    finally:
        for h in handles:
            h.remove()
        for m in probed:
            m.__dict__.pop("forward", None)
    return Bp, seen, drew, stateful


_STATEFUL = ("the model's forward changes state the model keeps ({what}): book-keeping probes each step again "
             "from the state its capture began in{order}, a few extra forwards a step (its path may depend on that "
             "state). Keep state that chooses no path (a count for logging, say) outside the model's modules")

# A step's capture is checked against the paths the example-order check has verified for its batch
# shape: the autograd graph behind its losses, as its nodes' local shapes with their counts (``_path_of``).
# One whose graph has a node shape no verified capture of that shape had, or more nodes of one (a mixing op, a layer given
# a table instead of the batch, on a branch that the checks' forwards did not take: chosen by state
# the engine cannot see, a rare random draw, the batch's values) takes the exact fallback for every
# ruled parameter in that step (review, round 47: such paths moved the sum by up to 1.9 × 2C). On unless
# ``bk_options={"hold_paths": False}`` (or the example-order check is off).
_NEW_PATH = ("this step's forward took a path (autograd graph) that the example-order check has not verified for this "
             "batch shape (state the engine cannot see, a rare random draw or the batch's values chose it)")
_NEW_PATH_WARNING = ("the model's forward took a path (autograd graph) in this step that the example-order check did not "
                     "see on this batch shape's first step: every ruled parameter takes the exact vmap fallback in the "
                     "steps that take it (slower; exact). A forward whose path depends on hidden state, random draws or "
                     "the batch's values does this; dp_step.fallback_reasons does not show it (it is per step)")


class _Path:
    """A step's path (``_path_of``): its autograd graph's node shapes, each with the number of nodes that have
    it (a multiset). ``a <= b``: b has every shape of a, at least as many times. Counts, not a set
    (round 49): a mixing op of a shape the graph had elsewhere (an ``h @ h.T`` where the model has matmuls
    with both inputs needing a gradient, a ``view`` that moves rows between examples) adds a node of that
    shape, one more than a verified path had; a layer skipped (LayerDrop) has fewer."""

    __slots__ = ("counts",)

    def __init__(self, counts: Optional[Mapping[Tuple, int]] = None):
        self.counts: Dict[Tuple, int] = dict(counts or {})

    def __le__(self, other: "_Path") -> bool:
        oc = other.counts
        return all(oc.get(k, 0) >= n for k, n in self.counts.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Path) and self.counts == other.counts

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return bool(self.counts)

    def __repr__(self) -> str:
        return f"_Path({len(self.counts)} shapes, {sum(self.counts.values())} nodes)"


def _path_of(losses: Tensor, glue: Set[Any] = frozenset()) -> _Path:
    """The autograd graph behind ``losses`` as its nodes' shapes (node type, which of its inputs need a
    gradient, the dims it acts on where it saved them as plain values: reduced, joined, rolled, flipped,
    permuted, transposed along), each with its count (``_Path``). No wiring: a layer skipped (LayerDrop,
    all of them included), a batch of another size or another order of the same ops gives a sub-multiset
    of the same shapes; an op the graph did not have (a sum or a concatenation over the batch dim, a
    gather, a batch statistic) a new shape, and one more op of a shape it had a count one larger. (With
    the types of the nodes below, as a first version had, a LayerDrop step that skips every layer rewires
    a node to another type and is new.) ``glue``: the engine's own nodes (a batch-free output expanded to B
    rows, which depends on B), seen through. ~70 µs for a 4-layer GPT-2."""
    root = losses.grad_fn
    if root is None:
        return _Path()
    seen = {root}
    stack = [root]
    out: Dict[Tuple, int] = {}
    while stack:
        f = stack.pop()
        kids = []
        for g, _ in f.next_functions:
            while g is not None and g in glue:
                g = g.next_functions[0][0] if g.next_functions else None
            kids.append(g is not None)
            if g is None:
                continue
            if g not in seen:
                seen.add(g)
                stack.append(g)
        t = type(f)
        names = _DIM_ATTRS.get(t)
        if names is None:
            names = _DIM_ATTRS[t] = tuple(a for a in dir(f) if a.startswith("_saved_") and "dim" in a)
        k = (t, tuple(kids), tuple(_dims_of(getattr(f, a)) for a in names) if names else None)
        out[k] = out.get(k, 0) + 1
    return _Path(out)


# node type -> the names of its saved attributes that say which dims it acts on (``_saved_dim``, ``_saved_dims``,
# ``_saved_dim0`` / ``_saved_dim1``, ``_saved_keepdim``): plain values. (Not an index's ``_saved_indices``: reading
# saved tensors unpacks them, which re-runs a non-reentrant checkpoint's segment and breaks one-shot
# saved-tensor hooks; review of round 48: 28 % slower with an index inside checkpointed blocks.)
_DIM_ATTRS: Dict[type, Tuple[str, ...]] = {}


def _dims_of(v: Any) -> Any:
    """A saved dims attribute as a hashable value."""
    return tuple(_dims_of(x) for x in v) if isinstance(v, (list, tuple)) else v


def _glue_of(expanded: Tensor, glue: Set[Any]) -> None:
    """The nodes of ``x.expand(B, ...).contiguous()`` (clone, expand) into ``glue``."""
    f = expanded.grad_fn
    for _ in range(2):
        if f is None:
            return
        glue.add(f)
        f = f.next_functions[0][0] if f.next_functions else None


def _memo_apart(probe_memo: Dict, okey) -> Dict:
    """A copy of the probe memo without the example-order check's verdicts for ``okey``: what a path's
    confirming captures and the check run again for it read and write, apart from the step's memo."""
    return {k: v for k, v in probe_memo.items() if k not in (okey, ("float32", okey))}


def _held_back(probe_memo: Dict, hold_key, ruled_names: Set[str], fallback: Dict[str, str], order):
    """A step's path not confirmed: every ruled parameter to the exact fallback, a warning once per batch shape."""
    for c in ruled_names:
        fallback.setdefault(c, _NEW_PATH)
    if ("paths warned", hold_key) not in probe_memo:
        _memo_put(probe_memo, ("paths warned", hold_key), True)
        warn(_NEW_PATH_WARNING)
    return order


def _replayed_path(loss_module, params, constants, batch, registry, overrides, memo, no_expand, rng,
                   attrs, seed: Optional[int] = None) -> Optional[_Path]:
    """The path (``_path_of``) of one more capture of ``batch`` as the step runs (its modes, its
    dropouts), from the random state (``rng``) and module attributes (``attrs``, if kept) the step's
    capture began in (``rng`` None: from streams seeded with ``seed``, as the example-order check's
    runs draw); None if it fails."""
    seen: List[_Path] = []
    t1, t2 = _CHECK_REPLAY.set(rng), _CHECK_PATHS.set(seen)
    try:
        with _attrs_replayed(loss_module.model, attrs), _own_rng(params, seed, model=loss_module.model):
            _collect(loss_module, params, constants, batch, registry, overrides, memo, check_broadcast=False,
                     no_expand=no_expand, check_order=False)
    except Exception as err:  # (the path is not confirmed; the exact fallback's forward is the judge)
        if isinstance(err, OOM_ERRORS):
            raise
        return None
    finally:
        _CHECK_REPLAY.reset(t1)
        _CHECK_PATHS.reset(t2)
    return seen[-1] if seen else None


def _hold_to_paths(path: _Path, probe_memo: Dict, hold_key, okey, fresh: bool, ruled_names: Set[str],
                   fallback: Dict[str, str], loss_module, params, constants, batch, registry, overrides, no_expand,
                   rng, attrs, order: Tuple, pre0: Any = _NOT_REACHED) -> Tuple:
    """The step's capture against the paths verified for its batch shape (``hold_key``); returns the
    step's example-order verdicts. On the step whose example-order check ran (``fresh``: the batch
    shape's first, or one whose memos were dropped), a path is recorded as verified if a capture as the
    step runs on the streams the check's runs draw from (seed 0; ``pre0`` where it ran before the
    step's capture) takes it too (a multiset: at least its nodes of each shape; round 49: the whole path,
    where round 48 asked for its new shapes). Any other new path (on a later step; or on that step, a
    path drawn from the caller's streams that the check's runs did not take: review of round 48, a
    mixing path drawn with probability 0.3 on the first step was recorded, 1.75 × 2C) is confirmed
    first: one more capture of the batch as the step runs, from the random state and attributes the
    step's began in (``_replayed_path``), must take it too (all of it; a path chosen by a random draw, the global
    streams' or a held generator's, or by the batch's values is taken again; one chosen by state the
    engine cannot see, which that capture advanced, need not be). Not confirmed: every ruled
    parameter takes the exact fallback in this step, with a warning once per batch shape. Confirmed:
    the example-order check runs again, from the same random state, on a copy of the memo, and one
    more capture after it must take the path too (state the check's forwards advanced no longer
    chooses it); its verdicts join the batch shape's (``order``; a parameter found mixing by either
    takes the fallback) for this step; the path is recorded if it found nothing the batch shape's
    had not."""
    if _DROPOUT_OFF.get():
        return order  # (a DropoutOff block around the step: ``testing.check_sensitivity``'s removal runs; not held)
    key = ("paths", hold_key)
    known: Tuple[_Path, ...] = probe_memo.get(key, ())
    if any(path <= k for k in known):
        return order
    scratch = _memo_apart(probe_memo, okey)
    if fresh or not known:
        if pre0 is _NOT_REACHED:  # (not run before the step's capture: a first step whose path was recorded)
            pre0 = _replayed_path(loss_module, params, constants, batch, registry, overrides, scratch, no_expand,
                                  None, attrs, seed=0)
        if pre0 is not None and path <= pre0:
            _memo_put(probe_memo, key, _with_path(known, path))
            return order

    def replayed() -> bool:  # (one more capture from the step's state takes the whole path too)
        taken = _replayed_path(loss_module, params, constants, batch, registry, overrides, scratch, no_expand, rng,
                               attrs)
        return taken is not None and path <= taken

    if not replayed():
        return _held_back(probe_memo, hold_key, ruled_names, fallback, order)
    t1 = _CHECK_REPLAY.set(rng)
    try:
        with _attrs_replayed(loss_module.model, attrs):
            again = _order_disagree(loss_module, params, constants, batch, registry, overrides, scratch, no_expand,
                                    okey)
    finally:
        _CHECK_REPLAY.reset(t1)
    if not replayed():  # (and after the check's forwards: state they advanced no longer chooses it)
        return _held_back(probe_memo, hold_key, ruled_names, fallback, order)
    if order is None:  # (a capture made again in the step, whose caller applies its own verdicts: these here)
        for c in ruled_names:
            if c in again[0] or c not in again[1]:
                fallback.setdefault(c, again[0].get(c, _NEW_PATH))
        if not again[0]:
            _memo_put(probe_memo, key, _with_path(known, path))
        return order
    if set(again[0]) <= set(order[0]):
        _memo_put(probe_memo, key, _with_path(known, path))
    return (*_both_passed(order[:3], again[:3]), order[3] or again[3])


PATHS_MAX = 32  # verified paths kept per batch shape (the largest ones; the oldest go first)


def _with_path(known: Tuple[_Path, ...], path: _Path) -> Tuple[_Path, ...]:
    """The verified paths with ``path`` (review of round 49: each step is held to one verified path, not to the
    largest count of each shape over all of them, which a step could combine from several: a benign branch with
    two row selections, another with none, and a mixing step on the second with one that permutes rows, 1.64 × 2C):
    those within it dropped, none added if it is within one."""
    if any(path <= k for k in known):
        return known
    return tuple([k for k in known if not k <= path] + [path])[-PATHS_MAX:]


def _rule_batch_dim(rule: Rule, module: nn.Module, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[int]:
    """The size of the axis the rule reads as the batch: ``Rule.batch_axis`` of its first input where
    the rule has one (custom-forward rules), else the first input's first dimension."""
    axis = rule.batch_axis(module, args, kwargs) if getattr(rule, "batch_axis", None) is not None else None
    if axis is None:
        return _first_dim(args, kwargs)
    x = _first_tensor(args, kwargs)
    return int(x.shape[axis]) if x is not None and x.dim() > axis else None


def _input_shape(rule: Rule, args: Tuple[Any, ...], kwargs: Mapping[str, Any]) -> Optional[Tuple[int, ...]]:
    """The shape of a call's first input as the capture and the batch-dimension probe record it (None for a
    rule that reads the batch elsewhere: its output's first dim, a custom axis)."""
    if getattr(rule, "batch_dim_of_output", False) or getattr(rule, "batch_axis", None) is not None:
        return None
    x = _first_tensor(args, kwargs)
    return None if x is None else tuple(x.shape)


def _shape_agrees(probe: Optional[Tuple[int, ...]], real: Optional[Tuple[int, ...]], bp: int, B: int) -> bool:
    """Whether a probe call's input shape (a probe of ``bp`` examples) can be the capture's call's (B examples)
    on the same path: each dim the same but one at most, in the ratio bp : B (the batch, or the batch flattened
    with other dims). Not so where the forward cut its tensors to what the batch's values ask (its longest example: another
    T); such a record says nothing of this call (see ``_check_batch_dims``)."""
    if probe is None or real is None:
        return True
    if len(probe) != len(real):
        return False
    # (one dim at most: the batch's, or the batch flattened with others; review of round 50: a time-major
    # record (3, 2, d) of another length agreed with a (6, 4, d) call in both dims and vetoed it)
    diff = [(a, b) for a, b in zip(probe, real) if a != b]
    return len(diff) <= 1 and all(a * B == b * bp for a, b in diff)


def _probe_custom_forward(rule: Rule, module: nn.Module, *args, **kwargs):
    """A custom-forward rule's forward in the batch-dimension probe: its output (the layer's own
    forward where the rule declines the call)."""
    res = rule.forward(module, args, kwargs)
    return type(module).forward(module, *args, **kwargs) if res is None or isinstance(res, str) else res[0]


def _collect(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
             registry: RuleRegistry, overrides: Mapping[str, str], probe_memo: Optional[Dict] = None,
             check_broadcast: bool = True, loss_weights: Optional[Tensor] = None,
             no_expand: Optional[Mapping[str, str]] = None, check_order: Union[bool, str] = True,
             paths: Union[bool, Tuple[Any, bool]] = False) -> _Collected:
    """Forward with the ruled layers' forwards wrapped, backward to the captured outputs; uses per ruled parameter.

    With the registry's capture adapters installed (``rules.base.CaptureAdapter``) while some module takes one.
    A capture that fails with them (e.g. a model whose inner batch is not B, such as multiple choice run as
    (B·C, T), against an adapter's (B, ...) result) runs again without them: the layers they served take the
    exact fallback, and that is memoised per batch shape (without B). If it fails without them too, the
    first error is raised (the model's own). A capture whose forward cannot take the batch's float inputs in the
    autograd graph (``_batch_in_graph``; torch's refusals ``_INPUTS_REFUSED``) on a batch shape none of whose
    captures took them yet runs again with them as they are, from the random streams as it began, and the batch
    shape's later captures take them so too (warned); a refusal after a capture of the shape took them is an
    error. (Review of round 49: retried at every capture, a refusal that only one neighbour's batch met drew that
    batch's dropouts again from a generator the engine cannot put back, a closure's, 1.47 × 2C; and remembered
    once per shape it must be, or a forward refused on one capture only and held by nothing after would choose
    when its inputs are seen.) ``paths``: the step's own capture (not a check's), whose
    autograd graph is held to the paths the example-order check verified (``_path_of``); (key, fresh):
    a capture the step makes again, held to the first one's recorded paths."""
    dkey = _duplicates_key(loss_module, batch, batch_size(batch))
    if _INPUTS_OUT.get() or probe_memo is None or ("inputs out", dkey) not in probe_memo:
        try:
            col = _collect_adapted(loss_module, params, constants, batch, registry, overrides, probe_memo,
                                   check_broadcast, loss_weights, no_expand, check_order, paths)
            if not _INPUTS_OUT.get() and batch_size(batch) > 1:  # (B = 1: nothing was put in the graph)
                _memo_put(probe_memo, ("inputs in", dkey), True)
            return col
        except _InputsRefused as err:
            if probe_memo is not None and ("inputs in", dkey) in probe_memo:
                raise ValueError(_INPUTS_REFUSED_LATER.format(why=err.why)) from err
            if probe_memo is None or ("inputs out", dkey) not in probe_memo:  # (a nested check's capture may have)
                _memo_put(probe_memo, ("inputs out", dkey), err.why)
                warn(_INPUTS_OUT_WARNING.format(why=err.why))
            _rewind(params, err.rng)  # (the refused attempt's draws undone)
    tok = _INPUTS_OUT.set(True)
    try:
        return _collect_adapted(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                                loss_weights, no_expand, check_order, paths)
    finally:
        _INPUTS_OUT.reset(tok)


def _collect_adapted(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                     loss_weights, no_expand, check_order, paths) -> _Collected:
    """``_collect`` with the batch's inputs in the graph or not (``_INPUTS_OUT``): the adapters' retry."""
    args = (loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast, loss_weights,
            no_expand, check_order, paths)
    if not _adapters_apply(loss_module.model, registry):
        if _ADAPTERS_OFF.get():
            return _collect_once(*args)
        tok = _ADAPTERS_OFF.set(True)  # (none applies: its checks and probes need not look for any either)
        try:
            return _collect_once(*args)
        finally:
            _ADAPTERS_OFF.reset(tok)
    key = ("adapters off", _duplicates_key(loss_module, batch, batch_size(batch)))
    if probe_memo is None or key not in probe_memo:
        try:
            return _collect_once(*args)
        except Exception as err:
            if isinstance(err, OOM_ERRORS):
                raise
            first = err
    else:
        first = None
    tok = _ADAPTERS_OFF.set(True)
    try:
        col = _collect_once(*args)
    except Exception:
        if first is not None:
            raise first
        raise
    finally:
        _ADAPTERS_OFF.reset(tok)
    if first is not None:
        _memo_put(probe_memo, key, True)
    return col


def _collect_once(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                  registry: RuleRegistry, overrides: Mapping[str, str], probe_memo: Optional[Dict] = None,
                  check_broadcast: bool = True, loss_weights: Optional[Tensor] = None,
                  no_expand: Optional[Mapping[str, str]] = None, check_order: Union[bool, str] = True,
                  paths: Union[bool, Tuple[Any, bool]] = False) -> _Collected:
    """``_collect``'s one attempt (with the adapters as ``_ADAPTERS_OFF`` says). A parameter the example-order
    check had stopped asking about (``_Collected.recheck``) is asked again on this batch, which reaches it: the
    capture runs once more, from the random streams it began with (review of round 50: a custom RNN cell's weight
    had no gradient in the batches of length 1 that ``check_sensitivity`` ran, ORDER_RETRIES of them; every later
    batch of the shape took the fallback for it, which could not run the forward: the step raised)."""
    args = (loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast, loss_weights,
            no_expand, check_order, paths)
    col = _collect_body(*args)
    if col.recheck and check_order and col.attrs is None:
        _rewind(params, col.rng)
        col = _collect_body(*args)
    return col


def _collect_body(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                  registry: RuleRegistry, overrides: Mapping[str, str], probe_memo: Optional[Dict] = None,
                  check_broadcast: bool = True, loss_weights: Optional[Tensor] = None,
                  no_expand: Optional[Mapping[str, str]] = None, check_order: Union[bool, str] = True,
                  paths: Union[bool, Tuple[Any, bool]] = False) -> _Collected:
    """``_collect_once``'s capture."""
    model = loss_module.model
    B = batch_size(batch)
    # the model's own Parameter objects (read before they are swapped out of its modules for the
    # capture): a path from the loss to one is a use the capture (and the fallback) cannot see (a
    # reference kept in a list or a closure): refused, never a silently missing gradient term
    stray = trainable_parameters(model, params)
    ruled, fallback, owner = _model_layout(model, params, registry, overrides)
    # modules whose (1, T, ...) or (T, ...) outputs are not expanded: the duplicated-example check (below) found
    # them read otherwise (module name -> reason); known from an earlier step of this batch shape, or
    # found in this one (then the capture runs again without them)
    no_expand = dict(no_expand or {})
    dkey = _duplicates_key(loss_module, batch, B)
    if check_broadcast and probe_memo is not None and dkey in probe_memo:
        no_expand.update(probe_memo[dkey][1])
    expanded: Set[str] = set()  # modules whose outputs this forward expanded
    expanded_tm: Set[str] = set()  # those of them whose call also reads as time-major ((1, B, ...): T = 1)
    # modules whose 1-d ids (B,) the probe found batch-free (T = B): expanded as (T,) ones are
    # (module name, "time"): modules the probe found time-major with T = B or T = 1 (``_Call.retry``); (module name,
    # "free"): modules whose 1-d (B,) ids the probe found batch-free (T = B positions), expanded as (T,) ones are
    lkey = ("reread", _probe_key(batch, B, model.training))
    forced: FrozenSet[Tuple[str, str]] = probe_memo.get(lkey, frozenset()) if probe_memo is not None else frozenset()
    # the example-order check runs first (its passes, one at a time, are freed before this one's)
    # (its verdicts are keyed by the expansions its runs took: verdicts found through an expansion that a
    # later step's duplicated-example check drops are not reused once it is dropped)
    okey = _order_key(loss_module, batch, params, no_expand)
    # (the batch shape's probes, memoised: ``_check_batch_dims``)
    pkey = (lkey[1], tuple(sorted(v[0] for v in ruled.values()))) if probe_memo is not None else None
    pgot = probe_memo.get(pkey) if pkey is not None else None
    # a forward that changes its modules' plain attributes (a counter) may take another path at every
    # step: its example-order check runs again (review, round 47: a counter mixing examples every 16th
    # forward stayed on the rules, 1.75 × 2C); each of its forwards starts from the state the capture
    # starts from (``_own_rng`` puts the attributes back)
    if (check_order == "always" or (pgot is not None and pgot.counters)) and probe_memo is not None:
        for k in (okey, ("float32", okey)):
            probe_memo.pop(k, None)
    # (the check runs its forwards now: the paths this capture takes count as verified, as the first step's do)
    fresh = bool(check_order) and B > 1 and probe_memo is not None and okey not in probe_memo
    order = (_order_disagree(loss_module, params, constants, batch, registry, overrides, probe_memo, no_expand, okey)
             if check_order and B > 1 else None)
    # (a capture made again in this step, ``paths`` = (key, fresh): held to the same recorded paths as the first)
    hold_key, fresh = paths if isinstance(paths, tuple) else (okey, fresh)
    paths_again = paths and (hold_key, fresh)
    # where no path is recorded yet, the capture that may confirm this step's (``_hold_to_paths``), run now, before
    # the step's own (its memory freed before the step's capture holds its factors; after it, the first step's peak
    # grew by a quarter): as the step runs, from the streams the example-order check's runs draw from (seed 0)
    pre0 = (_replayed_path(loss_module, params, constants, batch, registry, overrides,
                           _memo_apart(probe_memo, okey), no_expand, None, None, seed=0)
            if paths and B > 1 and probe_memo is not None and ("paths", hold_key) not in probe_memo
            and not _DROPOUT_OFF.get() else _NOT_REACHED)
    for m, (mn, _, local) in ruled.items():
        if mn in no_expand:
            for c in local.values():
                fallback.setdefault(c, f"{type(m).__name__} ({mn}): {no_expand[mn]}")
        elif any(c in fallback for c in local.values()):  # (forced to vmap, say): nothing to expand for
            no_expand[mn] = "its parameters take the fallback"
    ruled_names: Set[str] = {c for (_, _, local) in ruled.values() for c in local.values()} - set(fallback)
    # Ruled parameters enter as leaves that require grad: inside their own layer's forward they are
    # swapped for a detached alias, so autograd computes no weight gradient there; any *other* use
    # reaches the leaf and is detected below (exact vmap fallback for that parameter).
    leaves = {n: (params[n].detach().requires_grad_(True) if n in ruled_names else params[n].detach())
              for n in params}
    detached = {n: leaves[n].detach() for n in ruled_names}
    # each ruled slot's own Parameter (the checks' extra forwards run the model on these) or the step's leaf:
    # anything else in the slot when the layer runs was put there by the model itself (``swap_in``)
    own = {(id(m), pn): m._parameters[pn] for m, (_, _, local) in ruled.items() for pn in local}
    calls: List[_Call] = []
    # After the forward, the wrapped forwards stay on through the backward: a layer that runs again then is a
    # checkpoint recomputation (torch.utils.checkpoint, use_reentrant=False; HF's default), which
    # must see the same parameters and produce the same graph as in the forward, and is not recorded.
    replay = [False]
    watch: List[Optional[_Watched]] = [None]  # the forward's (``_watch_autograd``), read after the backward
    path: List[Optional[_Path]] = [None]  # its autograd graph's node shapes (``_path_of``), if ``paths``
    glue: Set[Any] = set()  # the autograd nodes of this forward's expansions (seen through by ``_path_of``)
    rng_at: List[Any] = [None]  # the random streams as the capture's forward began (``_rng_now``)
    reached: List[bool] = [True]  # whether the losses reached a ruled parameter or call (``_Collected.reached``)
    # ruled calls' outputs with no element (no gradient: not captured), that need one: whether the losses reach
    # them tells a loss on no rows from a detached one (``DETACHED_LOSS``)
    empty: List[Tensor] = []
    # the modules' attributes then (``_module_attrs``), kept where a probe may need them: on the
    # first step of a batch shape, and at every step of a forward found to change the model's state; and
    # where some parameter is known to take the exact fallback (its forward runs from them if the capture,
    # its backward included, changed a plain attribute: ``col.attrs``)
    keep_attrs = pgot is None or pgot.stateful or bool(fallback) or (order is not None and bool(order[0]))
    attrs_at: List[Any] = [None]
    settings_at: List[Any] = [None]
    flat: Dict[Tuple[Any, int], _Flat] = {}  # row-wise outputs of flattened calls (``_flat_rows``)
    # row-wise calls' outputs (autograd edge -> call index, output shape): where picked rows came from (``_picked_rows``)
    outs: Dict[Tuple[Any, int], Tuple[int, Tuple[int, ...]]] = {}
    swapped: Dict[nn.Module, List[Dict[str, Tensor]]] = {}
    real_dims: Dict[str, List[Optional[int]]] = {}  # module name -> first dim of each call's input
    real_sites: Dict[str, List[Any]] = {}  # module name -> each call's site (``_call_site``)
    real_shapes: Dict[str, List[Any]] = {}  # module name -> each call's first input's shape (``_input_shape``)

    def swap_in(module):
        mname, rule, local = ruled[module]
        prev = {}
        dual = _dual_level_active()  # a JVP's tangent path to a weight (W·v) is no term of aᵀg (round 34)
        for pn, c in local.items():
            if dual:
                fallback.setdefault(c, f"{type(module).__name__} ({mname or '<root>'}): {_FORWARD_AD}")
            if c in detached:
                now = module._parameters[pn]
                if now is not leaves[c] and now is not own.get((id(module), pn)):
                    # the layer runs with another tensor in this slot than the step's parameter (the model's
                    # own torch.func.functional_call, a hypernetwork's or fast weights): its gradient is not
                    # aᵀg of this parameter, and swapping ours in would change the forward (review, round 33)
                    fallback.setdefault(c, f"{type(module).__name__} ({mname or '<root>'}) ran with a substituted "
                                           f"{pn} (e.g. torch.func.functional_call inside the model)")
                    continue
                prev[pn] = now
                module._parameters[pn] = detached[c]
        swapped.setdefault(module, []).append(prev)

    def swap_out(module):
        stack = swapped.get(module)
        for pn, t in (stack.pop() if stack else {}).items():
            module._parameters[pn] = t

    pending: Dict[nn.Module, List[Any]] = {}  # custom-forward captures, until ``on_output``

    def wrapped_forward(module, rule, inner):
        # The layer's own forward, wrapped (an instance attribute, only while capturing): parameters
        # swapped in around it, and the output captured as the layer computed it, before any
        # forward hook (global or the module's) runs and could replace or edit it.
        custom = getattr(rule, "custom_forward", False)

        def forward(*args, **kwargs):  # (wrapped in _Wrapped below)
            swap_in(module)
            try:
                if not custom:
                    output = inner(*args, **kwargs)
                else:
                    res = rule.forward(module, args, kwargs)
                    if res is None or isinstance(res, str):  # declined (a str: why): original forward, exact fallback
                        mname, _, local = ruled[module]
                        why = f": {res}" if res else ""
                        for c in local.values():
                            fallback.setdefault(c, f"{rule.name} rule declined a call of {mname or '<root>'}{why}")
                        pending.setdefault(module, []).append(None)
                        output = inner(*args, **kwargs)
                    else:
                        output, capture = res
                        pending.setdefault(module, []).append(capture)
            except BaseException:
                swap_out(module)  # (a model that catches the error must not go on with the aliases)
                raise
            new = on_output(module, args, kwargs, output)
            return output if new is None else new

        return _Wrapped(forward, module, rule)

    def on_output(module, args, kwargs, output):
        mname, rule, local = ruled[module]
        if not replay[0]:
            real_dims.setdefault(mname, []).append(
                _out_dim(output) if getattr(rule, "batch_dim_of_output", False) else _rule_batch_dim(rule, module, args, kwargs))
            real_sites.setdefault(mname, []).append(_call_site())
            real_shapes.setdefault(mname, []).append(_input_shape(rule, args, kwargs))
        # a rule that checks each call against its output does it now, with this step's parameter
        # values still in place and before the model may edit the output in place
        ok = True
        verify = getattr(rule, "verify", None)
        if verify is not None and not replay[0] and torch.is_grad_enabled():
            ok = _run_verify(verify, module, args, kwargs, output)
        swap_out(module)
        if getattr(rule, "custom_forward", False):
            capture = pending[module].pop()
            if capture is not None and not replay[0] and torch.is_grad_enabled():
                vers = tuple(x._version for x in args if isinstance(x, Tensor))
                calls.append(_Call(module, mname, rule, args, dict(kwargs), None, vers, capture, ok=ok,
                                   amp=_amp_of(output, args), k=len(real_dims[mname]) - 1, settings=_settings(module)))
            return None
        if not isinstance(output, Tensor) or not output.is_floating_point():
            for c in local.values():
                fallback.setdefault(c, f"{type(module).__name__} ({mname}) returned no float tensor")
            return None
        if _functorch_wrapped(output):  # (review, round 36: autograd's "does not require grad" error)
            for c in local.values():
                fallback.setdefault(c, f"{type(module).__name__} ({mname}) was called under a torch.func transform "
                                       "(vmap, grad, ...) inside the forward: the rows it sees are not the batch's")
            return None
        if not torch.is_grad_enabled():
            # no gradient can flow from this call: it contributes exactly 0 (and a checkpoint
            # recomputation of it, which runs in the same grad mode, is left as it is too)
            return None
        if output.numel() == 0 and not getattr(rule, "broadcast_batch", False):
            # no output element, no gradient through it: exactly 0 (a head on no picked rows, ``head(h[mask])`` with an
            # empty mask, at B = 1 too, where nothing reads its rows as picked; review of round 52: the fallback raised;
            # a loss that reaches no other call but such ones is then no detached loss)
            if output.requires_grad:
                empty.append(output)
            return None
        bcast = False
        if torch.is_grad_enabled() and not output.requires_grad:
            # e.g. the first embedding: make g reachable. output − 0 (exactly output, signed zeros
            # included) through a scalar leaf: one new tensor with a gradient edge, and the no-grad
            # output is freed (a leaf alias and its clone would keep both); an in-place edit
            # downstream is allowed.
            output = torch.sub(output, torch.zeros((), dtype=output.dtype, device=output.device, requires_grad=True))
        # (before any expansion below; T = 1 time-major (1, B, ...) ids read as (1, T = B) positions
        # until the probe says otherwise)
        tm = _time_major(rule, module, args, kwargs, output, B)  # (in a checkpoint's replay too: the same graph)
        retry = ""
        if getattr(rule, "broadcast_batch", False) and output.dim() >= 3 and output.shape[0] == 1 and B > 1 \
                and mname not in no_expand and not (tm and (mname, "time") in forced):
            # e.g. GPT-2's position embedding of (1, T) ids, broadcast over the batch downstream:
            # expanding it to B rows (same values) lets the backward keep each example's gradient.
            # Only (1, T, ...) outputs here: a (1, d) one (T = 1 positions, no batch dim) would
            # broadcast against (B, 1, d) into (B, B, d); it is expanded to (B, 1, d) below.
            # A copy, not a stride-0 view: the model may edit its output in place (p *= 2); the
            # copy lives no longer than the original would (its own gradient edge is what is kept).
            output = output.expand(B, *output.shape[1:]).contiguous()
            bcast = True
            expanded.add(mname)
            if tm:
                expanded_tm.add(mname)
            _glue_of(output, glue)
            retry = "time" if tm else ""
        lift = 0
        if getattr(rule, "broadcast_batch", False) and not bcast and mname not in no_expand:
            # e.g. nanoGPT's ``wpe(torch.arange(T))``: 1-d ids (T,) with no batch dim, a (T, d) output
            # that the model broadcasts over the batch: the same expansion, to (B, T, d), and the rule
            # reads the ids as (1, T). Not when the ids are the batch flattened (traced, below). When
            # T = B the ids might be the batch's (a (B,) label lookup): read batch-first until the probe
            # finds them batch-free (their length stayed B in probes of other sizes: ``retry`` "free"),
            # then expanded (round 51; before, the fallback, which cannot run a forward cut to its
            # batch's longest example). The duplicated-example check guards the use, as above (its
            # copies are never T, whose verdicts hold for every B; at B = T a forward that reads
            # ``pos.shape[0]`` sees T either way); a module expanded whose parameters fall back for any
            # reason is not expanded (the capture runs again).
            x0 = _first_tensor(args, kwargs)
            if x0 is not None and x0.dim() == 1 and not x0.is_floating_point() and not x0.is_complex() \
                    and output.dim() == 2 and output.shape[0] == x0.shape[0] \
                    and not (B > 1 and x0.shape[0] % B == 0 and _flat_rows(x0, B, flat, (mname, -1))[0]):
                if B == 1:  # one example owns every gradient: the ids read as (1, T), the forward as it is
                    lift = int(output.shape[0]) if x0.shape[0] != 1 else 0
                elif x0.shape[0] != B or (mname, "free") in forced:
                    lift = int(output.shape[0])
                    output = output.expand(B, *output.shape).contiguous()
                    bcast = True
                    expanded.add(mname)
                    _glue_of(output, glue)
                else:  # (B,) ids: the batch's, or batch-free with T = B (the probe says which)
                    retry = "free"
        if not replay[0]:
            vers = tuple(x._version for x in args if isinstance(x, Tensor))
            if lift:  # the rule reads the batch-free ids as (1, T), as a broadcast (1, T) call's
                args, kwargs = _lift_first(args, kwargs)
            k = len(real_dims[mname]) - 1
            rows, roots, chain = 0, (), ()
            x0 = _first_tensor(args, kwargs)
            # (a 1-d float input is one vector, not rows; 1-d ids are rows of an embedding)
            if getattr(rule, "rowwise", False) and x0 is not None \
                    and (x0.dim() >= 2 or (x0.dim() == 1 and not x0.is_floating_point())) \
                    and x0.dim() > _normalised_dims(module) \
                    and x0.shape[0] != B and x0.shape[0] % B == 0 and output.shape[0] == x0.shape[0]:
                if B == 1:
                    # one example owns the whole gradient: a row-wise layer's (N, ...) rows, whatever
                    # they are (OPT's (B·T, d) flattened MLP input, a batch-free (T, d) tensor), read
                    # as (1, N, ...) give its gradient exactly; nothing to trace or probe. (Not for a
                    # time-major (T, 1, ...) call: read with its batch dim moved, below.)
                    if not tm:
                        rows = int(x0.shape[0])
                else:
                    rows, roots, chain = _flat_rows(x0, B, flat, (mname, k))
                    if rows and output.grad_fn is not None:  # (this call's index: len(calls))
                        flat[(output.grad_fn, output.output_nr)] = (rows, tuple(output.shape), roots,
                                                                    chain + (len(calls),))
            bdim = 0
            pick = None
            if not rows and not lift and not bcast and not tm and B > 1 and getattr(rule, "rowwise", False) \
                    and x0 is not None and x0.dim() >= 2 and x0.grad_fn is not None:
                picked = _picked_rows(x0, B, outs, calls)
                if isinstance(picked, _Pick):
                    pick = picked
                    real_shapes[mname][-1] = None  # (its rows' count is the batch's values': no probe compares it)
                elif picked is not None:
                    for c in local.values():
                        fallback.setdefault(c, f"{type(module).__name__} ({mname or '<root>'}): {picked}")
            if not rows and not lift and not bcast and tm:
                if x0.shape[0] != B or (mname, "time") in forced:
                    bdim = 1
                else:  # (B, B, ...): batch-first as it stands; the probe may say time-major
                    retry = "time"
            src = _edge_source(output, args, kwargs) if not getattr(rule, "needs_output", True) else None
            if src is not None:
                # keep only the gradient edge of the output (or of the base it reshapes), from now on:
                # an output nobody else saves (an attention or MLP output projection before its
                # residual add) is freed as the forward goes on, not held until its end. That edge's
                # gradient is the output's as this layer produced it, even if the output is later
                # edited in place.
                calls.append(_Call(module, mname, rule, args, dict(kwargs), None, vers, edge=_gradient_edge(src),
                                   k=k, gshape=output.shape if src is not output else None, rows=rows, roots=roots,
                                   chain=chain, bcast=bcast, lift=lift, retry=retry, bdim=bdim, ok=ok,
                                   amp=_amp_of(output, args), settings=_settings(module), pick=pick))
            else:
                calls.append(_Call(module, mname, rule, args, dict(kwargs), output, (output._version,) + vers, k=k,
                                   rows=rows, roots=roots, chain=chain, bcast=bcast, lift=lift, retry=retry,
                                   bdim=bdim, ok=ok, amp=_amp_of(output, args), settings=_settings(module),
                                   pick=pick))
            if output.grad_fn is not None and getattr(rule, "rowwise", False):  # (a source of picked rows)
                outs[(output.grad_fn, output.output_nr)] = (len(calls) - 1, tuple(output.shape))
        return output

    leaf_names = [n for n in ruled_names]

    def forward_backward():
        rng_at[0] = _rng_now(params, model)  # (the exact fallback replays it: the same dropout masks)
        with torch.enable_grad(), _watch_autograd() as watched:
            try:
                inb = _batch_in_graph(batch, B, probe_memo)
                for t in tree_flatten(inb)[0]:  # (the batch's float inputs: sources of picked rows, ``_picked_from``)
                    if isinstance(t, Tensor) and t.grad_fn is not None and t.dim() >= 2 and t.shape[0] == B:
                        outs[(t.grad_fn, t.output_nr)] = (-1, tuple(t.shape))
                losses = loss_module(inb)
                del inb
            except RuntimeError as err:
                why = next((w for w in _INPUTS_REFUSED if w in str(err)), None)
                if why is None or _INPUTS_OUT.get() or B < 2:
                    raise
                raise _InputsRefused(why, rng_at[0]) from err
        watch[0] = watched
        if watched.create_graph:  # every ruled parameter to the exact fallback (vmap follows torch.func.grad)
            for _, _, local in ruled.values():
                for c in local.values():
                    fallback.setdefault(c, _CREATE_GRAPH)
        replay[0] = True
        flat.clear()  # (the forward's nodes are not held beyond it)
        outs.clear()
        if not isinstance(losses, Tensor) or losses.shape != (B,):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"loss_fn must return one loss per example, shape [{B}]; got {shape}. Use reduction='none' "
                "(and sum per-token losses per example)."
            )
        rec = _CHECK_PATHS.get()
        if (paths and B > 1 and probe_memo is not None) or rec is not None:
            path[0] = _path_of(losses, glue)
            if rec is not None and not paths:
                rec.append(path[0])
        glue.clear()
        # in-place edits of a captured input/output after the layer ran would make a or g stale
        for c in calls:
            now = (() if c.output is None else (c.output._version,)) + tuple(
                x._version for x in c.args if isinstance(x, Tensor))
            if now != c.versions:
                for c2 in ruled[c.module][2].values():
                    fallback.setdefault(c2, f"{type(c.module).__name__} ({c.mname}): input/output modified in place")
            elif c.settings is not None and not _same_settings(c.settings, _settings(c.module)):
                for c2 in ruled[c.module][2].values():
                    fallback.setdefault(c2, f"{type(c.module).__name__} ({c.mname}): called with settings (attributes or "
                                            "buffers) other than it has after the forward, which its rule reads")
        _release_outputs(calls)
        if not losses.requires_grad and leaf_names and len(leaf_names) == len(params):
            raise ValueError(DETACHED_LOSS)  # (every trained parameter a leaf here, none reached)
        reached[0] = losses.requires_grad  # (through the batch's inputs alone, ``_batch_in_graph``: not; below)
        early = _eager_calls(calls, [leaves[n] for n in leaf_names]) if losses.requires_grad else {}
        call_targets = [[] if i in early else c.targets for i, c in enumerate(calls)]
        targets = [t for ts in call_targets for t in ts] + [leaves[n] for n in leaf_names]
        hooks = [_eager_hook(st, B) for st in early.values()]
        try:
            if losses.requires_grad and targets:
                total = losses.sum() if loss_weights is None else (losses * loss_weights.to(losses)).sum()
                grads = torch.autograd.grad(total, targets + [p for _, p in stray] + empty, allow_unused=True)
                nt, ns = len(targets), len(stray)
                used = [n for (n, _), g in zip(stray, grads[nt:nt + ns]) if g is not None]
                on_empty = any(g is not None for g in grads[nt + ns:])
                grads = grads[:nt]
                del empty[:]
                if used:
                    raise stray_parameter_error(used)
                if not early and all(g is None for g in grads):  # (the losses reached the batch's inputs only)
                    reached[0] = False
                    if leaf_names and len(leaf_names) == len(params) and not on_empty:
                        raise ValueError(DETACHED_LOSS)
            else:
                grads = (None,) * len(targets)
        except RuntimeError as err:
            if str(err).startswith("When use_reentrant=True"):  # torch's own refusal of .grad()
                raise RuntimeError(_REENTRANT.format("the model uses torch.utils.checkpoint")) from err
            raise
        finally:
            for h in hooks:
                h.remove()
        return losses, grads, early, call_targets

    # (as the capture begins: before the capture adapters' methods are installed for its B examples)
    attrs_at[0] = _module_attrs(model) if keep_attrs else None
    settings_at[0] = model_settings(model) if keep_attrs else None
    patched: List[nn.Module] = []  # (a ruled module has no instance-level forward: those are fallbacks)
    try:
        for m, (_, rule, _) in ruled.items():
            # g must be the gradient of the output the layer computed: captured inside the forward
            # (custom-forward rules compute the layer themselves, to keep internal activations)
            patched.append(m)
            # (the instance dict, as the removal below: nn.Module.__setattr__'s registry checks cost
            # ~15 µs a layer, 4 % of a small model's step)
            m.__dict__["forward"] = wrapped_forward(m, rule, types.MethodType(type(m).forward, m))
        # forward and backward inside one functional_call: the parameters stay swapped in for a
        # checkpointed layer that the backward recomputes
        scope = _Scope(loss_module)
        # a checkpoint recomputation runs its whole segment (no early stop), so every layer's
        # parameter swap is undone as its forward returns before anything else is recomputed
        # (preserve_module_state: also undoes a parameter swap a failing forward left half done)
        with _no_checkpoint_early_stop(), preserve_module_state(model), _adapted(model, registry, B), \
                watch_stray(stray):
            losses, grads, early, call_targets = functional_call(
                scope, {"m." + k: v for k, v in LossModule.prefixed({**constants, **leaves}).items()},
                (forward_backward,))
    except Exception as err:
        if not expanded or isinstance(err, OOM_ERRORS):
            raise
        failed = err  # an expanded output broke the forward (e.g. a model whose inner batch is B·C)
    else:
        failed = None
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
    if failed is not None and expanded_tm and probe_memo is not None:
        # a time-major forward cut to T = 1: its (1, B, ...) ids read as (1, T = B) positions, whose expansion to
        # (B, B, ...) broke the forward. Read them time-major (batch in dim 1, as ``_time_major``), which the
        # batch-dimension probe then confirms or sends to the fallback (review, round 50: the expansion failed,
        # those tables went to the fallback for every later batch of the shape, and the fallback could not run
        # the forward: the step raised). Any other failure: as below.
        timed = forced | {(mn, "time") for mn in expanded_tm}
        _memo_put(probe_memo, lkey, timed)
        try:
            col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                           loss_weights, no_expand, check_order=False, paths=paths_again)
        except Exception as err:
            if isinstance(err, OOM_ERRORS):
                raise
            _memo_put(probe_memo, lkey, forced)
        else:
            return _apply_order(col, order, batch, probe_memo, params, okey)
    if failed is not None:  # run again without expanding them (their parameters: exact fallback)
        why = f"expanding its (1, T, ...) or (T, ...) output to the batch made the forward fail ({type(failed).__name__})"
        bad = {mn: why for mn in expanded}
        try:
            col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                           loss_weights, {**no_expand, **bad}, check_order=False, paths=paths_again)
        except Exception:
            raise failed  # it fails without the expansion too: the model's own error (nothing memoised)
        _memo_expansions(probe_memo, dkey, bad, bad)
        return _apply_order(col, order, batch, probe_memo, params, okey)
    relift = _check_batch_dims(loss_module, params, constants, batch, ruled, B, calls, real_dims, real_sites,
                               fallback, probe_memo, registry,
                               None if attrs_at[0] is None else (rng_at[0], attrs_at[0]), real_shapes)
    if relift - forced and probe_memo is not None:  # run again with them read so
        _memo_put(probe_memo, lkey, forced | relift)
        del calls[:]
        col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                       loss_weights, no_expand, check_order=False, paths=paths_again)
        return _apply_order(col, order, batch, probe_memo, params, okey)
    _check_picks(calls, ruled, real_dims, fallback, B)
    if path[0] is not None and paths:
        order = _hold_to_paths(path[0], probe_memo, hold_key, okey, fresh, ruled_names, fallback, loss_module,
                               params, constants, batch, registry, overrides, no_expand, rng_at[0], attrs_at[0], order,
                               pre0)
    n_call = sum(len(t) for t in call_targets)
    for n, g in zip(leaf_names, grads[n_call:]):
        if g is not None:
            fallback.setdefault(n, "also used outside its layer's forward")
    if watch[0] is not None and watch[0].leaf_hooks:
        # a hook on a ruled parameter itself (its gradient here comes from the rules, not through the leaf)
        for n in ruled_names:
            if id(leaves[n]) in watch[0].leaf_hooks:
                fallback.setdefault(n, "a gradient hook on the parameter itself (Tensor.register_hook in the forward)")
    if watch[0] is not None and watch[0].modified:
        # a gradient hook on a captured output (Tensor.register_hook) changed g after the engine read it
        for c in calls:
            if _edge_key(c) in watch[0].modified:
                for c2 in ruled[c.module][2].values():
                    fallback.setdefault(c2, f"{type(c.module).__name__} ({c.mname}): a gradient hook on its output "
                                            "(Tensor.register_hook) changes its gradient")
    uses: Dict[str, List[Use]] = {}
    verified: Set[int] = set()  # calls whose rule returned uses (checked the call, where it checks)
    k = 0
    for i, (c, ts) in enumerate(zip(calls, call_targets)):
        gs, k = list(grads[k:k + len(ts)]), k + len(ts)
        mname, rule, local = ruled[c.module]
        if all(n in fallback for n in local.values()):
            continue
        if not c.ok:
            got = None  # its forward is not the one the rule knows (``Rule.verify``)
        elif i in early:
            got = early[i].got
            if got is _NOT_REACHED:
                continue  # no gradient reached this call's output: zero contribution
        elif all(g is None for g in gs):
            continue  # this call's output does not reach the loss: zero contribution
        elif c.capture is not None:
            got = _mark_src(rule.custom_uses(c.module, c.capture, gs, B), (), {}, None, c.amp)
        else:
            args = tuple(x.detach() if isinstance(x, Tensor) else x for x in c.args)
            kwargs = {k2: (x.detach() if isinstance(x, Tensor) else x) for k2, x in c.kwargs.items()}
            g0 = gs[0] if c.gshape is None or gs[0] is None else gs[0].view(c.gshape)
            args, kwargs, out0, g0 = _unflatten(c, B, args, kwargs, None if c.output is None else c.output.detach(), g0)
            swap_in(c.module)  # the parameter values this step ran with (``params``), as the rule may read them
            try:
                got = (rule.uses(c.module, args, kwargs, out0, g0, B, wanted=frozenset(local)) if rule.wants_names
                       else rule.uses(c.module, args, kwargs, out0, g0, B))
            finally:
                swap_out(c.module)
            got = _mark_src(got, args, kwargs, g0, c.amp)
        if got is None:
            for n in local.values():
                fallback.setdefault(n, f"{rule.name} rule declined this call of {mname}")
            continue
        verified.add(i)
        for pn, c_name in local.items():
            if pn in got:
                uses.setdefault(c_name, []).append(got[pn])
            elif c_name not in fallback:
                fallback.setdefault(c_name, f"{rule.name} rule gave no factor for {mname}.{pn}")
    for c in calls:  # a flattened input traced through a layer that no rule verified: not traced
        unverified = [calls[j].mname for j in c.chain if j not in verified and getattr(calls[j].rule, "checks_call", False)]
        if c.rows and unverified:
            for n in ruled[c.module][2].values():
                fallback.setdefault(n, f"{type(c.module).__name__} ({c.mname}): its input, the batch flattened, "
                                       f"was traced through {unverified[0]}, whose rule did not check that call")
    # an expanded module a parameter of which falls back here (the probe, its rule declined, a use
    # outside its layer): nothing checks that expansion (the duplicated-example check below takes
    # the parameters on their rules), and the forward the other layers were captured in ran with it;
    # run again without expanding it (memoised per batch shape, as below)
    dropped = {c.mname: next(fallback[n] for n in ruled[c.module][2].values() if n in fallback)
               for c in calls if c.bcast and any(n in fallback for n in ruled[c.module][2].values())}
    if dropped:
        bad = {mn: f"its expanded (1, T, ...) or (T, ...) output could not stay on its rule ({why[:160]})"
               for mn, why in dropped.items()}
        col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo, check_broadcast,
                       loss_weights, {**no_expand, **bad}, check_order=False, paths=paths_again)
        _memo_expansions(probe_memo, dkey, bad, bad)
        return _apply_order(col, order, batch, probe_memo, params, okey)
    uses = {n: u for n, u in uses.items() if n not in fallback}
    spread = {c.mname: [n for n in ruled[c.module][2].values() if n in uses] for c in calls if c.bcast}
    spread = {mn: ns for mn, ns in spread.items() if ns}
    checked = probe_memo[dkey][0] if probe_memo is not None and dkey in probe_memo else frozenset()
    # expanded modules no gradient reached in this step: the forward that every other layer was
    # captured through ran with their outputs expanded, so that forward is checked now (the copies'
    # losses), their gradients when one reaches them
    fwd_ok = probe_memo.get(_fwd_key(dkey), frozenset()) if probe_memo is not None else frozenset()
    unreached = {c.mname for c in calls if c.bcast} - set(spread) - set(checked) - set(fwd_ok)
    if check_broadcast and ((spread and not set(spread) <= checked) or unreached):
        bad = _duplicates_disagree(loss_module, params, constants, batch, registry, overrides, uses,
                                   spread if not set(spread) <= checked else {}, probe_memo, dkey,
                                   avoid={c.lift for c in calls if c.lift}, forward_only=unreached, losses=losses,
                                   no_expand=no_expand)
        if bad:  # the forward itself ran with those outputs expanded (a sum(0) changes it): run again without
            col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo,
                           check_broadcast=False, loss_weights=loss_weights, no_expand={**no_expand, **bad},
                           check_order=False, paths=paths_again)
            return _apply_order(col, order, batch, probe_memo, params, okey)
    col = _Collected(losses.detach(), uses, fallback, owner)
    col.reached = reached[0]
    col.rng = rng_at[0]
    pgot = probe_memo.get(pkey) if pkey is not None else None
    # (only for a forward found to change the model's state, or a capture that changed a plain attribute, e.g. a
    # counter its gradient hook advanced, where some parameter falls back: another's capture may have run a one-time
    # setup, e.g. a lazily built layer, that the fallback must not run again; review of round 48: the fallback ran
    # from the counter the capture's backward had advanced, another path than the ruled parameters', 1.49 × 2C)
    moved = (settings_at[0] is not None and bool(fallback or (order is not None and order[0]))
             and bool(_settings_changed(model, settings_at[0], model_settings(model))))
    col.attrs = attrs_at[0] if (isinstance(pgot, _Probed) and pgot.stateful) or moved else None
    return _apply_order(col, order, batch, probe_memo, params, okey)


def _amp_off(fn):
    """``fn`` run with the caller's autocast off (``per_sample.amp``): the engine's own arithmetic
    inside the capture's checks (the example-order and duplicated-example checks compare norms to
    1e-3 or finer, below bf16's rounding), which run under the caller's autocast with the model."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with amp(amp_state(), False):
            return fn(*args, **kwargs)

    return run


@_amp_off
def _zero_use(u: Use, p: Tensor) -> bool:
    """Whether this use's per-example gradients are all exactly 0 (by their squared norms), but for
    non-finite ones: an example with a non-finite norm is dropped from the step, so contributes 0."""
    sq = _inner(u, u, p.shape, _acc(p.dtype))
    return not bool(((sq != 0) & sq.isfinite()).any())


def _rearm(probe_memo: Optional[Dict], okey, n: str) -> bool:
    """Whether the example-order check, which had stopped asking about parameter n for this batch shape (no
    gradient in its runs, ORDER_RETRIES times) or never asked (the check did not run in this step), is to ask on
    this step's batch (its count reset), at most ORDER_REARMS times a shape: a parameter the check's eval-mode runs
    never reach would otherwise have it run at every step."""
    if probe_memo is None or okey not in probe_memo:  # (its first check of the shape ran in this step)
        return False
    known, open_ = probe_memo[okey]
    count = open_.get(n)
    if count is None:
        # never asked about (no gradient ever reached it in the shape's steps: a task's head first used now,
        # review of round 51): asked now, unless the check ran in this step (some parameter still open)
        if n in known or not all(c >= ORDER_RETRIES for c in open_.values()):
            return False
    elif count < ORDER_RETRIES:
        return False
    done = probe_memo.get(("rearmed", okey), {})
    if done.get(n, 0) >= ORDER_REARMS:
        return False
    _memo_put(probe_memo, ("rearmed", okey), {**done, n: done.get(n, 0) + 1})
    for k in (okey, ("float32", okey)):
        if k in probe_memo:
            kn, op = probe_memo[k]
            _memo_put(probe_memo, k, (kn, {**op, n: 0}))
    return True


def _apply_order(col: "_Collected", order: Optional[Tuple[Dict[str, str], Set[str], Set[str], bool]], batch,
                 probe_memo, params: Params, okey) -> "_Collected":
    """The example-order check's verdicts on a step's uses: only parameters it checked and passed stay
    on their rules; one it found attributed wrongly, or could not decide (no gradient reached it in
    its eval-mode run), takes the exact fallback (undecided ones are checked again on later steps of
    this shape, up to ORDER_RETRIES times)."""
    if order is None:
        return col
    bad, passed, rounding, low_seen = order
    unseen = []
    B = batch_size(batch)
    col.passed = set(passed)
    f32eps = torch.finfo(torch.float32).eps
    for n in list(col.uses):
        if not low_seen and n not in bad and _use_eps(col.uses[n], params[n].dtype) > f32eps:
            # this step computed it in bf16 / fp16 (autocast entered inside loss_fn in this step only)
            # but the check's verdicts were taken without: the next step of this shape runs the check's
            # float32 run too (``_order_disagree``)
            _memo_put(probe_memo, ("low precision", okey), True)
            col.fallback.setdefault(n, "computed in bf16 / fp16 in this step, but the example-order check's verdicts "
                                       "for this batch shape were taken in float32 (autocast entered inside loss_fn "
                                       "in this step only?); checked again next step: exact fallback")
        elif n in bad:
            col.fallback.setdefault(n, bad[n])
        elif n in rounding:
            why = ("its gradient was zero but for rounding (or negligible) in the example-order check, but is "
                   "not negligible against the examples' norms over its clip group in this step: exact fallback")
            if params[n].dtype in (torch.float32, torch.float64):
                # decided by ``_settle_pending``, which knows the clip groups: on its rules only while
                # negligible against every example's norm over its group (a bound against C; being
                # zero but for rounding of its own terms is not one: its terms may be far larger
                # than the examples' norms)
                col.pending[n] = (why, _norm_and_bound(col.uses[n], params[n], B)[0])
                continue
            col.fallback.setdefault(n, "its gradient was zero but for rounding (or negligible) in the example-order "
                                       "check, which is checked each step in float32 / float64 only: exact fallback")
        elif n not in passed:
            unseen.append(n)
            if all(_zero_use(u, params[n]) for u in col.uses[n]):
                continue  # no gradient reaches it in this step either: its contributions are 0 wherever they go
            col.recheck = _rearm(probe_memo, okey, n) or col.recheck
            col.fallback.setdefault(n, "the example-order check could not verify it (no gradient reached it in "
                                       "its eval-mode run of this batch shape): exact fallback")
        else:
            continue
        col.uses.pop(n)
    # (the check's own failures, "the example-order check ... failed / could not verify", are not a
    # finding of mixing; said once per batch shape of a step, not every step: review of round 40)
    mixed = sorted(n for n, why in bad.items() if n in params and not why.startswith("the example-order check"))
    if mixed and not (probe_memo is not None and ("mixing said", okey) in probe_memo):
        _memo_put(probe_memo, ("mixing said", okey), True)
        # (review of round 40: a loss normalised by the batch's token count, or in-batch negatives, was
        # trained as each example's loss alone, with no word at run time)
        warn(f"book-keeping: the example-order check found the model or loss_fn mixing (or reordering) the "
             f"batch's examples for {len(mixed)} parameter(s) ({', '.join(mixed[:3])}{', ...' if len(mixed) > 3 else ''}): "
             "they take the exact vmap fallback, each example's gradient from its run alone (within C, as "
             "method='vmap'; slower, memory ∝ chunk × parameters). A loss that couples examples on purpose (in-batch "
             "negatives, a loss divided by the batch's token count) is then not the loss trained: per-example "
             "DP-SGD needs one loss per example that depends on that example alone. "
             "dp_step.fallback_reasons(batch) gives each reason")
    if unseen and probe_memo is not None:
        # (and the float32 run's verdicts, ``_order_disagree``)
        for k in (okey, ("float32", okey)):
            if k is not okey and k not in probe_memo:
                continue
            known, open_ = probe_memo.get(k, ({}, {}))
            new = {n: 0 for n in unseen if n not in known and n not in open_}
            if new:
                _memo_put(probe_memo, k, (known, {**open_, **new}))
    return col


# A (1, T, ...) output expanded to the batch (``Rule.broadcast_batch``, e.g. GPT-2's positions) gives
# example i the gradient that reaches row i of the copy; that is example i's own only if the model
# uses row i for example i alone, as a broadcast does (``tok + pos``). A model that reads the output
# otherwise (``pos[0]``: every example's gradient reaches row 0; ``pos.mean(0)``: every row gets the
# batch's mean; ``pos.sum(0)``, which also changes the forward) would have its examples' gradients
# mixed. Checked once per batch shape (in eval mode) on a batch of one example twice, [x_j, x_j],
# with the losses weighted 1 and 2: the second copy's per-example gradient must be exactly twice the
# first's (a power of two: exact in floating point, up to the kernels' row order; rtol below).
# ``pos[0]`` gives (3g, 0), ``mean(0)`` / ``sum(0)`` give equal rows: both fail. And the copies' losses
# must be the model's own (run without the expansion): a forward that reads the expanded shape fails.
# The same holds for
# batch-free (T, ...) outputs of (T,) ids (nanoGPT's ``wpe(arange(T))``), expanded to (B, T, ...);
# as those are expanded only when T ≠ B, the check then takes three copies (weights 1, 2, 1) if T = 2.
DUPLICATE_RTOL = 1e-4


def _memo_expansions(probe_memo: Optional[Dict], key, decided, bad: Mapping[str, str]) -> None:
    """Record under the duplicates key: the modules ``decided`` (checked) and those of them not to
    expand (``bad``, module name -> reason), added to what an earlier step of this shape found."""
    if probe_memo is not None:
        old = probe_memo.get(key, (frozenset(), {}))
        _memo_put(probe_memo, key, (old[0] | frozenset(decided), {**old[1], **bad}))


def _duplicates_key(loss_module: LossModule, batch: Batch, B: int):
    """The batch's shapes without its size: how a model reads an expanded output does not depend on B
    (a B-dependent misuse is not seen by the check either), and Poisson-sampled batches vary in B."""
    leaves, spec = tree_flatten(batch)
    return ("duplicates", loss_module.model.training, str(spec), tuple(_leaf_sig(x) for x in leaves))


def _duplicates_disagree(loss_module, params, constants, batch, registry, overrides, uses: Mapping[str, List[Use]],
                         spread: Mapping[str, List[str]], probe_memo, key, avoid: Set[int] = frozenset(),
                         forward_only: Set[str] = frozenset(), losses: Optional[Tensor] = None,
                         no_expand: Optional[Mapping[str, str]] = None, copies: Optional[int] = None) -> Dict[str, str]:
    """{module name: reason} for the expanded modules of ``spread`` (module name -> its parameters
    with uses) that the check above finds read otherwise; memoised per batch shape. ``avoid``: the
    lengths of the batch-free ids expanded (``_Call.lift``); the copies are as many as none of them
    (an expansion needs T ≠ B), two unless one is 2. ``forward_only``: expanded modules no gradient
    reached in this step: only the copies' losses are compared with the model's own (a forward
    that reads the expanded shape changes what every other layer is captured through, gradient or
    not); those that pass are memoised apart (``_fwd_key``), their gradients still to be checked. So
    are the modules of ``spread`` when every gradient through them is exactly 0 in this step (a
    zero-initialised gate, say). The forward-only comparison takes the example whose loss (``losses``,
    the step's) is largest in magnitude, and is memoised only if that loss is not 0 (a padding-only
    batch hides any change). ``no_expand``: the modules not expanded in the step (nor in the copies).
    ``copies``: at least that many (the check runs once more with one more copy where the copies' own
    capture sent a module to the fallback: a forward cut to the copied example's length, 2, had the
    position lookup's 2 rows taken for the copies' batch; review, round 50)."""
    m = copies or 2
    while m in avoid:
        m += 1
    why = ("its (1, T, ...) or (T, ...) output, expanded to the batch, is not used row by row: of copies of one "
           "example with losses weighted 1, 2, 1, ..., a copy's gradient was not its weight times the first's (does "
           "the model index or reduce that output over its first dimension?)")
    # the example: the one whose gradient through these modules in this step is largest (finite)
    score: Optional[Tensor] = None
    with amp(amp_state(), False):  # (the engine's arithmetic, not the model's: float32 under any autocast)
        for ns in spread.values():
            for n in ns:
                for u in uses.get(n, []):
                    t = _inner(u, u, params[n].shape, _acc(params[n].dtype))
                    score = t if score is None else score + t
    if score is not None:
        score = torch.where(torch.isfinite(score), score, torch.full_like(score, -1.0))
    fwd_memo = True
    if score is None or not bool((score > 0).any()):
        # no gradient reaches them in this step: their attribution does not matter now (asked again),
        # but the forward the other layers were captured through ran with them expanded
        seen = probe_memo.get(_fwd_key(key), frozenset()) if probe_memo is not None else frozenset()
        forward_only = set(forward_only) | (set(spread) - set(seen))
        if not forward_only:
            return {}
        spread, j = {}, 0
        if losses is not None:  # the example whose loss is largest: a zero (padding-only) loss shows nothing
            la = losses.detach().double().abs().reshape(-1)
            la = torch.where(torch.isfinite(la), la, torch.full_like(la, -1.0))
            j = int(la.argmax())
            fwd_memo = bool(la[j] > 0)
        else:
            fwd_memo = False
    else:
        j = int(score.argmax())
    idx = torch.full((m,), j)
    wts = 1.0 + (torch.arange(m) % 2).to(torch.float64)  # 1, 2, 1, 2, ...
    dup = select_examples(batch, idx)
    finite = True
    # in eval mode: dropout would give the copies different masks (and the check must not draw
    # from the user's random streams); how the model reads the expanded output is the same
    try:
        sub = _side_collect(loss_module, params, constants, dup, registry, overrides, probe_memo, wts,
                            no_expand=dict(no_expand or {}))
        # the forward with the outputs expanded must be the model's own: the copies' losses as without
        # the expansion (the same eval flags and random streams). With m ≠ T copies an expanded
        # output's shape differs from the model's (B for 1, or for T), so a forward that reads it
        # (``x / pos.shape[0]``, a reshape by it) shows here, which the gradients' ratios may not
        with _EvalFlags(loss_module.model), _own_rng(params, model=loss_module.model), torch.no_grad(), mha_fastpath_off(), \
                preserve_module_state(loss_module.model):
            plain = _plain_forward(loss_module, params, constants, dup)
    except Exception as err:  # a model that cannot run the copies: nothing is verified
        if isinstance(err, OOM_ERRORS):
            raise
        bad = {mn: f"the duplicated-example check of its expanded (1, T, ...) or (T, ...) output failed "
                   f"({type(err).__name__})"
               for mn in (*spread, *forward_only)}
    else:
        bad = {}
        got = sub.losses.detach().double().cpu()
        ref = plain.detach().double().cpu() if isinstance(plain, Tensor) else None
        if ref is None or ref.shape != got.shape or not bool(
                ((got == ref) | (got.isnan() & ref.isnan())
                 | ((got - ref).abs() <= DUPLICATE_RTOL * ref.abs().clamp_min(1.0))).all()):
            bad = {mn: ("expanding its (1, T, ...) or (T, ...) output to the batch changed the forward: with "
                        f"{m} copies of one example the losses differ from the model's own (does the model read that "
                        "output's shape?)") for mn in (*spread, *forward_only)}
        for mn, names in spread.items():
            if mn in bad:
                continue
            for n in names:
                if n in sub.fallback:
                    if copies is None:  # (once: its own lengths may have met the copies' number)
                        return _duplicates_disagree(loss_module, params, constants, batch, registry, overrides, uses,
                                                    spread, probe_memo, key, avoid, forward_only, losses, no_expand,
                                                    copies=m + 1)
                    bad[mn] = why + f" (with {m} copies it fell back: {sub.fallback[n]})"
                    break
                us = sub.uses.get(n, [])
                acc = _acc(params[n].dtype)
                G: Optional[Tensor] = None
                for u in us:
                    Gu = _materialise(u, params[n].shape, acc)  # (m, *shape)
                    G = Gu if G is None else G + Gu
                if G is None or not bool((G != 0).any()):  # its own gradient, non-zero in the step, is gone
                    bad[mn] = why
                    break
                if not bool(torch.isfinite(G).all()):  # undecided: fall back this time, ask again next time
                    bad[mn], finite = why + " (undecided: a non-finite gradient for the example tried)", False
                    break
                rtol = max(DUPLICATE_RTOL, 16 * _use_eps(us, params[n].dtype))
                want = wts.to(G)[(slice(None),) + (None,) * (G.dim() - 1)] * G[:1]  # (m, *shape)
                if bool((G - want).abs().max() > rtol * G.abs().max()):
                    bad[mn] = why
                    break
    if probe_memo is not None and finite:
        _memo_expansions(probe_memo, key, {*spread, *(mn for mn in forward_only if mn in bad)}, bad)
    if probe_memo is not None and forward_only and fwd_memo:
        fkey = _fwd_key(key)
        _memo_put(probe_memo, fkey, probe_memo.get(fkey, frozenset()) | {mn for mn in forward_only if mn not in bad})
    return bad


def _fwd_key(dkey):
    """Under the duplicates key: the expanded modules whose copies' losses were found the model's own
    in a step where no gradient reached them (their gradients not yet checked)."""
    return ("forward only",) + tuple(dkey)


# Example order. Book-keeping reads row b of a layer's (B, ...) input (or block b of a flattened
# one) as example b's. A model that reorders its batch inside the forward (sorts it by length,
# flips it) and restores the order afterwards breaks that for the layers in between. Checked once
# per batch shape (without B; memoised per parameter): the whole batch is run twice with module
# flags in eval mode (dropout masks would differ) and the same random streams: as it is, and
# permuted by a fixed derangement π (every example moves) with losses weighted 1, 2, 1, 2, ... by
# position; and each example alone, as in the naive loop (``ORDER_SINGLES``; through round 21, B
# copies of the example with the largest gradient, which missed mixing among the other examples):
# any batch statistic, a mean or a max, is then the example's own value, so order-free mixing,
# which a permutation leaves as it is, shows there. Each
# example's squared norm per parameter must be the same in every run up to its
# weight² (tolerance ``_order_rtol``: ORDER_RTOL, or ORDER_ULPS_CPU on the CPU; plus a floor of 8
# ulps of that parameter's largest squared norm, for rounding noise in tiny norms; a parameter zero but for rounding: ORDER_ROUNDING_ULPS; one
# negligible against every example's norm: ORDER_NEGLIGIBLE_ULPS).
# Undecided, not memoised: a parameter no gradient reached in this batch. A forward that draws
# random numbers (a noisy loss) is recognised by a repeat of the first run with other random
# streams, and is not checked. ``bk_options={"check_order": False}`` skips
# the check (for a model known not to reorder whose eval forward differs, say).
ORDER_RTOL = 1e-3  # float32 / float64 norms off the CPU or with reduced float32 math (CUDA's TF32 rounds at ~1e-3)
# float32 / float64 norms on the CPU at full float32 precision: the spread measured between the check's
# runs of float32 models that do not mix examples (every family of benchmarks/hf_zoo.py at B = 3, GPT-2-small
# at T = 128, BERT-base at B = 40) was at most 8 ulps of float32, but for gradients that cancel
# (``_within_rounding``). In float32's ulps for float64 models too: they may compute parts in float32
# (HF's OPT takes its attention softmax in float32; its key bias's gradient, zero but for that rounding,
# differed by 3.7e-10 between runs, 10⁶ float64 ulps)
ORDER_ULPS_CPU = 128
# (narrower parameters or factors, ``_use_eps``: 4 ulps of theirs)


def _cpu_full_precision(trees: Sequence[Any]) -> bool:
    """Whether every tensor of these pytrees is on the CPU and float32 math there is not reduced
    (``torch.get_float32_matmul_precision() == "highest"``, no oneDNN bf16 / tf32 math mode)."""
    if any(isinstance(x, Tensor) and x.device.type != "cpu" for t in trees for x in tree_flatten(t)[0]):
        return False
    try:
        if torch.get_float32_matmul_precision() != "highest":
            return False
        mk = torch.backends.mkldnn
        for sub in (torch.backends, mk, getattr(mk, "matmul", None), getattr(mk, "conv", None), getattr(mk, "rnn", None)):
            if getattr(sub, "fp32_precision", "none") not in ("none", "ieee"):
                return False
    except (AttributeError, RuntimeError):
        return False
    return True


def _order_rtol(eps: float, cpu_exact: bool) -> float:
    """The example-order check's relative tolerance for squared norms computed at rounding unit ``eps``."""
    if eps > torch.finfo(torch.float32).eps:
        return 4 * eps
    return ORDER_ULPS_CPU * torch.finfo(torch.float32).eps if cpu_exact else max(ORDER_RTOL, 4 * eps)
_LOW_PRECISION_CHECK = (
    "book-keeping's example-order check compared {n} parameter(s) ({first}, ...) at bf16 / fp16 rounding only "
    "(4 ulps), not float32's: its float32 run of the model (bf16 / fp16 parameters, buffers and inputs upcast, "
    "autocast's casts off) {why}. A model that mixes examples (a batch statistic) weakly enough is not "
    "detected at that rounding, and its examples' contributions may then exceed the clip bound (a review "
    "measured 1.5-10 % for such models under bf16). Let the forward run in float32 too (no dtype fixed inside "
    "it; with torch.utils.checkpoint, autocast around the step rather than inside loss_fn, or a float32 model), "
    "or use method='vmap', which needs no such check.")


@_amp_off
def _norm_and_bound(uses: List[Use], p: Tensor, B: int) -> Tuple[Tensor, Tensor]:
    """Each example's squared norm over these uses of p (B,), and the triangle bound
    Σ_uses Σ_t ‖L_t‖‖R_t‖ ≥ ‖G_i‖ (B,) (``_inner``'s bounds of the uses' self pairs; a use without
    one adds 0)."""
    acc = _acc(p.dtype)
    sq = torch.zeros(B, dtype=acc, device=p.device)
    bounds: Dict[int, Tensor] = {}
    for a in range(len(uses)):
        for b in range(a, len(uses)):
            t = _inner(uses[a], uses[b], p.shape, acc, bounds=bounds if a == b else None)
            sq = sq + (t if a == b else 2 * t)
    bnd = torch.zeros(B, dtype=acc, device=p.device)
    for u in uses:
        bnd = bnd + bounds.get(id(u), torch.zeros((), dtype=acc, device=p.device))
    return sq.clamp_min(0), bnd


def _amp_of(output: Any, args: Tuple[Any, ...] = ()) -> Optional[torch.dtype]:
    """The autocast dtype in force for the device type of a call's output (its first tensor: an
    attention layer returns a tuple) or else of its first tensor input, or None."""
    if isinstance(output, Tensor):
        dev = output.device.type
    else:
        cand = (list(output) if isinstance(output, (tuple, list)) else []) + list(args)
        t = next((x for x in cand if isinstance(x, Tensor)), None)
        dev = t.device.type if t is not None else "cpu"
    if _IN_FLOAT32_RUN.get():
        return None  # (``_Float32Run``: the flag is on, its casts are off)
    try:
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except (RuntimeError, TypeError, AttributeError, ValueError):  # (a device type autocast does not know)
        return None


def _mark_src(got: Optional[Dict[str, Use]], args: Tuple[Any, ...], kwargs: Mapping[str, Any],
              g: Optional[Tensor], amp: Optional[torch.dtype]) -> Optional[Dict[str, Use]]:
    """Each use of a call tagged with the narrowest floating dtype among the call's inputs, output
    gradient and autocast dtype (``Use.src``), for ``_use_eps``."""
    if not got:
        return got
    # (only a dtype narrower than float32 can widen ``_use_eps``: float32 / float64 calls are left untagged)
    narrow, eps = None, torch.finfo(torch.float32).eps
    for d in [t.dtype for t in (*args, *kwargs.values(), g) if isinstance(t, Tensor) and t.dtype in _LOW] + [amp]:
        if d is not None and torch.finfo(d).eps > eps:
            narrow, eps = d, torch.finfo(d).eps
    if narrow is not None:
        for u in got.values():
            if getattr(u, "src", 0) is None:
                u.src = narrow
    return got


def _use_eps(uses: List[Use], dtype: torch.dtype) -> float:
    """The rounding unit of what a parameter's per-example gradients were computed from: the
    parameter's dtype's, or a narrower captured factor's (a float32 model under bf16 autocast has
    bf16 activations and output gradients: its batched and single-example runs round apart by bf16's
    unit, not float32's)."""
    eps = torch.finfo(dtype).eps
    for u in uses:
        for t in (getattr(u, "L", None), getattr(u, "R", None), getattr(u, "G", None)):
            if isinstance(t, Tensor) and t.is_floating_point():
                eps = max(eps, torch.finfo(t.dtype).eps)
        src = getattr(u, "src", None)  # (``_mark_src``)
        if src is not None:
            eps = max(eps, torch.finfo(src).eps)
    return eps


def _example_norms(sub: "_Collected", params: Params, names: List[str], B: int,
                   bounds_out: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    """Each example's squared norm per parameter (B,); ``bounds_out``: filled with each one's
    triangle bound (``_norm_and_bound``)."""
    out = {}
    for n in names:
        out[n], bnd = _norm_and_bound(sub.uses.get(n, []), params[n], B)
        if bounds_out is not None:
            bounds_out[n] = bnd
    return out


# A parameter whose every per-example gradient, in both runs of the order check, is at most this many
# ulps of its triangle bound Σ_t ‖L_t‖‖R_t‖ (terms that cancel to rounding: an attention key's bias,
# which softmax ignores; measured at 0.3-0.9 ulps on BioGPT, where every other parameter is above
# 10⁶ ulps in float32 and 10¹⁵ in float64) is zero but for rounding, and rounding may differ between
# the runs: such a difference is not taken for a reordering. Only for float32 / float64 parameters
# (bf16 rounding would make this a large fraction of ordinary norms).
ORDER_ROUNDING_ULPS = 64


def _leaf_sig(x: Any):
    """A batch leaf in a memo key: a tensor's shape past the batch dim; a number, string or None by
    value; anything else by its type (its repr may change every step: an object's address)."""
    if isinstance(x, Tensor):
        return tuple(x.shape[1:]), x.dtype, x.device.type
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)  # a flag or a setting may change the model's path
    return type(x).__name__, len(x) if isinstance(x, (list, tuple)) else None


def _order_key(loss_module: LossModule, batch: Batch, params: Params, no_expand: Mapping[str, str]):
    """Per batch shape (without B), set of trained parameters (unfreezing more is a new check) and set
    of modules whose outputs are not expanded (the check's runs take the others' expansions)."""
    leaves, spec = tree_flatten(batch)
    # (and the precision the step runs in: the caller's autocast, the parameters' dtypes; verdicts
    # taken in float32 alone do not stand for a step under autocast, which also needs its float32 run)
    return ("order", loss_module.model.training, str(spec), tuple(_leaf_sig(x) for x in leaves), frozenset(params),
            frozenset(no_expand), amp_state(), frozenset(str(p.dtype) for p in params.values()))


ORDER_RETRIES = 8  # a parameter no gradient reached in the check is checked again on this many later steps
ORDER_REARMS = 2  # ... and asked again (``_rearm``) this many times a batch shape once a step's gradient reaches it


# The order check's verdict for a parameter that differed between its runs by rounding only
# (``ORDER_ROUNDING_ULPS``): not a pass. Each step re-checks it as it does a ``_NEGLIGIBLE`` one
# (``_settle_pending``): it stays on its rules while its gradient is negligible against every
# example's norm over its clip group, else that step takes the exact fallback for it: a gradient that
# cancels in the check's eval-mode runs need not cancel in training (dropout) or later (weights
# change), and "zero but for rounding of its own terms" bounds nothing against C (the terms
# Σ_t ‖a_t‖‖g_t‖ may be far larger than the example's norm; until round 20 that was the per-step test).
_ROUNDING = "rounding only"

# The verdict for a parameter that differed between the check's runs, in every example of both runs
# by at most ORDER_NEGLIGIBLE_ULPS ulps of the smallest example's norm over the checked parameters
# (float32 / float64): a gradient that cancelled *before* its layer (attention q / k / relative bias
# when every query sees one key, or equal keys and values), which its own triangle bound cannot
# see (the layer's output gradient is the rounding). Each step re-checks it (``_settle_pending``):
# it stays on its rules while its gradient is negligible against every example's norm over the
# passed parameters of its clip group, else that step takes the exact fallback; misattributing it
# then moves a row's clipped contribution by at most ORDER_NEGLIGIBLE_ULPS·eps·C_group
# (``_negligible``; a changed example, at most B rows). Like ``_ROUNDING`` and a reordering, it is never cleared to a pass by a later
# check: the check saw a difference, and a later batch may not reorder (all lengths equal, say).
_NEGLIGIBLE = "negligible"
# (measured on the T5 case that found this: 0.03-0.3 ulps; a branch behind a layer scale of 10⁻⁶,
# a real reordering of a small share, is ~8 ulps in float32 and is not taken for rounding)
ORDER_NEGLIGIBLE_ULPS = 4


def _is_reason(v: Optional[str]) -> bool:
    """A verdict that the parameter is attributed to another example (not passed, not rounding)."""
    return v is not None and v is not _ROUNDING and v is not _NEGLIGIBLE


def _order_verdicts(known: Mapping[str, Optional[str]]) -> Tuple[Dict[str, str], Set[str], Set[str]]:
    """(reordered: {name: reason}, passed, zero but for rounding or negligible: re-checked each step)."""
    return ({n: v for n, v in known.items() if _is_reason(v)},
            {n for n, v in known.items() if v is None},
            {n for n, v in known.items() if v is _ROUNDING or v is _NEGLIGIBLE})


def _negligible(sq: Tensor, others: Tensor, dtype: torch.dtype) -> bool:
    """Whether every example's squared norm ``sq`` (B,) of a parameter is at most
    ``ORDER_NEGLIGIBLE_ULPS`` ulps of the smallest example's norm over the other parameters
    (``others``, (B,) squared), squared; rows whose ``others`` is not finite are left out (the step
    drops them), and a non-finite ``sq`` where ``others`` is finite is not negligible (that row
    may hold another, finite example's gradient); float32 / float64 only. Then attributing that
    parameter's gradient of example j to row i adds at most min(1, C/‖G_i‖)·‖g_j‖ ≤
    ORDER_NEGLIGIBLE_ULPS·eps·C to row i's clipped contribution (so a changed example, which may
    move such gradients between up to B rows, at most B times that)."""
    if dtype not in (torch.float32, torch.float64):
        return False
    sq, others = sq.detach().double().cpu(), others.detach().double().cpu()
    keep = torch.isfinite(others)
    if not bool(keep.any()) or not bool(torch.isfinite(sq[keep]).all()):
        return False
    floor = float(others[keep].min())
    return floor > 0 and float(sq[keep].max()) <= (ORDER_NEGLIGIBLE_ULPS * torch.finfo(dtype).eps) ** 2 * floor


def _within_rounding(sq: Tensor, bnd: Tensor, dtype: torch.dtype) -> bool:
    """Whether every example's squared norm ``sq`` is at most ``ORDER_ROUNDING_ULPS`` ulps of its
    triangle bound ``bnd``, squared (terms that cancel: zero but for rounding); float32/float64
    parameters only; a non-finite example: no."""
    return dtype in (torch.float32, torch.float64) and bool(
        (sq <= (ORDER_ROUNDING_ULPS * torch.finfo(dtype).eps * bnd) ** 2).all())


def _settle_pending(col: "_Collected", params: Params, B: int,
                    clip_groups: Optional[Sequence[Sequence[str]]]) -> None:
    """Keep each of ``col.pending`` on its rules if its gradient in this step is negligible
    (``_negligible``) against every example's norm over the passed parameters of its clip group
    (the group whose norm sets its clip factor: what bounds the change a misattribution makes);
    else, or with the groups unknown, the exact fallback."""
    if not col.pending:
        return
    group_of = {n: tuple(g) for g in (clip_groups or ()) for n in g}
    floors: Dict[Tuple[str, ...], Tensor] = {}
    for n, (why, sq) in col.pending.items():
        g = group_of.get(n)
        if g is not None and g not in floors:  # each example's squared norm over the group's passed ones (B,)
            floors[g] = sum((_norm_and_bound(col.uses[m], params[m], B)[0].detach().double().cpu() for m in g
                             if m in col.passed and m in col.uses and m not in col.pending),
                            torch.zeros(B, dtype=torch.float64))  # (host: one read per group)
        if g is not None and _negligible(sq, floors[g], params[n].dtype):
            continue  # it moves each example's clipped contribution by at most rounding of C
        col.fallback.setdefault(n, why)
        col.uses.pop(n, None)
    col.pending = {}


def _all_rows_equal(batch: Batch, B: int) -> bool:
    """Whether every example of the batch is the same (each batched tensor's rows all equal row 0)."""
    leaves, _ = tree_flatten(batch)
    rows = [x for x in leaves if isinstance(x, Tensor) and x.dim() and x.shape[0] == B]
    return B > 1 and bool(rows) and all(bool((x == x[:1]).all()) for x in rows)


# The order check runs each example alone, as the naive loop does: up to ORDER_SINGLES of them per
# check (every example of a batch up to that size; of a larger one, the one with the largest
# gradient and a fixed random choice of the others). Mixing confined to examples outside the chosen
# ones is then not seen by that check (``pdpsgd.testing.check_sensitivity`` on the user's model is).
ORDER_SINGLES = 32


def _singles(tot: Tensor, B: int) -> Tensor:
    """The examples the order check runs alone (indices, int64): all of them (largest total
    squared norm ``tot`` first) when B <= ORDER_SINGLES, else that one and ORDER_SINGLES - 1 others
    drawn by a fixed generator."""
    k = int(tot.argmax())
    rest = [i for i in range(B) if i != k]
    if B > ORDER_SINGLES:
        gen = torch.Generator().manual_seed(54321 + B)
        rest = sorted(rest[j] for j in torch.randperm(B - 1, generator=gen)[:ORDER_SINGLES - 1].tolist())
    return torch.tensor([k] + rest, dtype=torch.long)


# Past ORDER_SINGLES, examples not run alone are still split apart: the batch also runs (through the
# engine, as run 1) as the rows and, separately, as the columns of a grid ⌈√B⌉ wide over a fixed
# random order of its examples. Two examples share a row and a column only if they are one, so any
# two are in different sub-batches of at least one of the two passes: a mixing confined to a group of
# examples (a pair, a group's mean) moves some member's norm in that pass, whichever the group is.


def _grid_splits(B: int) -> List[List[Tensor]]:
    """Two partitions of range(B) (int64 index tensors, each sorted): the rows and the columns of a
    grid ⌈√B⌉ wide over a fixed random order; any two examples are apart in at least one."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(24680 + B))
    m = math.isqrt(B - 1) + 1 if B > 1 else 1  # ⌈√B⌉
    rows = [order[i:i + m] for i in range(0, B, m)]
    cols = [order[c::m] for c in range(min(m, B))]
    return [[t.sort().values for t in part] for part in (rows, cols)]


def _alone_norms(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                 names: List[str], singles: Tensor, own_mode: bool = False) -> Dict[str, Tensor]:
    """{parameter: (len(singles),) squared norms}: the gradient of each chosen example's loss with
    that example alone (a batch of one), by plain autograd through the model's own forward (no rule,
    no capture: the naive loop's definition); module flags in eval mode (as they are, with dropout at
    rate 0, with ``own_mode``), forked random streams."""
    if not names:  # (no parameter on the rules in the check's capture: nothing to compare; round 53, Switch
        return {}  # Transformers' experts: torch.autograd.grad of no inputs raised, hiding the capture's reasons)
    leaves = {n: v.detach().requires_grad_(True) for n, v in params.items()}
    out: Dict[str, List[Tensor]] = {n: [] for n in names}
    with _EvalFlags(loss_module.model, keep=own_mode), torch.enable_grad():
        for i in singles.tolist():
            # (the backward inside the block too: a gradient hook that counts, say, is put back with the
            # attributes, so each example's run starts from the state the step's capture starts from; review of
            # round 48: it counted on from one example to the next, and the capture took another path than
            # the check's runs, 1.85 × 2C)
            with preserve_module_state(loss_module.model), _own_rng(params, 0, model=loss_module.model):
                loss = functional_call(loss_module, LossModule.prefixed({**constants, **leaves}),
                                       (slice_batch(batch, i, i + 1),))
                gs = (torch.autograd.grad(loss.sum(), [leaves[n] for n in names], allow_unused=True)
                      if loss.requires_grad else [None] * len(names))  # (no parameter reached: zeros)
            for n, g in zip(names, gs):
                acc = _acc(params[n].dtype)
                out[n].append(torch.zeros(1, dtype=acc, device=params[n].device) if g is None
                              else g.detach().to(acc).pow(2).sum().reshape(1))
    return {n: torch.cat(v) for n, v in out.items()}


def _draws_nothing(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                   first: Any) -> bool:
    """Whether the example-order check may run in the model's own mode, with torch's dropouts at rate 0
    (``DropoutOff``): some module is in training mode, and a forward of the batch there on forked random
    streams seeded 1 draws no random number (round 46) and gives the losses ``first`` that
    ``_watch_order``'s forward (seeded 0) gave, bitwise (NaN in the same places). Its runs then compare as in eval mode, and a batch statistic taken in
    training only (a hand-written batch normalisation) is seen (review, round 42: checked in eval mode
    only, such a model stayed on the rules, 1.43 C; round 43: also where the forward's only random
    numbers are torch's dropouts, which had sent it to eval mode). A forward that draws otherwise (a
    drop path's ``torch.rand``, a ``bernoulli_`` of its own, an LSTM's dropout between layers, a
    module's own generator) is checked in eval mode, as before: its draws would differ between the
    runs; since round 45 ``_mixes_under_same_draws`` then compares it in its own mode on the same draws."""
    model = loss_module.model
    if not isinstance(first, Tensor) or not any(m.training for m in model.modules()):
        return False
    with torch.enable_grad(), mha_fastpath_off(), preserve_module_state(model), _own_rng(params, 1, model=model), \
            DropoutOff():
        before = _streams(params, model)
        again = _detached(_plain_forward(loss_module, params, constants, batch, leaves=True))
        # (and it drew no random number at all, with torch's dropouts at rate 0, which draw none: round 46, a
        # LayerDrop that skipped its layer on seeds 0 and 1 alike gave the same losses, and the check's own-mode
        # runs never reached that layer, which then took the fallback on every step that ran it)
        if _drew(before, _streams(params, model)):
            return False
    return isinstance(again, Tensor) and first.shape == again.shape and (bool(torch.equal(first, again)) or (
        first.is_floating_point() and bool(torch.allclose(first, again, rtol=0, atol=0, equal_nan=True))))


def _mixes_under_same_draws(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor],
                            batch: Batch, B: int, first: Any, dropout: bool = False) -> Optional[str]:
    """For a training-mode forward that draws random numbers other than torch's dropouts (a drop path's
    ``torch.rand``, LayerDrop's, a ``bernoulli_`` of its own), which ``_draws_nothing`` sends to eval mode
    for the order check: whether a batch statistic taken in training only mixes its examples (round 45:
    it was unseen there, the documented limit of rounds 42-44). A forward of the same shape on the same
    forked streams draws the same numbers, so the batch with example 0 replaced by a copy of another
    (seed 0, torch's dropouts at rate 0, as ``_watch_order``'s ``first``) must leave every other
    example's loss as it was. Returns why not (those losses moved beyond rounding), or None: they did
    not, or the check cannot tell (the same batch run again differs: draws not from the forked
    streams, a generator kept outside the model say; no other example with another loss; losses not (B, ...); the two
    forwards leave the forked streams in different states, i.e. the number of draws follows the data, so the
    draws were not lined up). Losses only: mixing that shows in the backward alone is not seen here.

    ``dropout``: torch's dropouts as they are (not at rate 0), and ``first`` taken here, for a forward whose
    only draws are dropouts, whose order check runs with them at rate 0 (``_draws_nothing``): a forward that
    mixes examples only through what its dropouts drop (a dropped unit filled with the batch's mean) is unseen
    with nothing dropped (review, round 46: 4.46 C on one replaced example)."""
    seeded: List[Any] = []

    def losses(b: Batch) -> Tuple[Any, Tuple[Any, ...]]:  # (the losses, the forked streams as the forward left them)
        with torch.enable_grad(), mha_fastpath_off(), preserve_module_state(loss_module.model), \
                _own_rng(params, 0, model=loss_module.model), (contextlib.nullcontext() if dropout else DropoutOff()):
            seeded[:] = [_streams(params, loss_module.model)]
            out = _detached(_plain_forward(loss_module, params, constants, b, leaves=True))
            return out, _streams(params, loss_module.model)

    if dropout:
        first, drawn0 = losses(batch)
        if not _drew(seeded[0], drawn0):
            return None  # (it drew nothing: the check's own-mode runs saw this forward as it is)
    if not (isinstance(first, Tensor) and first.is_floating_point() and first.dim() >= 1 and first.shape[0] == B
            and B > 1):
        return None

    ref = first.detach().reshape(B, -1).double()
    again, drawn = losses(batch)
    if not (isinstance(again, Tensor) and again.shape == first.shape
            and bool(torch.equal(again.detach().reshape(B, -1).double().nan_to_num(0.0, 0.0, 0.0),
                                 ref.nan_to_num(0.0, 0.0, 0.0)))):
        return None  # (its draws are not the forked streams': the same batch gives other losses)
    fin = torch.isfinite(ref).all(1)
    other = [k for k in range(1, B) if bool(fin[k]) and not bool(torch.equal(ref[k], ref[0]))]
    if not bool(fin[0]) or not other:
        return None
    idx = torch.arange(B)
    idx[0] = other[0]
    moved, drawn_moved = losses(select_examples(batch, idx))
    if not isinstance(moved, Tensor) or moved.shape != first.shape or _drew(drawn, drawn_moved):
        # (review, round 45: a forward whose number of draws follows the data (a batch trimmed to its longest
        # row before a draw of its shape, rejection sampling, numpy draws per example's length) drew other numbers
        # for the replaced batch: not lined up, so the check cannot tell)
        return None
    got = moved.detach().reshape(B, -1).double()
    eps = torch.finfo(first.dtype).eps
    tol = _order_rtol(eps, _cpu_full_precision((params, constants, batch))) * torch.maximum(ref.abs(), got.abs()) \
        + 8 * eps * float(ref[fin].abs().max())
    rest = fin.clone()
    rest[0] = False
    if bool((((got - ref).abs() > tol).any(1) & rest).any()) or bool((rest & ~torch.isfinite(got).all(1)).any()):
        if dropout:
            return ("its training-mode forward changed other examples' losses when one example was replaced, on the "
                    "same dropout masks: it mixes examples through what its dropouts drop (e.g. a dropped unit filled "
                    "with the batch's mean), or the masks' layout follows the data (a dropout on packed sequences) "
                    "(exact fallback)")
        return ("its training-mode forward, which draws random numbers of its own (so the example-order check "
                "runs in eval mode), changed other examples' losses when one example was replaced, on the same "
                "random draws: a batch statistic taken in training only mixes examples, or the draws' layout "
                "follows the data (a dropout on packed sequences) (exact fallback)")
    return None


def _watch_order(loss_module: LossModule, params: Params, constants: Mapping[str, Tensor], batch: Batch,
                 B: int) -> Tuple[Optional[str], Any]:
    """One forward of the batch in the step's own mode (module flags as they are: a sort taken only
    in training is seen), in grad mode with the parameters as leaves as the capture runs (a forward that
    mixes examples only while gradients are on, ``torch.is_grad_enabled()``, is seen: review of round 48,
    2.2 × 2C with these forwards, ``_draws_nothing``'s and ``_mixes_under_same_draws``' without gradients;
    the graph is dropped with the losses), on forked random streams seeded 0, under ``ReorderWatch``:
    (where it selected or placed the batch's rows by a computed order, or None; its losses, for
    ``_draws_nothing``: so torch's dropouts run at rate 0 here, ``DropoutOff``)."""
    watch = ReorderWatch(B)
    with torch.enable_grad(), mha_fastpath_off(), preserve_module_state(loss_module.model), \
            _own_rng(params, 0, model=loss_module.model):
        with DropoutOff(), watch:  # (the watch innermost: it sees the model's own calls, not ours)
            losses = _detached(_plain_forward(loss_module, params, constants, batch, leaves=True))
    return watch.found, losses


_UNSEEN, _FRAGILE = object(), object()  # (draw-check memo: no verdict yet; verdicts kept per batch size)


def _rate(v: Any) -> Optional[float]:
    """A module's dropout rate attribute in a memo key (a number; anything else, a submodule say, None)."""
    return float(v) if isinstance(v, (int, float)) else None


def _one_network(col: "_Collected", loss_module: LossModule, params: Params, constants: Mapping[str, Tensor],
                 batch: Batch, B: int, overrides: Mapping[str, str], probe_memo: Optional[Dict]) -> None:
    """Every parameter to the exact fallback (``col.fallback``) when some take it, the model draws at
    random in its forward, and vmap's per-example draws would not be the batch's (``DrawWatch``: a
    dropout on a tensor without the batch dimension, as Funnel's on its position encodings or XLNet's
    on its relative positions). The fallback replays the capture's random streams (``_rng_replay``),
    which gives each example the batch forward's draws only where each draw is one per example on the
    batch's first dimension; else the ruled parameters' gradients would come from the batch forward's
    network and the fallback's from other dropout masks, an example's gradient not that of one network
    (review, round 38: Funnel's and XLNet's fallback sums 0.8-2.7 off the batch's gradient). All on the
    fallback, each example's gradient is that of one network, its own draws, as in ``method="vmap"``.
    Decided once per batch shape and modules' modes and dropout rates (per batch size too where B meets
    a fixed size of the batch or the parameters, or a draw's size), by one extra forward
    (without gradients, on forked random streams), only when some parameter takes the fallback."""
    if B < 2:
        return
    if not (col.fallback or (overrides and any(_forced(n, overrides, col) == "vmap" for n in params))):
        return
    # (per batch shape; per batch size too where the verdict rested on a size meeting B (a factory of B
    # rows), since under Poisson sampling B changes; per mode and dropout rate of each module: a module in eval mode may still draw, F.dropout's
    # training=True, and a rate set to 0 draws nothing; review, round 38)
    leaves, spec = tree_flatten(batch)
    key = ("draws", str(spec), tuple(_leaf_sig(x) for x in leaves), amp_state(),
           tuple((m.training, _rate(getattr(m, "p", None)), _rate(getattr(m, "dropout", None)))
                 for m in loss_module.model.modules()))
    memo = probe_memo if probe_memo is not None else {}
    hit = memo.get(key, _UNSEEN)
    if hit is _FRAGILE:  # (the verdict at another B rested on a size meeting that B: per B here)
        key = key + (B,)
        hit = memo.get(key, _UNSEEN)
    if hit is not _UNSEEN:
        found = hit
    else:
        fixed = {int(d) for x in leaves if isinstance(x, Tensor) for d in x.shape[1:]}
        fixed |= {int(d) for p in params.values() for d in p.shape}
        watch = DrawWatch(B, batch, fixed)
        try:
            with torch.no_grad(), mha_fastpath_off(), preserve_module_state(loss_module.model), \
                    _own_rng(params, 0, model=loss_module.model):
                with watch:
                    _plain_forward(loss_module, params, constants, batch)
            found = watch.found
            if watch.fragile and len(key) == 5:  # (the shape's verdict says "per B"; this B's is kept beside it)
                _memo_put(probe_memo, key, _FRAGILE)
                key = key + (B,)
        except Exception as err:  # (the capture's forward ran: this one should; if not, the safe side)
            if isinstance(err, OOM_ERRORS):
                raise
            found = f"the random-draw check's forward failed ({type(err).__name__}: {str(err)[:120]})"
        _memo_put(probe_memo, key, found)
        if found:
            warn(f"book-keeping: some parameters take the exact vmap fallback and the model may draw at random "
                 f"where vmap's per-example draws are not the batch's ({found}), so every parameter "
                 "takes the fallback (each example's gradient from one network, as method='vmap'; slower, and "
                 "memory ∝ chunk × parameters). Faster: model.eval() or p=0 for that dropout, or rules for the "
                 "fallback's layers (dp_step.fallback_reasons(batch) names them).")
    if found:
        for n in params:
            col.fallback.setdefault(n, f"the model draws at random where vmap's per-example draws are not the "
                                       f"batch's ({found}) and other parameters take the fallback")


class _CheckRunFailed(Exception):
    """The example-order check's float32 run failed (``_order_disagree``)."""


# Set while the example-order check's float32 run takes the model (``_Float32Run``): a call's
# autocast flag then casts nothing (``_amp_of``).
_IN_FLOAT32_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("pdpsgd_float32_run", default=False)
_DISABLE_AUTOCAST = getattr(torch._C, "_DisableAutocast", None)


class _Float32Run(torch.overrides.TorchFunctionMode):
    """Every torch call of the block run with autocast's casts excluded (``torch._C._DisableAutocast``,
    per call: an autocast region entered inside ``loss_fn`` turns them on again at its entry). The
    autocast flags stay as they are, so a model that branches on ``torch.is_autocast_enabled`` takes
    its autocast path, in the precision of its tensors."""

    def __enter__(self):
        self._token = _IN_FLOAT32_RUN.set(True)
        return super().__enter__()

    def __exit__(self, *exc):
        _IN_FLOAT32_RUN.reset(self._token)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with _DISABLE_AUTOCAST():
            return func(*args, **(kwargs or {}))


def _upcast(x: Any) -> Any:
    """A bf16 / fp16 tensor as a float32 copy (detached); anything else as it is."""
    return x.detach().float() if isinstance(x, Tensor) and x.dtype in _LOW else x


def _has_low(*trees: Any) -> bool:
    """Whether any tensor in these pytrees is bf16 / fp16."""
    return any(isinstance(x, Tensor) and x.dtype in _LOW for t in trees for x in tree_flatten(t)[0])


def _order_disagree(loss_module, params, constants, batch, registry, overrides, probe_memo,
                    no_expand, key) -> Tuple[Dict[str, str], Set[str], Set[str], bool]:
    """({parameter: reason} found attributed to another example, {parameters checked and passed},
    {parameters that differed by rounding only: re-checked each step}, whether it knew the model
    computes in bf16 / fp16 (``_apply_order`` sends a parameter computed so in a step whose check did
    not know it to the fallback)); the step trusts only the
    passed ones and the rounding-only ones that are still so (anything else: exact fallback).
    Memoised per batch shape (without B): (verdicts, undecided parameters with the number of checks
    they went through).

    A model that computes in bf16 / fp16 (the caller's autocast around the step, autocast entered
    inside ``loss_fn``, bf16 / fp16 parameters, buffers or inputs) is also checked in a float32 run:
    those tensors upcast, autocast's casts off (``_Float32Run``; the autocast flags stay on, so its
    autocast code path is taken). Whether a model mixes examples does not depend on the precision it
    computes in, and in float32 the check compares at float32's rounding (``_order_rtol``: 1.5e-5 on
    the CPU, 1e-3 elsewhere), not bf16's (~3 % of a squared norm plus a floor of ~6 % of the batch's
    largest): at bf16's rounding a model adding 5 % of the batch mean before a LayerNorm passed and
    exceeded the bound by 1.5 % under autocast (review of round 27), and a bf16 model adding 20 % by
    up to 4.4 % (review of round 28). A parameter stays on its rules only if both runs passed it: one
    that mixes only in the low precision (a branch on its tensors' dtype, a batch-wide overflow guard
    for fp16) is still seen in the run as the step runs where it moves the norms past bf16's
    tolerance. When the float32 run fails (a forward that fixes a dtype of its own; a checkpointed
    one under the caller's autocast is run again with it off), the check compares at bf16 / fp16
    rounding alone and warns (``_LOW_PRECISION_CHECK``)."""
    rest = (registry, overrides, probe_memo, no_expand)
    memo: Dict = probe_memo if probe_memo is not None else {}
    lkey, fkey, xkey = ("low precision", key), ("float32", key), ("float32 failed", key)
    why = memo.get(xkey, "could not run: this torch has no torch._C._DisableAutocast")

    def float32_run() -> Tuple[Optional[Tuple[Dict[str, str], Set[str], Set[str]]], List[str]]:
        nonlocal why
        if xkey in memo or _DISABLE_AUTOCAST is None:
            return None, []
        try:
            p32, c32, b32 = ({n: _upcast(v) for n, v in params.items()}, {n: _upcast(v) for n, v in constants.items()},
                             tree_map(_upcast, batch))
            state = amp_state()
            for flags_on in ((True, False) if state else (True,)):
                saved = _module_attrs(loss_module.model)
                try:
                    with amp(state, flags_on), _Float32Run():
                        return _order_runs(loss_module, p32, c32, b32, *rest, fkey, raise_failed=True)
                except _CheckRunFailed:
                    # with the caller's autocast flags on, a checkpointed forward's recomputation inside
                    # the backward (which the mode does not see) casts again and fails torch's checkpoint
                    # check: run again with them off (a forward that mixes only while autocast is on is
                    # then left to the run as the step runs)
                    if not flags_on or not state:
                        raise
                finally:
                    _restore_attrs(saved)  # (a cache the float32 run built would be float32 in the step)
        except (_CheckRunFailed, *OOM_ERRORS) as err:  # (out of memory: the float32 copies; not tried again)
            cause = err.__cause__ if isinstance(err, _CheckRunFailed) else err
            why = f"failed ({type(cause).__name__}: {str(cause)[:120]})"
            return None, []

    low = bool(amp_state()) or _has_low(params, constants, batch) or lkey in memo
    f32, loose32 = float32_run() if low else (None, [])
    run, loose = _order_runs(loss_module, params, constants, batch, *rest, key)
    if loose and not low:  # (autocast entered inside loss_fn: found by the run, remembered per shape)
        _memo_put(probe_memo, lkey, True)
        f32, loose32 = float32_run()
    if f32 is None and loose is not None and (low or loose) and xkey not in memo and _DISABLE_AUTOCAST is not None:
        # the float32 run failed where the run as the step runs did not: a forward that needs its low
        # precision, not a batch that fails (that one is asked again with the next batch)
        _memo_put(probe_memo, xkey, why)
    if f32 is not None:
        if loose32:
            why = "still computed them in bf16 / fp16 (a dtype fixed inside the forward)"
            warn(_LOW_PRECISION_CHECK.format(n=len(loose32), first=loose32[0], why=why))
        return (*_both_passed(f32, run), True)
    if loose:
        warn(_LOW_PRECISION_CHECK.format(n=len(loose), first=loose[0], why=why))
    return (*run, low or bool(loose))


def _both_passed(a: Tuple[Dict[str, str], Set[str], Set[str]],
                 b: Tuple[Dict[str, str], Set[str], Set[str]]) -> Tuple[Dict[str, str], Set[str], Set[str]]:
    """Two example-order verdicts combined: found reordered by either (its reason); passed by both;
    passed or rounding-only in both, one of them rounding-only: rounding-only; else undecided."""
    bad = {**b[0], **a[0]}
    ok_a, ok_b = a[1] | a[2], b[1] | b[2]
    passed = (a[1] & b[1]) - set(bad)
    rounding = ((ok_a & ok_b) - passed) - set(bad)
    return bad, passed, rounding


def _order_runs(loss_module, params, constants, batch, registry, overrides, probe_memo,
                no_expand, key, raise_failed: bool = False
                ) -> Tuple[Tuple[Dict[str, str], Set[str], Set[str]], Optional[List[str]]]:
    """(``_order_disagree``'s verdicts in the precision the model runs in here, the parameters this
    call compared at bf16 / fp16 rounding (``_use_eps``), or None when its runs failed);
    ``raise_failed``: a failing run raises ``_CheckRunFailed`` (instead of sending every parameter to
    the fallback)."""
    B = batch_size(batch)
    known, open_ = probe_memo.get(key, ({}, {})) if probe_memo is not None else ({}, {})
    if key in (probe_memo or {}) and all(c >= ORDER_RETRIES for c in open_.values()) and _CHECK_REPLAY.get() is None:
        return _order_verdicts(known), []
    gen = torch.Generator().manual_seed(12345 + B)
    pi = torch.randperm(B, generator=gen)
    while bool((pi == torch.arange(B)).any()):  # a derangement (B ≥ 2): every example moves
        pi = torch.randperm(B, generator=gen)
    w2 = 1.0 + (torch.arange(B) % 2).to(torch.float64)
    perm = select_examples(batch, pi)
    why = ("its per-example norms changed when the batch was permuted, or when an example was run alone "
           "(each example's own, up to its loss weight, should not): does the model reorder the batch or "
           "mix examples inside its forward or loss? (exact fallback)")

    own = False  # (the module flags of the runs below: ``_draws_nothing``)

    def run(b, w, seed):
        return _side_collect(loss_module, params, constants, b, registry, overrides, probe_memo, w, no_expand, seed,
                             own_mode=own)

    if _all_rows_equal(batch, B):
        # every example the same: no mixing could show (a mean over copies is each one's own value);
        # nothing is decided, so the step takes the exact fallback and the next batch is asked again
        return _order_verdicts(known), []
    bnd1: Dict[str, Tensor] = {}
    bnd2: Dict[str, Tensor] = {}
    cpu_exact = _cpu_full_precision((params, constants, batch))
    try:
        reordered, losses = _watch_order(loss_module, params, constants, batch, B)
        own = _draws_nothing(loss_module, params, constants, batch, losses)
        # (own: only torch's dropouts draw, and the runs take them at rate 0; compared here with them dropping)
        mixed = (None if not any(m.training for m in loss_module.model.modules())
                 else _mixes_under_same_draws(loss_module, params, constants, batch, B, losses, dropout=own))
        del losses
        s1 = run(batch, torch.ones(B, dtype=torch.float64), 0)
        names = sorted(s1.uses)
        n1, fb1 = _example_norms(s1, params, names, B, bnd1), dict(s1.fallback)
        eps_of = {n: _use_eps(s1.uses.get(n, []), params[n].dtype) for n in names}  # (the compute precision)
        loose = [n for n in names if eps_of[n] > torch.finfo(torch.float32).eps]
        del s1  # (one pass's captures alive at a time)
        s2 = run(perm, w2, 0)
        n2, fb2 = _example_norms(s2, params, names, B, bnd2), dict(s2.fallback)
        del s2
        # each example alone (a batch of one: ``_singles`` picks them, the one with the largest
        # gradient first), as in the naive loop: any batch statistic (a mean, a max, a count, a
        # group's mean, in-batch negatives) is then the example's own value, so a forward or loss
        # that mixes examples in an order-free way, which a permutation leaves as it is, moves the
        # norms of the examples it mixes, whichever they are
        tot = sum((n1[n].detach().double().cpu().nan_to_num(0.0, 0.0, 0.0) for n in names),
                  torch.zeros(B, dtype=torch.float64))
        singles = _singles(tot, B)
        n3 = _alone_norms(loss_module, params, constants, batch, names, singles, own_mode=own)
        # (no rule ran alone: an example's terms are bounded as in run 1, for the rounding exemption)
        bnd3 = {n: bnd1[n].index_select(0, singles.to(bnd1[n].device)) for n in names}
        # past ORDER_SINGLES, the batch split apart twice (``_grid_splits``): each pass's norms and
        # bounds (B,), and the parameters it could not see (a fallback in a sub-batch: a size that
        # meets a model dimension, say; that pass then says nothing of them)
        splits: List[Tuple[Dict[str, Tensor], Dict[str, Tensor], Set[str]]] = []
        for part in (_grid_splits(B) if B > ORDER_SINGLES else []):
            sq = {n: torch.zeros_like(n1[n]).detach() for n in names}
            bd = {n: torch.zeros_like(bnd1[n]).detach() for n in names}
            blind: Set[str] = set()
            for idx in part:
                sub = select_examples(batch, idx)
                s = run(sub, torch.ones(len(idx), dtype=torch.float64), 0)
                sb: Dict[str, Tensor] = {}
                ns = _example_norms(s, params, names, len(idx), sb)
                blind |= set(s.fallback) | {n for n in names if n not in s.uses}
                del s
                for n in names:
                    sq[n][idx.to(sq[n].device)] = ns[n].detach().to(sq[n])
                    bd[n][idx.to(bd[n].device)] = sb[n].detach().to(bd[n])
            splits.append((sq, bd, blind))
    except Exception as err:  # e.g. a loss_fn that fails on the eval-mode forward: nothing is verified
        if isinstance(err, OOM_ERRORS):
            raise
        if raise_failed:
            raise _CheckRunFailed() from err
        # (not memoised: a batch whose loss fails, a corrupt label say, must not decide later ones)
        msg = str(err)
        hint = ("; the check runs the batch in another order, which pack_padded_sequence(enforce_sorted=True) "
                "refuses: pass enforce_sorted=False (the same result, sorted inside)") \
            if "must be sorted" in msg else ""  # (review, round 37: the reason was buried in torch's text)
        return ({n: ("the example-order check (eval-mode forward) failed: "
                    f"{type(err).__name__}: {msg[:120]}{hint}; bk_options={{'check_order': False}} skips it")
                for n in params}, set(), set()), None

    def differ(x: Tensor, y: Tensor, n: str) -> Tensor:  # per example, beyond rounding
        eps = eps_of.get(n, torch.finfo(params[n].dtype).eps)
        fin = torch.isfinite(x) & torch.isfinite(y)  # (a non-finite example is dropped by the step anyway)
        top = torch.where(fin, torch.maximum(x, y), torch.zeros_like(x)).max()
        return fin & ((x - y).abs() > _order_rtol(eps, cpu_exact) * torch.maximum(x, y) + 8 * eps * top)

    def rounding_only(n: str) -> bool:  # every example's gradient, in every run, cancels to rounding
        return all(_within_rounding(sq, bd, params[n].dtype)
                   for sq, bd in ((n1[n], bnd1[n]), (n2[n], bnd2[n]), (n3[n], bnd3[n]))
                   + tuple((sp[n], bp[n]) for sp, bp, blind in splits if n not in blind))

    agree: List[str] = []  # checked parameters whose norms agree between the runs
    totals: List[Tensor] = []  # each example's squared norm over them, run 1 and run 2 (unweighted)

    def negligible(n: str) -> bool:  # in every run, against the smallest example's norm
        w = (w2 * w2).double()
        if not totals:
            totals.extend(sum((norms[m].detach().double().cpu() for m in agree),
                              torch.zeros(len(norms[names[0]]), dtype=torch.float64))
                          for norms in (n1, n2, n3) + tuple(sp for sp, _, _ in splits))
            totals[1] = totals[1] / w
        return all(_negligible(sq, tot, params[n].dtype) for sq, tot in (
            (n1[n], totals[0]), (n2[n].detach().double().cpu() / w, totals[1]), (n3[n], totals[2]))
            + tuple((sp[n], totals[3 + k]) for k, (sp, _, blind) in enumerate(splits) if n not in blind))

    res: Dict[str, Optional[str]] = {}
    differed: List[str] = []
    for n in names:
        if n in fb1 or n in fb2:
            res[n] = f"the example-order check could not verify it: {fb1.get(n) or fb2.get(n)}"
            continue
        a = n1[n].index_select(0, pi.to(n1[n].device))  # example π[p]'s norm, run 1
        b = n2[n] / (w2 * w2).to(n2[n])  # slot p of run 2 holds example π[p]
        if not bool((torch.isfinite(a) & (a > 0)).any()):
            continue  # undecided: no finite gradient reached it in this batch; asked again
        a3 = n1[n].index_select(0, singles.to(n1[n].device))  # the examples run alone, run 1
        b3 = n3[n].to(a3)
        moved = bool(differ(a, b, n).any())
        if not moved and bool((torch.isfinite(a3) & ~torch.isfinite(b3)).any()):
            # finite in the batch, not finite alone (a std over one row, in-batch negatives over
            # none): the batch's value is not the example's own (``differ`` skips non-finite rows)
            res[n] = why
            continue
        for sp, _, blind in splits:  # the batch split apart (B > ORDER_SINGLES), as alone
            if not moved and n not in blind and bool((torch.isfinite(n1[n]) & ~torch.isfinite(sp[n])).any()):
                res[n] = why
                break
            moved = moved or (n not in blind and bool(differ(n1[n], sp[n], n).any()))
        if n in res:
            continue
        if not moved and bool(differ(a3, b3, n).any()):
            # only the examples alone differ: not a mixing where the gradient, in the batch's runs and
            # alone, is zero but for rounding of its own terms (an attention key's bias, whose
            # gradient cancels; a batch of one may take another attention kernel, with other
            # rounding): mixing moves it by rounding only. (Alone it has no triangle bound of its
            # own: the batch's, of the same example, stands in, in all three runs.)
            moved = not rounding_only(n)
        if moved:
            differed.append(n)
        else:
            res[n] = None
            agree.append(n)
    for n in differed:
        res[n] = _ROUNDING if rounding_only(n) else _NEGLIGIBLE if negligible(n) else why
    if any(_is_reason(v) for v in res.values()):
        # a forward that draws random numbers differs from itself (beyond rounding: kernels that
        # are not bitwise reproducible do not count): not a reordering; the check cannot tell
        s1b = run(batch, torch.ones(B, dtype=torch.float64), 1)
        n1b = _example_norms(s1b, params, [n for n, v in res.items() if _is_reason(v)], B)
        del s1b
        for n, v in n1b.items():
            if bool(differ(v, n1[n], n).any()):
                res[n] = None  # random: trusted, as without the check (README)
    if mixed is not None:  # (after the randomness exemption above: this comparison drew the same numbers)
        for n in names:
            if not _is_reason(res.get(n)):
                res[n] = mixed
    if reordered is not None:
        # ordered by a computed index: whatever this batch's norms showed (its order may be the
        # identity: every length equal), another batch of this shape may be reordered. Every layer
        # (before the op too: it may be the restore of an order the watch did not see; a broadcast
        # output computed before it is read after it), which costs the fallback little more: one
        # parameter on it runs the whole model per example anyway
        sorted_why = (f"the forward reorders the batch's rows by a computed index ({reordered}): book-keeping reads "
                      "row b as example b's, which a batch in another order breaks, even where this batch's order "
                      "is the identity (exact fallback)")
        for n in names:
            if not _is_reason(res.get(n)):
                res[n] = sorted_why
    # a parameter once seen to differ stays so: a later batch that happens not to show it (re-checked
    # because other parameters were undecided) must not clear the verdict; only a reordering found
    # later replaces a rounding-only or negligible one
    known = {**known, **res, **{n: v for n, v in known.items()
                                if v is not None and not (_is_reason(res.get(n)) and not _is_reason(v))}}
    undecided = {n: open_.get(n, 0) + 1 for n in set(names) | set(open_) if n not in res}
    if probe_memo is not None:
        _memo_put(probe_memo, key, (known, undecided))
    return _order_verdicts(known), loose


@dataclass
class _Probed:
    """The batch-dimension probes of one batch shape (memoised): for each module, the distinct lists
    of its calls' records that the probes saw (``_probe_first_dims``), one per alternative, each with
    the size of the probe that saw it (``Bp``, or B + 1 for a whole-batch probe)."""

    Bp: int
    alts: Dict[str, List[Tuple[Any, ...]]]
    runs: int = 0  # probes run (each on its own seed after the first)
    drew: bool = False  # the first probe's forward drew random numbers (others may see other calls)
    stateful: bool = False  # a probe's forward changed the model's state: probed from the capture's at every step
    counters: bool = False  # ... its modules' plain attributes: the example-order check runs at every step too
    wholes: Set[Any] = field(default_factory=set)  # the paths a whole-batch probe ran on (``_check_batch_dims``)
    # each distinct probe's records of every module (probe size, {module name: records}, the input shapes of the
    # capture it was run for {module name: shapes}, whether it was a whole-batch probe): whether that probe took
    # the batch's path (``_check_batch_dims``)
    runs_seen: List[Tuple[int, Dict[str, Tuple[Any, ...]], Dict[str, Tuple[Any, ...]], bool]] = \
        field(default_factory=list)
    # a probe was found off the path of a batch of this shape, or a capture of the shape had other call shapes
    # than one a probe was run for: the forward's shapes depend on the batch's values (a forward cut to its
    # longest example); then only a whole-batch probe run for a capture of the very same shapes confirms a call
    varies: bool = False

    # (``_check_batch_dims``: per capture's call shapes, the indices of the runs on its path; cleared as runs come)
    path_memo: Dict[Any, Tuple[int, ...]] = field(default_factory=dict)

    def add(self, seen: Mapping[str, List[Tuple[Any, ...]]], Bp: int, origin: Mapping[str, Tuple[Any, ...]],
            whole: bool) -> None:
        mine = {}
        for mn, recs in seen.items():
            got = self.alts.setdefault(mn, [])
            t = tuple(recs)
            have = next((a for a in got if a == (Bp, t)), None)
            if have is None:
                have = (Bp, t)
                got.append(have)
            mine[mn] = have[1]  # (the alternative's own tuple: ``_check_batch_dims`` matches runs by identity)
        run = (Bp, mine, dict(origin), whole)
        if run not in self.runs_seen:
            self.runs_seen.append(run)
            self.path_memo.clear()

    def matching(self, mname: str, sites: Sequence[Any]) -> List[Tuple[int, Tuple[Any, ...]]]:
        """The module's alternatives (probe size, records) whose calls came from the capture's call
        sites, in order."""
        return [(bp, a) for bp, a in self.alts.get(mname, ())
                if len(a) == len(sites) and all(r[3] == x for r, x in zip(a, sites))]


def _check_batch_dims(loss_module, params, constants, batch, ruled, B, calls, real_dims, real_sites, fallback,
                      probe_memo, registry, replay: Optional[Tuple[Any, Any]] = None,
                      real_shapes: Optional[Mapping[str, List[Any]]] = None) -> Set[str]:
    """Send to the vmap fallback every parameter of a call whose input's first dimension equals B
    but did not follow the probe's batch size (see ``PROBE_B``), or that was read as time-major and
    whose second dimension did not. Returns {(module name, kind)} to run again read otherwise instead
    (``_Call.retry``; every call of the module one whose first dim stayed B in the probe, and for
    "time" whose second dim followed it).

    A call is compared with the probe's calls of its module from the same call sites (``_call_site``),
    and confirmed only if every such alternative the probes saw confirms it; none: not confirmed. A
    forward that changes the model's state (``_Probed.stateful``) is probed again at every step from
    the state the capture began in (``replay``: ``_rng_now`` and ``_module_attrs`` then; without it, the
    step's calls are not confirmed)."""
    todo = [c for c in calls if (c.capture is None or getattr(c.rule, "batch_axis", None) is not None)
            and c.pick is None and (real_dims[c.mname][c.k] == B or (c.rows and B > 1) or c.bcast and c.lift or c.bdim or c.retry)
            and not all(n in fallback for n in ruled[c.module][2].values())]
    if not todo:
        return set()
    # (the ruled modules are part of the key: a probe only records the modules ruled when it ran)
    key = ((_probe_key(batch, B, loss_module.model.training), tuple(sorted(v[0] for v in ruled.values())))
           if probe_memo is not None else None)
    got = probe_memo.get(key) if key is not None else None
    grew = False

    def probe_more(seed: Optional[int], again: Optional[Tuple[Any, Any]] = None, whole: bool = False) -> Optional[str]:
        # one more probe into ``got`` (``again``: from the capture's state); its error, if any
        Bp_, seen_, drew_, stateful_ = _probe_first_dims(loss_module, params, constants, batch, ruled, B, registry,
                                                         seed, again, whole)
        got.runs += again is None
        if isinstance(seen_, str):
            return seen_
        got.drew = got.drew or (seed is None and again is None and drew_)
        if stateful_ and not got.stateful:
            attrs = [w for w in stateful_ if not w.startswith("(")]
            warn(_STATEFUL.format(what=", ".join(stateful_[:3]),
                                  order=" (and runs its example-order check again)" if attrs else ""))
        got.stateful = got.stateful or bool(stateful_)
        got.counters = got.counters or any(not w.startswith("(a generator") for w in stateful_)
        got.add(seen_, Bp_, {mn: tuple(v) for mn, v in shapes.items()}, whole)
        return None

    shapes = real_shapes or {}
    sig: List[Any] = []

    def signature() -> Any:  # (the capture's calls' input shapes, every module's)
        if not sig:
            sig.append(tuple(sorted((mn, tuple(v)) for mn, v in shapes.items())))
        return sig[0]

    def same_shapes(origin: Mapping[str, Tuple[Any, ...]], exact: bool) -> bool:
        # whether the capture a probe was run for called the modules to be confirmed with this one's input shapes
        # (a module called another number of times, LayerDrop's, is not compared unless ``exact``)
        for mn in need:
            o, cur = origin.get(mn), tuple(shapes.get(mn, ()))
            if o != cur and (exact or (o is not None and len(o) == len(cur))):
                return False
        return True

    failed: Optional[str] = None
    if got is None:
        got, grew = _Probed(PROBE_B if B != PROBE_B else PROBE_B + 1, {}), True
        failed = probe_more(None)
        if failed is None and got.drew:  # draws may send the forward down other paths: more seeds
            for seed in range(1, 1 + PROBE_DRAWS):
                probe_more(seed)
    if failed is None and got.stateful:  # the path may depend on the state: probed from the capture's
        if replay is None:
            failed = ("the forward changes the model's state (a counter attribute, a generator it holds), and the "
                      "state this capture began in was not kept")
        else:
            failed, grew = probe_more(None, replay), True
    matched: Dict[str, List[Tuple[int, Tuple[Any, ...]]]] = {}  # (each module's, once per step: cleared when a probe adds some)

    need = {c.mname for c in todo} | {r[0] for c in todo if c.rows for r in c.roots}
    misread = any(c.bcast and c.retry == "time" for c in todo)
    lifted = {(c.mname, c.k) for c in todo if c.lift}

    def agrees(mname: str, k: int, probe: Optional[Tuple[int, ...]], real: Optional[Tuple[int, ...]], bp: int) -> bool:
        # (``_shape_agrees``; batch-free ids (T,), expanded: the same T, no dim of theirs follows the batch. Review of
        # round 50: a probe's positions cut to L = 3 agreed with a batch's cut to L = 6 by the ratio 2 : 4, and said
        # the ids were neither the batch nor batch-free: the fallback, which could not run the forward)
        if (mname, k) in lifted:
            return probe is None or real is None or tuple(probe) == tuple(real)
        return _shape_agrees(probe, real, bp, B)
    on_path: List[Tuple[int, Mapping[str, Tuple[Any, ...]]]] = []  # (the probes that took the batch's path)
    whole_ids: Set[int] = set()  # (the records of the whole-batch probes among them, by identity)

    def took_path(bp: int, seen: Mapping[str, Tuple[Any, ...]]) -> bool:
        # every call to be confirmed whose module the probe called from the same sites has an input shape that
        # can be the capture's (``_shape_agrees``): a probe whose forward was cut to another length (its examples'
        # longest) says nothing of this batch's calls, even of a call whose own shape agrees by chance (review of
        # round 50: positions ``pos(arange(L))`` cut to L = 2 in a probe of 2 examples agreed with a batch's (4,)
        # ids, L = B = 4, and confirmed them as the batch: position t credited to example t, 1.58 × 2C)
        for mn in need:
            recs, sites, shp = seen.get(mn), real_sites.get(mn, ()), shapes.get(mn, ())
            if recs is None or len(recs) != len(sites) or any(r[3] != x for r, x in zip(recs, sites)):
                continue  # (its calls on another path: judged by their own alternatives, none)
            if not all(agrees(mn, j, r[4], shp[j] if j < len(shp) else None, bp) for j, r in enumerate(recs)):
                return False
        return True

    def alts(mname: str) -> List[Tuple[int, Tuple[Any, ...]]]:
        if mname not in matched:
            if not matched and failed is None and misread:
                # (a (1, B, ...) time-major call expanded as (1, T = B) positions: every later shape is the
                # expansion's, on no probe's path; the module's own records decide, "time")
                on_path[:] = [(bp, seen) for bp, seen, _, _ in got.runs_seen]
                whole_ids.clear()
                whole_ids.update(id(r) for _, seen, _, w in got.runs_seen if w for r in seen.values())
            elif not matched and failed is None:  # (after a probe added some: the probes on the batch's path again)
                # (memoised per capture's call shapes, in their order, and the lifted calls: a steady step's ~0.3 ms)
                pkey = (tuple((mn, tuple(v)) for mn, v in shapes.items()), frozenset(lifted), frozenset(need))
                idx = got.path_memo.get(pkey)
                if idx is None:
                    if not got.varies and not all(took_path(bp, seen) and same_shapes(origin, False)
                                                  for bp, seen, origin, _ in got.runs_seen):
                        # (review of round 50: a probe of two examples cut to L = 2, on the path of no batch of the
                        # shape, and a whole-batch probe of a batch cut to L = 5 = B + 1 both agreed by their
                        # shapes' ratios with a later batch cut to L = 4 = B, and confirmed its positions as the
                        # batch; review of round 51: at B = 2 the first probe, of 3 examples, of a batch cut to
                        # L = 3 agreed so with a later batch cut to L = 2: each run now also keeps the shapes of
                        # the capture it was run for)
                        got.varies = True
                        got.path_memo.clear()
                    idx = tuple(i for i, (bp, seen, origin, w) in enumerate(got.runs_seen)
                                if (not got.varies or (w and same_shapes(origin, True))) and took_path(bp, seen))
                    if len(got.path_memo) >= 64:
                        got.path_memo.clear()
                    got.path_memo[pkey] = idx
                on_path[:] = [got.runs_seen[i][:2] for i in idx]
                whole_ids.clear()
                whole_ids.update(id(r) for i in idx if got.runs_seen[i][3] for r in got.runs_seen[i][1].values())
            sites = real_sites.get(mname, ())
            ok = {id(seen[mname]) for bp, seen in on_path if mname in seen}
            matched[mname] = [] if failed is not None else [a for a in got.matching(mname, sites) if id(a[1]) in ok]
        return matched[mname]

    tries = 0
    while failed is None and got.drew and got.runs < PROBE_MAX and tries < PROBE_RETRIES \
            and any(not alts(mn) for mn in need):
        probe_more(got.runs)  # (seeds 1, 2, ... in turn: the alternatives seen so far are kept)
        matched.clear()
        tries += 1
        grew = True

    def real_shape(mname: str, k: int) -> Optional[Tuple[int, ...]]:  # (the capture's call's input shape)
        got_ = shapes.get(mname, ())
        return got_[k] if k < len(got_) else None

    def every(mname: str, test, k: Optional[int] = None, whole: bool = False) -> bool:
        # some alternative from the capture's sites, and each passes ``test`` (records, that probe's size). With
        # ``k`` (the call's index), only the records of that call that can be on this batch's path count
        # (``_shape_agrees``), and, for a call whose dims 0 and 1 both have the batch's size, not one whose dims
        # 0 and 1 both had its probe's: it says neither which is the batch (review, round 50: a forward cut to
        # the longest example, time-major, whose probe of two examples had T = 2, read a later batch's
        # (T = B, B, d) input batch-first: 1.06 × 2C)
        a = alts(mname)
        if whole:  # (only the whole-batch probes: the batch's own path)
            a = [(bp, d) for bp, d in a if id(d) in whole_ids]  # (B = 2: the first probe has B + 1 examples too)
        if k is not None:
            real = real_shape(mname, k)
            both = B > 1 and real is not None and len(real) > 1 and real[0] == real[1] == B  # (B, B, ...)
            a = [(bp, d) for bp, d in a if agrees(mname, k, d[k][4], real, bp)
                 and not (both and d[k][0] == bp and d[k][2] == bp)]
        return bool(a) and all(test(d, bp) for bp, d in a)

    def time_major(c: _Call) -> bool:  # dim 0 stayed, dim 1 followed the probe's size
        return every(c.mname, lambda d, bp: d[c.k][0] == real_dims[c.mname][c.k] and d[c.k][2] == bp, c.k)

    def free(c: _Call) -> bool:  # (B,) ids whose length stayed B in a probe of the whole batch: batch-free (T = B)
        # (a probe of two examples cut to L = 2 says "the batch" of any (B,) ids: only the batch's own path tells)
        return every(c.mname, lambda d, bp: d[c.k][0] == B != bp, c.k, whole=True)

    def probe_saw(c: _Call, part=slice(0, 1)) -> Any:  # (for the message)
        a = alts(c.mname)
        if not a:
            if failed is not None:
                return "no such call"
            n = len(real_sites.get(c.mname, ()))
            counts = " or ".join(map(str, sorted({len(r) for _, r in got.alts.get(c.mname, ())}))) or "0"
            return (f"no call from the same call sites (in {got.runs} probe{'s' if got.runs != 1 else ''}, which "
                    f"called it {counts} times, against the batch's {n})")
        d = a[-1][1][c.k][part]
        return d[0] if len(d) == 1 else d

    def probe_size(c: _Call) -> int:  # (for the message)
        a = alts(c.mname)
        return a[-1][0] if a else got.Bp

    def verdicts() -> Tuple[Set[Tuple[str, str]], List[Tuple[_Call, str]]]:
        # (the modules to capture again read otherwise, the calls not confirmed with why)
        confirmed = {id(c) for c in todo if (c.retry == "time" and time_major(c)) or (c.retry == "free" and free(c))}
        relift = {(c.mname, c.retry) for c in todo if id(c) in confirmed}
        # only a module all of whose calls are read so (one kind; "free": all of its (B,) id calls, the others read
        # as they stand: a table looked up by the batch's (B, T = B) ids and by T = B positions)
        relift = {(mn, kind) for mn, kind in relift
                  if all((id(c) in confirmed and c.retry == kind)
                         or (kind == "free" and c.retry != "free" and id(c) not in confirmed)
                         for c in calls if c.mname == mn)}
        if probe_memo is None:  # no capture again without a memo to carry ``forced``: those go to the fallback
            relift = set()
        bad: List[Tuple[_Call, str]] = []
        for c in todo:
            if (c.mname, c.retry) in relift:
                continue
            if failed is not None:
                reason = f"the batch-dimension probe failed ({failed})"
            elif c.bdim:
                if time_major(c):
                    continue  # time-major: dim 0 stayed, dim 1 followed the probe's size
                reason = (f"read as time-major ((T, B, ...), T = {real_dims[c.mname][c.k]}), but a probe with "
                          f"{probe_size(c)} examples gave first and second dims {probe_saw(c, slice(0, 3, 2))}")
            elif c.rows:
                if c.roots and all(every(rt[0], lambda r, bp, j=rt[1]: r[j][:2] == (bp * c.rows, bp), rt[1])
                                   for rt in c.roots) \
                        and every(c.mname, lambda d, bp: d[c.k][0] == bp * c.rows, c.k):
                    continue  # flattened (B·rows, ...) rows traced to a (B, ...) view whose first dim is the batch
                reason = (f"its input has {B * c.rows} rows, the batch flattened, but a probe with {probe_size(c)} "
                          "examples did not confirm that the flattened tensor's first dimension is the batch")
            else:
                if every(c.mname, lambda d, bp: d[c.k][0] == bp
                         or (d[c.k][0] == 1 and getattr(c.rule, "broadcast_batch", False))
                         or bool(c.lift and d[c.k][0] == c.lift), c.k) \
                        and (c.retry != "free" or every(c.mname, lambda d, bp: True, c.k, whole=True)) \
                        and (c.lift != B or B == 1 or free(c)):
                    # ((B,) ids, the batch's or T = B positions: read as the batch only once the whole batch was
                    # probed too, whose records join the test; and read as T = B positions, expanded, only while
                    # the whole batch's probe finds them so: a record of the batch's size says nothing)
                    continue  # the first dimension is the batch (or, B == 1, a broadcast one, e.g. positions;
                    # or batch-free ids, expanded: it stayed T with fewer examples)
                what = "the axis its rule reads as the batch" if c.capture is not None else "input's first dimension"
                reason = (f"{what} equals the batch size {B} but is not the batch dimension "
                          f"(a probe with {probe_size(c)} examples gave {probe_saw(c)})")
            bad.append((c, reason))
        return relift, bad

    def probed_whole(c: _Call) -> bool:  # a probe of B + 1 examples on this call's path (sites and shapes) ran
        real = real_shape(c.mname, c.k)
        return any(id(d) in whole_ids and agrees(c.mname, c.k, d[c.k][4], real, bp) for bp, d in alts(c.mname))

    relift, bad = verdicts()
    # (the unconfirmed calls' modules with their calls' sites and shapes: a probe that failed, e.g. a forward that
    # cannot take B + 1 examples, is not run again on that path; review of round 50)
    path = frozenset((c.mname, tuple(real_sites.get(c.mname, ())), tuple(shapes.get(c.mname, ()))) for c, _ in bad)
    if got.varies:  # (each capture's own shapes: the probes that confirm its calls)
        path = (path, signature())
    if failed is None and path not in got.wholes and any(not probed_whole(c) for c, _ in bad):
        got.wholes.add(path)
        # A call the batch shape's probes do not confirm (no record from its sites, or none from this batch's
        # path): how often or where the model calls a layer, or the sizes it cuts its tensors to, may depend
        # on the batch's values (review, round 50: a cell unrolled ``range(int(lens.max()))`` times ran once
        # in a probe of two short examples, 7 times in the batch; a forward cut to its batch's longest example;
        # an ``if`` on the data). The whole batch, with its first example again, takes the batch's own path
        # (B + 1 examples: a batch dimension follows, a fixed one does not). Its records join the batch shape's
        # alternatives, so a later batch that takes that path finds them; a probe that fails leaves the calls
        # unconfirmed, as before. One a step, only where a call is unconfirmed and no such probe ran on its path
        # (a (V, d) table with V = B: once; a forward that draws: its other probes first, above).
        probe_more(None, replay if got.stateful else None, whole=True)
        matched.clear()
        grew = True
        relift, bad = verdicts()
    if key is not None and failed is None and grew:
        _memo_put(probe_memo, key, got)
    for c, reason in bad:
        for n in ruled[c.module][2].values():
            fallback.setdefault(n, f"{type(c.module).__name__} ({c.mname}): {reason}")
    return relift


def _check_order(opts: Mapping[str, Any]) -> Union[bool, str]:
    """``bk_options["check_order"]``: True (default; the example-order check's verdicts are kept per
    batch shape), "always" (checked again on every batch: a forward that mixes examples only for some
    batches' values, a batch-wide ``if`` on the data, is seen on the batches where it does), or False."""
    v = opts.get("check_order", True)
    if v is True or v is False or v == "always":
        return v
    raise ValueError(f"bk_options['check_order'] = {v!r}: use True (checked once per batch shape), 'always' (every "
                     "batch) or False (not checked)")


def _resolve_routes(model: nn.Module, overrides: Mapping[str, str]) -> Dict[str, str]:
    """``routes`` keyed as the engine looks them up: a tied parameter's or a twice-registered
    module's other names by its first (canonical) one (review, round 35: ``{"head.weight": ...}``
    for GPT-2's head, tied to ``transformer.wte.weight``, was ignored). A dotted key naming no
    parameter or module of the model is an error (a misspelling was ignored silently); another
    key naming nothing in it (e.g. a layer type it lacks, in a dict shared by several models) is
    warned about and ignored; two names of one parameter or module asking different routes are
    an error."""
    if not overrides:
        return {}
    pnames = ParamIndex(model).canonical  # any alias -> first name
    mnames: Dict[str, str] = {}
    firstm: Dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        mnames[n] = firstm.setdefault(id(m), n)
    types = {type(m).__name__ for m in model.modules()}
    out: Dict[str, str] = {}
    said: Dict[str, str] = {}
    for k, v in overrides.items():
        key = pnames.get(k) or mnames.get(k) or (k if k in types else None)
        if key is None:
            import difflib

            near = difflib.get_close_matches(k, list(pnames) + list(mnames) + sorted(types), n=3)
            msg = (f"bk_options['routes'] key {k!r} names no parameter, module or layer type of the model"
                   + (f" (did you mean {', '.join(map(repr, near))}?)" if near else ""))
            if "." in k:
                raise ValueError(msg)
            warn(msg + "; it is ignored")
            continue
        if key in out and out[key] != v:
            raise ValueError(f"bk_options['routes']: {said[key]!r} and {k!r} name the same "
                             f"{'parameter' if key in pnames else 'module'} ({key}) but ask {out[key]!r} and {v!r}")
        out[key], said[key] = v, k
    return out


def _options(method: str, opts: Mapping[str, Any], model: Optional[nn.Module] = None):
    unknown = set(opts) - set(BK_OPTIONS)
    if unknown:
        raise ValueError(f"unknown bk_options {sorted(unknown)}; known: {list(BK_OPTIONS)}")
    _check_order(opts)
    registry = opts.get("registry") or DEFAULT_REGISTRY
    if not isinstance(registry, RuleRegistry):
        raise TypeError("bk_options['registry'] must be a pdpsgd.rules.RuleRegistry")
    overrides = dict(opts.get("routes") or {})
    for k, v in overrides.items():
        if v not in ("ghost", "explicit", "vmap"):
            raise ValueError(f"bk_options['routes'][{k!r}] = {v!r}: use 'ghost', 'explicit' or 'vmap'")
    cm = opts.get("cost_model") or ("fastdp" if method == "bk" else "time")
    if cm not in COST_MODELS:
        raise ValueError(f"cost_model={cm!r} is unknown: use one of {COST_MODELS}")
    if model is not None:
        overrides = _resolve_routes(model, overrides)
    return registry, overrides, cm


def _forced(n: str, overrides: Mapping[str, str], col: _Collected) -> Optional[str]:
    """The route the user forced for parameter n (by its name, or its module's name or type)."""
    forced = overrides.get(n)
    if forced is None:
        asked = {}
        for mname, m in col.owner.get(n, []):
            o = _override(overrides, mname, m)
            if o is not None:
                asked.setdefault(o, mname or type(m).__name__)
        if len(asked) > 1:  # (review, round 35: the first owner's won, silently)
            raise ValueError(f"bk_options['routes']: {n} is shared by modules whose routes disagree "
                             f"({', '.join(f'{w}: {o!r}' for o, w in asked.items())}); name the parameter "
                             f"itself: routes[{n!r}] = ...")
        forced = next(iter(asked), None)
    return forced


def _compacted_shape(sh: UseShape, c: _Compact, B: int) -> UseShape:
    """``sh`` with the rows a compacted ghost norm runs over (``_compaction``), per example."""
    return dataclasses.replace(sh, rows2=c.cost / max(B, 1), rows=int(c.rows.numel()) / max(B, 1))


def _plan(col: _Collected, params: Params, B: int, cost_model: str, overrides: Mapping[str, str],
          opts: Mapping[str, Any], device: torch.device) -> Tuple[Dict[str, str], Dict[int, _Compact]]:
    """Routes, and the compactions of ghost-route uses by id(use) (``_compaction``; CPU only). With
    the time cost model the compactions of every single-use dense parameter are found first, so
    that the model counts the padded rows a ghost norm would skip (a padded batch then takes more
    ghost routes); the others keep only their ghost-route uses'."""
    compact: Dict[int, _Compact] = {}
    if device.type not in ACTIVE_ROWS_DEVICES:
        return _routes(col, params, B, cost_model, overrides, opts, device), compact
    finite: Dict = {}
    shared: Dict = {}

    def find(names):
        for n in names:
            us = col.uses.get(n, [])
            if n not in col.fallback and len(us) == 1 and isinstance(us[0], Dense) \
                    and _forced(n, overrides, col) in (None, "ghost"):
                c = _compaction(us[0], finite, shared)
                if c is not None:
                    compact[id(us[0])] = c

    if cost_model == "time":
        find(params)
    routes = _routes(col, params, B, cost_model, overrides, opts, device, compact)
    if cost_model == "time":
        for n, r in routes.items():
            if r != "ghost":
                for u in col.uses.get(n, []):
                    compact.pop(id(u), None)
    else:
        find(n for n, r in routes.items() if r == "ghost")
    return routes, compact


def _routes(col: _Collected, params: Params, B: int, cost_model: str, overrides: Mapping[str, str],
            opts: Mapping[str, Any], device: torch.device, compact: Optional[Dict[int, _Compact]] = None
            ) -> Dict[str, str]:
    ew = float(opts.get("elementwise_cost") or ELEMENTWISE_COST.get(device.type, ELEMENTWISE_COST["cuda"]))
    cap = int(opts.get("explicit_max_elems") or EXPLICIT_MAX_ELEMS)
    keep_budget = int(opts.get("explicit_keep_elems") or EXPLICIT_KEEP_ELEMS)
    kept = 0  # mirrors _chunk's greedy keep policy (same parameter order)
    routes: Dict[str, str] = {}
    for n in params:
        if n in col.fallback:
            routes[n] = "vmap"
            continue
        uses = col.uses.get(n, [])
        shapes = [_use_shape(u, params[n].shape) for u in uses]
        if compact and len(uses) == 1 and id(uses[0]) in compact:
            shapes = [_compacted_shape(shapes[0], compact[id(uses[0])], B)]
        forced = _forced(n, overrides, col)
        big = [s for s in shapes if s.kind in ("dense", "index")]
        if forced in ("ghost", "explicit") and big:
            routes[n] = forced
        else:
            routes[n] = choose_route(shapes, B, cost_model, elementwise_cost=ew, explicit_max_elems=cap)
            if routes[n] == "explicit" and big and cost_model == "time":
                numel = B * max(s.P0 for s in big) * max(s.P1 for s in big)
                if kept + numel > keep_budget and numel > factor_elems(shapes, B):
                    # G would be dropped after its norm: the clipped sum then costs one more
                    # B·T·p·d matmul per use; re-compare with ghost under that handicap.
                    g, e = cost(shapes, B, elementwise_cost=ew)
                    e += sum(B * s.T * s.P0 * s.P1 for s in big if s.kind == "dense")
                    routes[n] = "ghost" if g < e else "explicit"
        if routes[n] == "explicit" and big:
            numel = B * max(s.P0 for s in big) * max(s.P1 for s in big)
            if numel > factor_elems(shapes, B):  # kept G that frees at least its size costs no budget
                kept += numel if kept + numel <= keep_budget else 0
    return routes


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def plan(model: nn.Module, loss_fn, params: Mapping[str, Tensor], batch: Batch, *, method: str = "auto",
         clip_groups: Optional[Sequence[Sequence[str]]] = None, probe_memo: Optional[Dict] = None,
         **bk_options: Any) -> Dict[str, str]:
    """Route per trained parameter for this batch's shapes: "ghost", "explicit" or "vmap".

    Runs one forward and backward (to see the layers' shapes and detect uses outside a layer), plus
    the checks a step memoises (batch-dimension probe, example order, broadcast positions), in
    ``probe_memo`` if given (a step passes a copy of its own: what its checks found so far is used,
    nothing is written back), else afresh; the choice itself is a pure function of the shapes
    (``choose_route``), which for method="auto" on the CPU include each example's count of non-padded rows where the ghost norm
    would skip the padding (``_compaction``). For the whole batch as one chunk: a step with
    ``chunk_size`` decides per chunk (a parameter whose chunks differ is reported "mixed").
    ``clip_groups``: the step's clip groups (lists of names; a step passes its own), which decide
    whether a parameter with a negligible gradient may stay on its rule (``_settle_pending``);
    without them it is reported "vmap".
    """
    registry, overrides, cm = _options(method, bk_options, model)
    params = {n: p.detach() for n, p in params.items()}
    constants = model_constants(model, params)
    col = _collect(LossModule(model, loss_fn), params, constants, batch, registry, overrides, probe_memo,
                   check_order=_check_order(bk_options))
    _settle_pending(col, params, batch_size(batch), clip_groups)
    _one_network(col, LossModule(model, loss_fn), params, constants, batch, batch_size(batch), overrides, probe_memo)
    dev = next(iter(params.values())).device
    return _plan(col, params, batch_size(batch), cm, overrides, bk_options, dev)[0]


def fallback_reasons(model: nn.Module, loss_fn, params: Mapping[str, Tensor], batch: Batch, *,
                     method: str = "auto", clip_groups: Optional[Sequence[Sequence[str]]] = None,
                     probe_memo: Optional[Dict] = None, **bk_options: Any) -> Dict[str, str]:
    """Why each trained parameter that takes the exact vmap fallback (route "vmap") takes it:
    {name: reason}, e.g. "no rule for MultiheadAttention (attn)", "also used outside its layer's
    forward". Runs the forward, backward and checks, as ``plan``."""
    registry, overrides, _ = _options(method, bk_options, model)
    params = {n: p.detach() for n, p in params.items()}
    constants = model_constants(model, params)
    col = _collect(LossModule(model, loss_fn), params, constants, batch, registry, overrides, probe_memo,
                   check_order=_check_order(bk_options))
    _settle_pending(col, params, batch_size(batch), clip_groups)
    _one_network(col, LossModule(model, loss_fn), params, constants, batch, batch_size(batch), overrides, probe_memo)
    return {n: col.fallback[n] for n in params if n in col.fallback}


def _empty(params: Params, b: int, device: torch.device):
    z = {n: torch.zeros(b, dtype=_acc(p.dtype), device=device) for n, p in params.items()}
    return z


# Small explicit per-example gradients (norm-layer weights, biases: (B, k) with k at most this) of
# equal size are stacked, (B, m, k), and their norms and clipped sums taken in a few launches for
# all m instead of several per parameter (GPT-2 small: 98 such parameters in 3 sizes). At most one
# sum block of ``sq_norm_per_example``, so the reduction is the same kind and precision.
STACK_MAX_ELEMS = SQ_NORM_BLOCK


def _stack_small(stackable: Dict[Tuple, List[Tuple[str, Tensor]]], B: int, sq: Dict[str, Tensor],
                 kept_G: Dict[str, Tensor]) -> List[Tuple[List[str], Tensor]]:
    """Squared norms of the stackable G's into ``sq``; returns (names, S (B, m, k)) per stack (a
    lone G goes to ``kept_G`` as before)."""
    out = []
    for items in stackable.values():
        if len(items) == 1:
            n, G = items[0]
            sq[n] = _sq_norm(G)
            kept_G[n] = G
            continue
        S = torch.stack([G.reshape(B, -1) for _, G in items], dim=1)  # m x (B, k) -> (B, m, k)
        s2 = S.pow(2).sum(2)  # (B, m, k) -> (B, m): one row sum per example and parameter
        for j, (n, _) in enumerate(items):
            sq[n] = s2[:, j]
        out.append(([n for n, _ in items], S))
    stackable.clear()
    return out


def _stacked_sums(names: List[str], S: Tensor, w: Mapping[str, Tensor], params: Params,
                  sums: Dict[str, Tensor]) -> None:
    """Σ_i w_i G_i for every parameter of a stack: one weighted reduction over the batch."""
    W = torch.stack([w[n] for n in names], dim=1).to(S.dtype)  # m x (B,) -> (B, m)
    # rows of weight 0 (dropped, possibly non-finite examples) are zeroed, never multiplied by 0;
    # done unconditionally (small) so no host sync decides it
    S = torch.where((W != 0).unsqueeze(2), S, torch.zeros((), dtype=S.dtype, device=S.device))
    tot = torch.einsum("bm,bmk->mk", W, S)  # (B, m) x (B, m, k) -> (m, k)
    for j, n in enumerate(names):
        sums[n] = tot[j].reshape(params[n].shape)


def _chunk(loss_module, params, constants, batch, mask, weights_fn, registry, overrides, cm, opts, probe_memo=None):
    """One chunk: the capture (and the fallback's vmap) under the caller's autocast and float32 matmul
    precision, if any; the engine's own norms, clip factors and sums with autocast off
    (``per_sample.amp``) and full-precision float32 matmuls (:func:`_ieee_matmuls`)."""
    state = amp_state()
    with amp(state, False), _ieee_matmuls() as caller:  # (no region: nothing entered)
        return _chunk_body(loss_module, params, constants, batch, mask, weights_fn, registry, overrides, cm, opts,
                           probe_memo, state, caller)


def _moe_hint(model: nn.Module) -> str:
    """The fix for a Hugging Face mixture-of-experts model whose experts run as a loop over the experts its
    tokens chose (``experts_implementation='eager'``), which vmap cannot run: its experts and router have no
    rule and take the exact fallback, which runs 'grouped_mm' (the default) and 'batched_mm'. Only for a model with
    such experts: a module set up by transformers' ``use_experts_implementation`` (it sets ``_is_expert_parallel`` on
    the instance); every transformers 5 config says ``_experts_implementation`` (review, round 54: a SqueezeBERT
    that vmap could not run for another reason was told to change its experts)."""
    for m in model.modules():
        if "_is_expert_parallel" not in m.__dict__:
            continue
        try:
            impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        except Exception:  # (a config's property may raise)
            impl = None
        if impl == "eager":
            return ("this mixture-of-experts model runs its experts with experts_implementation='eager' (a loop "
                    "over the experts its tokens chose), which torch.func.vmap cannot run; its experts and router "
                    "take the exact vmap fallback (no rule yet), so build it with "
                    "experts_implementation='grouped_mm' (the default) or 'batched_mm'. In detail: ")
    return ""


def _chunk_body(loss_module, params, constants, batch, mask, weights_fn, registry, overrides, cm, opts, probe_memo,
                state, caller=()):
    B = mask.shape[0]
    device = _device_of(params, mask)  # the parameters' device decides what may sync
    # (the model's forward and backward: the caller's mixed precision and matmul precision)
    tok = _INPUTS_OUT.set(True) if opts.get("inputs_in_graph", True) is False else None
    try:
        with amp(state, True), _caller_matmuls(list(caller)):
            col = _collect(loss_module, params, constants, batch, registry, overrides, probe_memo,
                           check_order=_check_order(opts),
                           paths=bool(_check_order(opts)) and opts.get("hold_paths", True) is not False)
    finally:
        if tok is not None:
            _INPUTS_OUT.reset(tok)
    _settle_pending(col, params, B, getattr(weights_fn, "clip_groups", None))
    _one_network(col, loss_module, params, constants, batch, B, overrides, probe_memo)
    # routes; compact: id(use) -> its non-zero rows, where they are few (CPU: host reads)
    routes, compact = _plan(col, params, B, cm, overrides, opts, device)
    sq: Dict[str, Tensor] = {}
    kept_G: Dict[str, Tensor] = {}
    keep_budget = int(opts.get("explicit_keep_elems") or EXPLICIT_KEEP_ELEMS)
    kept = 0
    tokens: Dict[int, Tensor] = {}  # ghost uses' per-example counts of contributing rows (for the guard)
    counts: Dict = {}  # self-Gram operands of ghost-route dense uses, to share e.g. q/k/v's input Gram
    for n, r in routes.items():
        if r == "ghost":
            for u in col.uses.get(n, []):
                if isinstance(u, Dense) and u.R is not None:
                    levels = _pair_levels(u)  # (the form ``_inner`` asks the memo for)
                    for X in (u.L, u.R):
                        k = _gram_key(X, _acc(params[n].dtype), compact.get(id(u)), levels)
                        counts[k] = counts.get(k, 0) + 1
    grams = _GramMemo(counts)
    active: Dict[int, Tensor] = {}  # id(dense use) -> its non-zero factor rows (when few enough)
    rows = active if device.type in ACTIVE_ROWS_DEVICES else None
    # equal-shaped single-use layers' self pairs, by groups (``_ghost_groups``): name -> (‖G_i‖², bound)
    items = []
    for n, r in routes.items():
        us = col.uses.get(n, [])
        if r == "ghost" and len(us) == 1:
            k = _groupable(us[0], counts, _acc(params[n].dtype), compact.get(id(us[0])))
            if k is not None:
                items.append((n, us[0], k))
    grouped = _ghost_groups(items, rows, tokens) if len(items) > 1 else {}
    del items
    stackable: Dict[Tuple, List[Tuple[str, Tensor]]] = {}  # (numel, dtype, device) -> small explicit G's
    guard = _Guard()  # ghost-route norms, clamped and cancellation-guarded together
    for n, r in routes.items():
        if r == "vmap":
            continue
        p = params[n]
        acc = _acc(p.dtype)
        uses = col.uses.get(n, [])
        if not uses:
            sq[n] = torch.zeros(B, dtype=acc, device=device)
            continue
        if r == "explicit":
            G = _materialise(uses[0], p.shape, acc)
            for u in uses[1:]:
                G = G + _materialise(u, p.shape, acc)
            small = len(uses) == 1 and not isinstance(uses[0], (Dense, Index))
            small = small or all(isinstance(u, Dense) and u.R is None for u in uses)
            k = G[0].numel() if B else 0
            if small and 0 < k <= STACK_MAX_ELEMS:  # norms and sums taken below, stacked by size
                stackable.setdefault((k, G.dtype, G.device), []).append((n, G))
                col.uses[n] = []
                del G, uses
                continue
            sq[n] = _sq_norm(G)
            # keep G for Σ c_i G_i when it is no bigger than the factors it replaces (they are
            # released now: memory only goes down), or within the budget of extra memory
            frees = G.numel() <= factor_elems([_use_shape(u, p.shape) for u in uses], B)
            if small or frees or kept + G.numel() <= keep_budget:
                kept_G[n] = G  # reused for Σ c_i G_i
                kept += 0 if (small or frees) else G.numel()
                col.uses[n] = []  # drop this parameter's references to its a and g
            else:
                # the sum is taken from the factors, not from G: guarded as a ghost route's (review,
                # round 34: +M and -M on one row made an example's G exactly 0, norm 0, while in the
                # batch's sum they wiped out the other examples' terms on that row: 109 C)
                bnd: Dict[int, Tensor] = {}
                cnt: Dict[int, Tensor] = {}
                for u in uses:
                    _factor_bound(u, p.shape, acc, bnd, cnt)
                guard.add(n, sq[n], uses, bnd, acc, cnt)
            del G, uses
        elif n in grouped:
            tot, b, slack = grouped.pop(n)
            guard.add(n, tot, uses, {id(uses[0]): b, ("slack", id(uses[0])): slack}, acc, tokens)
        else:
            tot = None
            bounds: Dict[int, Tensor] = {}
            for i, u in enumerate(uses):
                for j in range(i, len(uses)):
                    t = _inner(u, uses[j], p.shape, acc, grams, rows, bounds, compact, tokens)
                    t = t if i == j else 2 * t
                    tot = t if tot is None else tot + t
            guard.add(n, tot, uses, bounds, acc, tokens)  # sq[n]: clamped at 0 and guarded below
    del grams, compact
    guard.done(sq)
    stacks = _stack_small(stackable, B, sq, kept_G)
    fb = [n for n, r in routes.items() if r == "vmap"]
    fb_grads: Dict[str, Tensor] = {}
    if fb:
        others = {n: v.detach() for n, v in params.items() if n not in fb}
        try:
            with amp(state, True), _rng_replay(params, col.rng), _attrs_replayed(loss_module.model, col.attrs):
                # (no ruled parameter reached the losses: the fallback's must, or none does)
                _, fb_grads = per_sample_grads(loss_module, {n: params[n] for n in fb}, {**constants, **others}, batch,
                                               require_grad=not col.reached)
        except RuntimeError as err:
            if isinstance(err, OOM_ERRORS):
                raise
            why = "; ".join(f"{n}: {col.fallback.get(n, 'route vmap requested')}" for n in fb[:3])
            first = str(err).splitlines()[0] if str(err) else ""
            first = first.split(" Fixes:")[0]  # (per_sample's own advice suggests method='bk')
            raise RuntimeError(
                f"{_moe_hint(loss_module.model)}"
                f"book-keeping computes {len(fb)} parameter(s) by the exact vmap fallback ({why}"
                f"{'; ...' if len(fb) > 3 else ''}; all: dp_step.fallback_reasons(batch)), and torch.func.vmap "
                f"cannot run this model: {type(err).__name__}: {first} "
                "Fix: leave those parameters out of params (freeze them: requires_grad_(False), and pass "
                "pdpsgd.trainable_params(model)), or register "
                "a rule for their layer type (bk_options={'registry': ...}), or make the model's forward "
                "vmap-compatible (no data-dependent shapes or .item() on the batch).") from err
        for n in fb:
            sq[n] = sq_norm_per_example(fb_grads[n])
    sq = {n: sq[n] for n in params}
    losses = col.losses.to(_acc(col.losses.dtype))
    w = weights_fn(sq, losses, mask)
    keep_of = _KeepMemo(device, sq)
    sums: Dict[str, Tensor] = {}
    stacked = set()
    for names, S in stacks:
        _stacked_sums(names, S, w, params, sums)
        stacked.update(names)
    del stacks

    def net_alloc(n: str) -> int:  # elements this parameter's sum allocates minus those its release frees
        if routes[n] == "vmap":
            held = fb_grads[n].numel()
        elif n in kept_G:
            held = kept_G[n].numel()
        else:
            held = sum(t.numel() for u in col.uses.get(n, []) for t in (getattr(u, "L", None), getattr(u, "R", None),
                                                                        getattr(u, "G", None)) if t is not None)
        return params[n].numel() - held

    # sums that free more than they allocate first (e.g. GPT-2's tied head: its (B, T, V) logits
    # gradient), those that mostly allocate last (an embedding's (V, d) table from (B, T, d)
    # factors): the peak stays at the factors' size instead of factors + a table
    for n in sorted((n for n in routes if n not in stacked), key=net_alloc):
        r = routes[n]
        p = params[n]
        acc = _acc(p.dtype)
        # each parameter's factors / per-example gradients are dropped once its sum is taken, so the
        # sums (parameter-sized) replace them instead of adding to them
        if r == "vmap":
            sums[n] = weighted_sum(w[n], fb_grads.pop(n))
        elif n in kept_G:
            sums[n] = _wsum(w[n], kept_G.pop(n), keep_of(w[n]))
        else:
            # an index use (embedding) last: it then adds its rows into the others' sum in place
            uses = sorted(col.uses.pop(n, []), key=lambda u: isinstance(u, Index))
            keep = keep_of(w[n])
            s = None
            for u in uses:
                s = _weighted_use_sum(u, w[n], keep, p.shape, acc, active.get(id(u)), out=s)
            sums[n] = s if s is not None else torch.zeros(p.shape, dtype=acc, device=p.device)
            del uses
    sums = {n: sums[n] for n in routes}
    return losses, sq, w, sums, routes


def bk_engine(
    loss_module: LossModule,
    params: Params,
    constants: Mapping[str, Tensor],
    batch: Batch,
    mask: Tensor,
    weights_fn: WeightsFn,
    *,
    chunk_size: Optional[int] = None,
    method: str = "bk",
    probe_memo: Optional[Dict] = None,
    **bk_options: Any,
) -> EngineResult:
    """Per-example norms, weights and clipped sums by book-keeping (see the module docstring).

    ``method``: "bk" (default cost model "fastdp": ghost iff 2T² < p·d, Bu et al.) or "auto"
    (cost model "time", see ``cost``). ``bk_options``: ``registry`` (a ``RuleRegistry``),
    ``routes`` ({param name | module name | layer type name: "ghost"|"explicit"|"vmap"}),
    ``cost_model`` ("time", "fastdp", "ghost", "explicit"), ``explicit_max_elems``,
    ``elementwise_cost``. ``chunk_size``: examples per pass (default: the whole batch).

    Formal guarantee: as in the module docstring; identical in exact arithmetic to
    ``per_sample.vmap_engine`` whatever the routes.
    """
    registry, overrides, cm = _options(method, bk_options, loss_module.model)
    B = batch_size(batch)
    check_batch_entries(batch, B)
    chunk = chunk_size or B
    device = _device_of(params, mask)
    losses_all: List[Tensor] = []
    sq_all: Dict[str, List[Tensor]] = {n: [] for n in params}
    w_all: Dict[str, List[Tensor]] = {n: [] for n in params}
    total: Dict[str, Tensor] = {}
    routes: Dict[str, str] = {}
    # A chunk of padding alone is skipped only as the vmap engine skips one: once an earlier chunk of
    # this call ran without moving the random state, with no module in train mode. The first chunk
    # of every call runs whatever its mask (review, round 39: an all-padding chunk or physical batch
    # was skipped in train mode too, so the dropout masks of the chunks and batches after it moved
    # when an example was masked out, and the clipped sum with them: 2.5 C). A run chunk of padding
    # gives weight 0 to every row: zero sums, its computed norms and losses, its routes reported.
    skippable = not any(mod.training for mod in loss_module.model.modules())
    held = _model_rngs(loss_module.model) if skippable else ()
    quiet = False
    for start, stop, sub in batch_chunks(batch, B, chunk):
        m = mask[start:stop]
        if skippable and quiet and not bool(m.any()):
            z = _empty(params, stop - start, device)
            losses_all.append(torch.zeros(stop - start, dtype=losses_all[-1].dtype, device=device))
            for n in params:
                sq_all[n].append(z[n])
                w_all[n].append(z[n])
            continue
        # (the state is compared only where a later chunk could be skipped: not for a single chunk)
        before = _rng_state(device, held) if skippable and not quiet and stop < B else None
        losses, sq, w, sums, r = _chunk(loss_module, params, constants, sub, m, weights_fn, registry,
                                        overrides, cm, bk_options, probe_memo)
        if before is not None:
            quiet = _same_state(before, _rng_state(device, held))
            skippable = quiet
        for n in params:
            total[n] = sums[n] if n not in total else total[n] + sums[n]
            sq_all[n].append(sq[n])
            w_all[n].append(w[n])
        losses_all.append(losses)
        for n, v in r.items():
            routes[n] = v if routes.get(n, v) == v else "mixed"
    for n, p in params.items():
        if n not in total:
            total[n] = torch.zeros(p.shape, dtype=_acc(p.dtype), device=p.device)
        routes.setdefault(n, "skipped")
    ldt = max((l.dtype for l in losses_all), key=lambda d: torch.finfo(d).bits)
    return EngineResult(
        losses=torch.cat([l.to(ldt) for l in losses_all]),
        sq_norms={n: cat_chunks(v) for n, v in sq_all.items()},
        weights={n: cat_chunks(v) for n, v in w_all.items()},
        clipped_sum=total,
        routes=routes,
    )
