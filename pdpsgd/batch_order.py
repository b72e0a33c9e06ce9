"""Seeing a forward order its batch by a computed index, even where that order is the identity.

Book-keeping reads row b of a layer's batch as example b's. A model that sorts its batch (by
length, say, for ``pack_padded_sequence(enforce_sorted=True)``) and restores the order later
breaks that for the layers in between. The example-order check (``bookkeeping._order_disagree``)
sees a reordering by its effect on each example's norms, but only in the batch it checks, once per
batch shape: a batch whose order the sort leaves as it is (every length equal: every text truncated
to T) shows none, and a later batch of the same shape is reordered. ``ReorderWatch`` sees the
cause instead: while one forward of the step's own mode runs, it marks every tensor computed from
an ordering (``sort``, ``argsort``, ``topk``, ``randperm``, ``nonzero``, ``where(cond)``, ``unique``,
...) and whatever is computed from a marked tensor (a marked value written into a tensor marks it),
and reports an op that selects or places the B rows of a dimension of size B (the batch's, first or
not) by a marked integer index of B entries, or by a Python list or NumPy array of B entries (whose
origin it cannot see), whatever their values are in this batch; also one row of it by an entry of
such an order (a 0-d tensor taken from it by indexing, iterating or ``unbind``:
``torch.stack([x[i] for i in order])`` applies the order row by row; another computed scalar, e.g.
a position found by ``nonzero`` along the sequence, is not one), given to ``x.select`` / ``x.narrow``
too, and a part of such an order (``x[order[k:k+1]]``, the pieces of ``order.split(2)``; round 37). An index of another length (the rows of a token mask's ``nonzero``, scattered back to their
own examples) is not a reordering of the batch and is not reported; a Python int or an unmarked 0-d
index (``x[0]``) is not either.

Not seen: an order that leaves the tensors (a Python ``sorted`` turned into a new tensor by
``torch.tensor``), one kept in the model between steps, one computed by comparisons, and one on a
code path this batch does not take. Ops called from torch's own ``torch.nn.utils.rnn`` /
``torch.nn.modules.rnn`` (``pack_padded_sequence`` sorts and restores the batch for the RNN, whose
rules know it) and from pdpsgd are not reported (their results are still marked:
``PackedSequence.sorted_indices`` used by the model is seen).
"""
from __future__ import annotations

import contextvars
import functools
import operator
import os
import sys
import weakref
from typing import Any, Dict, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["ReorderWatch", "DrawWatch", "DropoutOff"]

# ops whose integer outputs are an order, or positions found by value
ORDERINGS = frozenset({"sort", "argsort", "msort", "topk", "kthvalue", "randperm", "nonzero", "nonzero_static",
                       "argwhere", "unique", "unique_consecutive", "multinomial"})

# ops that select or place slices along a dimension: name -> (position of dim, position of index);
# keyword names ``dim`` and ``index`` (``indices`` for take_along_dim)
ROW_OPS = {name: (1, 2) for name in (
    "index_select", "index_copy", "index_copy_", "index_add", "index_add_", "index_fill", "index_fill_",
    "index_reduce", "index_reduce_", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_")}
ROW_OPS["take_along_dim"] = (2, 1)
_KEYED = ("__getitem__", "__setitem__", "index_put", "index_put_")
# ops that take an order's entries (``for i in order``) or parts (``order[k:k+1]``, ``order.split(2)``)
_ENTRY_OPS = frozenset({"__getitem__", "unbind", "select", "narrow", "split", "chunk", "tensor_split",
                        "split_with_sizes", "unsafe_split", "unsafe_chunk"})
# ops that take one row of a dimension by a scalar: name -> (position of dim, position of the index)
_SCALAR_ROW_OPS = {"select": (1, 2), "narrow": (1, 2)}

_TORCH_RNN = (os.path.join("torch", "nn", "utils", "rnn.py"), os.path.join("torch", "nn", "modules", "rnn.py"))
_OURS = os.path.dirname(os.path.abspath(__file__))


def _exempt(filename: str) -> bool:
    return filename.endswith(_TORCH_RNN) or os.path.abspath(filename).startswith(_OURS + os.sep)


def _int_dim(d: Any, ndim: int) -> Optional[int]:
    try:
        d = operator.index(d)
    except TypeError:
        return None
    return d + ndim if d < 0 else d


class ReorderWatch(TorchFunctionMode):
    """A TorchFunctionMode for one forward of a batch of ``B`` examples: ``found`` describes the first
    op that selected or placed the batch's rows by a computed order (None: none)."""

    def __init__(self, B: int):
        super().__init__()
        self.B = B
        self.found: Optional[str] = None
        self._marked: Dict[int, "weakref.ref[Tensor]"] = {}
        self._entries: Dict[int, "weakref.ref[Tensor]"] = {}  # entries (0-d) and parts (1-d) of a marked order of B

    def _is_marked(self, x: Any) -> bool:
        if not isinstance(x, Tensor):
            return False
        r = self._marked.get(id(x))
        return r is not None and r() is x

    def _mark(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._marked[id(t)] = weakref.ref(t)

    def _is_order(self, x: Any) -> bool:
        """A marked integer tensor of B entries: an order of the batch (its entries are tagged)."""
        return (self._is_marked(x) and x.dim() == 1 and x.shape[0] == self.B and not x.is_floating_point()
                and x.dtype != torch.bool)

    def _orders(self, index: Any, size: int) -> bool:
        """Whether ``index``, on a dimension of size B, is a computed order of the B rows, or one entry
        of one (a 0-d index: the order applied row by row)."""
        if size != self.B:
            return False
        if isinstance(index, Tensor):
            if self._is_entry(index):  # an entry or a part of an order, not any computed scalar (review, round 36)
                return True
            if index.dim() == 0:
                return False
            return (self._is_marked(index) and not index.is_floating_point() and index.dtype != torch.bool
                    and index.dim() == 1 and index.shape[0] == self.B)
        if isinstance(index, (list, tuple)) and len(index) == self.B:
            return all(isinstance(i, int) or (isinstance(i, Tensor) and i.dim() == 0) for i in index)
        ndarray = getattr(sys.modules.get("numpy"), "ndarray", None)
        return ndarray is not None and isinstance(index, ndarray) and index.ndim == 1 and index.shape[0] == self.B \
            and index.dtype.kind in "iu"

    def _is_entry(self, x: Any) -> bool:
        """An entry (0-d) or a part (1-d: ``order[k:k+1]``, a piece of ``order.split(2)``) of an order."""
        r = self._entries.get(id(x)) if isinstance(x, Tensor) else None
        return r is not None and r() is x

    def _keyed(self, x: Tensor, key: Any) -> bool:
        """``x[key]`` / ``x[key] = ...``: a key entry that orders a dimension of size B."""
        items = list(key) if isinstance(key, tuple) else [key]  # (a list is one advanced index)
        d = 0
        for j, k in enumerate(items):
            if k is None:
                continue
            if k is Ellipsis:  # the entries after it index the last dimensions
                d = x.dim() - sum(1 for kk in items[j + 1:] if kk is not None and kk is not Ellipsis)
                continue
            if 0 <= d < x.dim() and self._orders(k, x.shape[d]):
                return True
            d += 1
        return False

    def _rows_by_order(self, name: str, args, kwargs) -> bool:
        """Whether this call selects or places the B rows of a dimension of size B by a computed order."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor) or x.dim() == 0:
            return False
        if name in _KEYED:
            key = args[1] if len(args) > 1 else kwargs.get("indices")
            return self._keyed(x, key)
        pos = _SCALAR_ROW_OPS.get(name)
        if pos is not None:  # x.select(0, order[k]), x.narrow(0, order[k], 1): one row by an entry of an order
            index = args[pos[1]] if len(args) > pos[1] else kwargs.get("index" if name == "select" else "start")
            dim = _int_dim(args[pos[0]] if len(args) > pos[0] else kwargs.get("dim"), x.dim())
            # (an entry, or a one-element part: ``x.select(0, p)`` for ``p`` in ``order.split(1)`` takes row
            # int(p); mutation review, round 43: the part was not seen)
            return (dim is not None and 0 <= dim < x.dim() and x.shape[dim] == self.B and self._is_entry(index)
                    and index.numel() == 1)
        pos = ROW_OPS.get(name)
        if pos is None:
            return False
        dim = _int_dim(args[pos[0]] if len(args) > pos[0] else kwargs.get("dim"), x.dim())
        index = args[pos[1]] if len(args) > pos[1] else kwargs.get("indices" if name == "take_along_dim" else "index")
        if dim is None or not 0 <= dim < x.dim() or not isinstance(index, Tensor):
            return False
        if index.dim() == x.dim() and index.dim() > 1:  # gather / scatter: the index's extent on that dimension
            if not (self._is_marked(index) and index.shape[dim] == self.B and x.shape[dim] == self.B):
                return False
            return not index.is_floating_point() and index.dtype != torch.bool
        return self._orders(index, x.shape[dim])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.found is None and (name in _KEYED or name in ROW_OPS or name in _SCALAR_ROW_OPS):
            caller = sys._getframe(1)
            if not _exempt(caller.f_code.co_filename) and self._rows_by_order(name, args, kwargs):
                self.found = (f"{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}, by an "
                              "order computed with sort, argsort, topk, nonzero, ... or a Python list")
        out = func(*args, **kwargs)
        if name in _ENTRY_OPS and args and (self._is_order(args[0]) or (self._is_entry(args[0]) and args[0].dim() == 1)):
            # order[k], iterating or unbinding an order; order[k:k+1], its split / chunk pieces (and theirs)
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor) and t.dim() <= 1 and not t.is_floating_point() and t.dtype != torch.bool:
                    self._entries[id(t)] = weakref.ref(t)
        ordering = name in ORDERINGS or (name == "where" and len(args) + len(kwargs) == 1)
        flat = tree_flatten((args, kwargs))[0]
        if ordering or any(self._is_marked(a) for a in flat):
            self._mark(out)
            if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], Tensor):
                self._mark(args[0])  # (an in-place write of marked values: the written tensor)
        return out


# random ops that draw for the tensor they are given (its shape): name -> how to read "does it draw"
_DROPOUTS = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
                       "native_dropout", "feature_dropout", "dropout_", "alpha_dropout_", "feature_dropout_",
                       "feature_alpha_dropout_"})
_DRAWS_LIKE = frozenset({"bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "cauchy_", "log_normal_",
                         "geometric_", "random_", "poisson", "rand_like", "randn_like", "randint_like", "multinomial",
                         "binomial", "_standard_gamma", "_sample_dirichlet", "gumbel_softmax"})
# fused recurrent kernels: their dropout between layers is drawn inside the kernel, in its own layout,
# which the fallback's per-example recurrence (``pdpsgd.rnn``) does not reproduce (review, round 38)
_FUSED_RNNS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})
_FACTORIES = frozenset({"rand", "randn", "randint", "randperm"})


class DrawWatch(TorchFunctionMode):
    """A TorchFunctionMode for one forward of a batch of ``B`` examples (its tensor leaves with B rows):
    ``found`` describes the first random draw that is not one per example on the batch's leading
    dimension (None: none), i.e. whose values ``vmap(..., randomness="different")`` over the examples
    would not reproduce: a draw for a tensor that does not come from the batch (a dropout on position
    embeddings: one mask shared by the batch, where vmap draws one per example), for a batch-derived
    tensor whose first dimension is not the batch (a time-major (T, B, d): drawn in another layout),
    or a random factory call (``torch.rand(shape)``) of another first size. Tensors are followed from
    the batch through every op of the forward (any input from the batch: its outputs are)."""

    def __init__(self, B: int, batch: Any, fixed_sizes: Any = ()):
        super().__init__()
        self.B = B
        self.found: Optional[str] = None
        # a verdict that rests on a size meeting B (a factory of B rows, taken as one per example; a
        # batch tensor whose first size is B while B is also one of the model's or the batch's fixed
        # sizes, ``fixed_sizes``: (T, d) from x[0] at B = T): it stands for this B alone (final review)
        self.fragile = B in set(fixed_sizes)
        self._from_batch: Dict[int, "weakref.ref[Tensor]"] = {}
        for x in tree_flatten(batch)[0]:
            if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == B:
                self._from_batch[id(x)] = weakref.ref(x)

    def _batched(self, x: Any) -> bool:
        r = self._from_batch.get(id(x)) if isinstance(x, Tensor) else None
        return r is not None and r() is x

    def _draw_of(self, name: str, args, kwargs) -> Optional[str]:
        """Why this call's draw is not per example on dim 0 (None: it is, or it draws nothing)."""
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if name in _FUSED_RNNS:  # (input, [batch_sizes,] hx, weights, bias, layers, dropout, train, ...)
            flt = [i for i, a in enumerate(args) if isinstance(a, float)]
            if not flt or args[flt[0]] == 0 or not (len(args) > flt[0] + 1 and args[flt[0] + 1] is not False) \
                    or (flt[0] > 0 and args[flt[0] - 1] == 1):  # (one layer: no dropout between layers)
                return None
            return f"{name} with dropout {args[flt[0]]:g} between its layers (drawn inside the fused kernel)"
        if name == "scaled_dot_product_attention":
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if not p or not isinstance(x, Tensor) or x.device.type == "cpu":
                return None  # (the CPU's math kernel draws as vmap does)
            return f"scaled_dot_product_attention with dropout_p={p:g} on {x.device.type} (the kernel's own sampling)"
        if name in _DROPOUTS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            if train is None:
                train = True  # (native_dropout's train=None is training)
            if not train or (isinstance(p, (int, float)) and p == 0):
                return None
        elif name == "rrelu" or name == "rrelu_":
            if not (args[3] if len(args) > 3 else kwargs.get("training", False)):
                return None
        elif name == "normal":
            if not any(isinstance(a, Tensor) for a in (*args[:2], kwargs.get("mean"), kwargs.get("std"))):
                size = args[2] if len(args) > 2 else kwargs.get("size")
                if _first(size) == self.B:
                    self.fragile = True
                    return None
                return f"normal(size={tuple(size) if size else size})"
            x = next(a for a in (*args[:2], kwargs.get("mean"), kwargs.get("std")) if isinstance(a, Tensor))
        elif name in _FACTORIES:
            if name == "randperm":
                return "randperm"
            if name == "randint":
                size = next((a for a in args if isinstance(a, (list, tuple))), kwargs.get("size"))
            else:
                size = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else (
                    args or kwargs.get("size"))
            if _first(size) == self.B:
                self.fragile = True
                return None
            return f"{name}(size={tuple(size) if size else size})"
        elif name not in _DRAWS_LIKE:
            return None
        if not isinstance(x, Tensor):
            return None
        if not self._batched(x):
            return f"{name} on a {tuple(x.shape)} tensor that does not come from the batch"
        if x.dim() == 0 or x.shape[0] != self.B:
            return f"{name} on a {tuple(x.shape)} tensor from the batch whose first dimension is not the batch's"
        if self.B in x.shape[1:]:  # ((T, B, d) with T = B reads as batch-first: so at this B only)
            self.fragile = True
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.found is None and (name in _DROPOUTS or name in _DRAWS_LIKE or name in _FACTORIES
                                   or name in _FUSED_RNNS or name in ("normal", "rrelu", "rrelu_",
                                                                      "scaled_dot_product_attention")):
            why = self._draw_of(name, args, kwargs)
            if why is not None:
                caller = sys._getframe(1)
                while caller.f_back is not None and (_in_torch(caller.f_code.co_filename)
                                                     or _exempt(caller.f_code.co_filename)):
                    caller = caller.f_back  # (the model's line, not torch's dropout module or overrides)
                self.found = f"{why} ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
        out = func(*args, **kwargs)
        if any(self._batched(a) for a in tree_flatten((args, kwargs))[0]):
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self._from_batch[id(t)] = weakref.ref(t)
            if (name.endswith("_") or name == "__setitem__") and args and isinstance(args[0], Tensor):
                self._from_batch[id(args[0])] = weakref.ref(args[0])  # (written with the batch's values)
        return out


# Set while a ``DropoutOff`` block runs (this thread / context only): a torch.utils.checkpoint
# non-reentrant checkpoint made meanwhile recomputes its function under a DropoutOff of its own. The
# recomputation in the backward runs without the function modes that were active in the forward, so
# it dropped where the forward had not, and the checkpoint refused (CheckpointError; round 46: GPT-2
# with gradient checkpointing and dropout in training failed every step). The recomputation still runs,
# as in the step (review, round 46: running the checkpoints plainly instead hid a module that mixes
# examples only when recomputed, 1.29 C). ``torch.distributed._composable.checkpoint`` imports the
# generator by name: its name is rebound too (``_IMPORTED_BY_NAME``); other such copies are not reached.
_DROPOUT_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("pdpsgd_dropout_off", default=False)


def _install_recompute_dropout_off() -> bool:
    """Wrap torch.utils.checkpoint's non-reentrant generator once (process-wide): while
    ``_DROPOUT_OFF`` is set, the function it recomputes runs under ``DropoutOff``. False if this
    torch has no such generator."""
    import torch.utils.checkpoint as cp

    gen = getattr(cp, "_checkpoint_without_reentrant_generator", None)
    if gen is None:
        return False
    if getattr(gen, "_pdpsgd_dropout_off", False):
        for name in _IMPORTED_BY_NAME:  # (loaded since: its own name for the generator, the original)
            mod = sys.modules.get(name)
            if mod is not None and getattr(mod, "_checkpoint_without_reentrant_generator", None) is gen.__wrapped__:
                mod._checkpoint_without_reentrant_generator = gen
        return True

    @functools.wraps(gen)
    def generator(fn, *args, **kwargs):
        if _DROPOUT_OFF.get():
            inner = fn

            @functools.wraps(inner)
            def fn(*a, **k):  # (the forward's call is the caller's own, under its DropoutOff; this is the recomputation's)
                with DropoutOff():
                    return inner(*a, **k)

        return gen(fn, *args, **kwargs)

    generator._pdpsgd_dropout_off = True  # type: ignore[attr-defined]
    cp._checkpoint_without_reentrant_generator = generator
    return _install_recompute_dropout_off()  # (and in the modules that import it by name)


# modules that import the generator by name (review, round 46: torch.distributed's composable checkpoint,
# with a mask-style dropout and a statistic mixing examples in the backward only, passed the check: 4.5 C)
_IMPORTED_BY_NAME = ("torch.distributed._composable.checkpoint_activation",)


class DropoutOff(TorchFunctionMode):
    """A TorchFunctionMode under which torch's dropouts drop nothing: every call of a dropout function
    (``F.dropout`` and its 1d/2d/3d, alpha and feature forms, ``torch.dropout``, ``native_dropout``, the
    in-place ones; so every ``nn.Dropout`` module) runs with rate 0, and ``scaled_dot_product_attention``
    and ``multi_head_attention_forward`` (``nn.MultiheadAttention``'s, whose inner calls a mode does not
    see) with ``dropout_p=0``. Other random draws (``bernoulli_`` on a tensor of one's own, a drop path, an
    RNN's dropout between layers) are left as they are. For the example-order check of a training-mode
    forward whose only random numbers are dropout (``bookkeeping._draws_nothing`` decides; ``pdpsgd check``
    compares losses under it too): its runs then compare as they do without dropout, and a batch statistic
    taken in training only is seen. A non-reentrant checkpoint made inside recomputes under DropoutOff too
    (round 46: the recomputation runs without this mode, and was refused)."""

    def __enter__(self):
        _install_recompute_dropout_off()
        # (non-reentrant checkpoints made inside recompute under DropoutOff too: see ``_DROPOUT_OFF``)
        self.__dict__.setdefault("_tokens", []).append(_DROPOUT_OFF.set(True))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _DROPOUT_OFF.reset(self._tokens.pop())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _DROPOUTS:
            if len(args) > 1:
                args = (args[0], 0.0, *args[2:])
            else:
                kwargs["p"] = 0.0
        elif name == "scaled_dot_product_attention":
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs["dropout_p"] = 0.0
        elif name == "multi_head_attention_forward":  # (nn.MultiheadAttention's: the calls inside it, its
            if len(args) > 10:                         # F.dropout and SDPA, are not seen by a mode; review)
                args = (*args[:10], 0.0, *args[11:])
            else:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _in_torch(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_TORCH_DIR)


def _first(size: Any) -> Optional[int]:
    try:
        return int(size[0]) if size is not None and len(size) else None
    except (TypeError, ValueError):
        return None
