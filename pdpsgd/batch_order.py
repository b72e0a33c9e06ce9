"""Seeing a forward order its batch by a computed index, even where that order is the identity.

Book-keeping reads row b of a layer's (B, ...) input as example b's. A model that sorts its batch
(by length, say, for ``pack_padded_sequence(enforce_sorted=True)``) and restores the order later
breaks that for the layers in between. The example-order check (``bookkeeping._order_disagree``)
sees a reordering by its effect on each example's norms, but only in the batch it checks, once per
batch shape: a batch whose order the sort leaves as it is (every length equal: every text truncated
to T) shows none, and a later batch of the same shape is reordered. ``ReorderWatch`` sees the
cause instead: while the check's first forward runs, it marks every integer or boolean tensor
computed from an ordering (``sort``, ``argsort``, ``topk``, ``randperm``, ``nonzero``, ``unique``,
...) and reports an op that selects or places the rows of a tensor whose first dimension is the
batch by such an index, whatever its values are in this batch.

Not seen: an order computed in Python (``sorted(...)`` turned into a tensor), one computed from
an index the model keeps between steps, and one on a code path this batch does not take. Calls
from torch's own ``torch.nn.utils.rnn`` / ``torch.nn.modules.rnn`` (``pack_padded_sequence``
sorts and restores the batch for the RNN, whose rules know it) and from pdpsgd are not watched.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Dict, Optional, Set

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["ReorderWatch"]

# ops whose integer outputs are an order, or positions found by value
ORDERINGS = frozenset({"sort", "argsort", "msort", "topk", "kthvalue", "randperm", "nonzero", "argwhere",
                       "unique", "unique_consecutive", "multinomial"})

# ops that select or place rows along a dimension: name -> (position of dim, position of index);
# keyword names ``dim`` and ``index`` (``indices`` for take_along_dim)
ROW_OPS = {name: (1, 2) for name in (
    "index_select", "index_copy", "index_copy_", "index_add", "index_add_", "index_fill", "index_fill_",
    "index_reduce", "index_reduce_", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_")}
ROW_OPS["take_along_dim"] = (2, 1)

_TORCH_RNN = (os.path.join("torch", "nn", "utils", "rnn.py"), os.path.join("torch", "nn", "modules", "rnn.py"))
_OURS = os.path.dirname(os.path.abspath(__file__))


def _exempt(filename: str) -> bool:
    return filename.endswith(_TORCH_RNN) or os.path.abspath(filename).startswith(_OURS + os.sep)


class ReorderWatch(TorchFunctionMode):
    """A TorchFunctionMode for one forward of a batch of ``B`` examples: ``found`` describes the first
    op that selected or placed the batch's rows by a computed order (None: none); ``after`` collects
    what the caller adds while ``found`` is set (the parameters of the layers that ran after it)."""

    def __init__(self, B: int):
        super().__init__()
        self.B = B
        self.found: Optional[str] = None
        self.after: Set[str] = set()
        self._marked: Dict[int, "weakref.ref[Tensor]"] = {}

    def _is_marked(self, x: Any) -> bool:
        if not isinstance(x, Tensor):
            return False
        r = self._marked.get(id(x))
        return r is not None and r() is x

    def _mark(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_floating_point() and not t.is_complex():
                self._marked[id(t)] = weakref.ref(t)

    def _rows_by_order(self, name: str, args, kwargs) -> bool:
        """Whether this call selects or places the rows (dim 0) of a (B, ...) tensor by a marked index."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != self.B:
            return False
        if name in ("__getitem__", "__setitem__", "index_put", "index_put_"):
            key = args[1] if len(args) > 1 else kwargs.get("indices")
            first = key[0] if isinstance(key, (tuple, list)) and len(key) else key
            return self._is_marked(first)
        pos = ROW_OPS.get(name)
        if pos is None:
            return False
        dim = args[pos[0]] if len(args) > pos[0] else kwargs.get("dim")
        index = args[pos[1]] if len(args) > pos[1] else kwargs.get("indices" if name == "take_along_dim" else "index")
        return isinstance(dim, int) and dim in (0, -x.dim()) and self._is_marked(index)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        caller = sys._getframe(1)
        watched = not _exempt(caller.f_code.co_filename)
        if watched and self.found is None and self._rows_by_order(name, args, kwargs):
            self.found = (f"{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}, by an index "
                          "computed from an ordering: sort, argsort, topk, nonzero, ...")
        out = func(*args, **kwargs)
        if watched and (name in ORDERINGS or any(self._is_marked(a) for a in tree_flatten((args, kwargs))[0])):
            self._mark(out)
        return out
