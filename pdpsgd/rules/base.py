"""What a rule returns: each use of a parameter as a factored per-example gradient.

A rule looks at one call of one layer (its input, output and output gradient, all batched with
leading dim B) and says, for each of the layer's parameters, how example i's gradient *from this
call* is built. Three forms cover every rule we ship:

* ``Dense(L, R)``: G_i = Σ_t L[i,t] ⊗ R[i,t], an outer-product sum of shape (P0, P1) reshaped to
  the parameter's shape (Linear: L = output grad, R = input). ``R=None`` means G_i = Σ_t L[i,t]
  (biases).
* ``Index(ids, R, num_rows)``: G_i[v] = Σ_{t: ids[i,t]=v} R[i,t] (Embedding; ``ids`` are row
  indices, rows with R = 0 contribute nothing, which is how padding_idx is honoured).
* ``Explicit(G)``: G (B, *shape), the per-example gradient itself (norm layers: (B, d), cheap).

Formal guarantee: a rule is correct iff Σ over its calls of the returned G_i equals the exact
gradient of loss_i w.r.t. the parameter through that layer's forward; the engine sums the uses of
a parameter (tied weights, layers called several times) before taking norms, so cross terms are
included exactly.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["Dense", "Index", "Explicit", "Use", "Rule", "CaptureAdapter", "as_btd", "first_input"]


@dataclass
class Dense:
    """G_i = Σ_t L[i,t] ⊗ R[i,t] -> (P0, P1); with R None, G_i = Σ_t L[i,t] -> (P0,)."""

    L: Tensor  # (B, T, P0)
    R: Optional[Tensor]  # (B, T, P1) or None
    src: Optional[torch.dtype] = None  # as ``Explicit.src``

    @property
    def T(self) -> int:
        return int(self.L.shape[1])


@dataclass
class Index:
    """G_i[v] = Σ_{t: ids[i,t] = v} R[i,t] -> (num_rows, d)."""

    ids: Tensor  # (B, T) int64 in [0, num_rows)
    R: Tensor  # (B, T, d); rows to ignore are exactly 0
    num_rows: int
    src: Optional[torch.dtype] = None  # as ``Explicit.src``

    @property
    def T(self) -> int:
        return int(self.ids.shape[1])


@dataclass
class Explicit:
    """The per-example gradient of this use, (B, *param_shape)."""

    G: Tensor
    # the narrowest floating dtype the use was computed from (set by the engine): of the call's
    # inputs and output gradient, or the autocast dtype the call ran under (G itself may be wider,
    # a float32 output gradient may carry a bf16 layer's rounding). Its rounding unit is what the
    # batched and single-example values can differ by (``bookkeeping._use_eps``)
    src: Optional[torch.dtype] = None


Use = Union[Dense, Index, Explicit]


def as_btd(x: Tensor, B: int) -> Optional[Tensor]:
    """(B, *, d) -> (B, T, d) with T = prod(*) (1 if none); None if x is not batch-first (B, ...)."""
    if x.dim() < 2 or x.shape[0] != B:
        return None
    return x.reshape(B, -1, x.shape[-1])


def module_attr(module: nn.Module, name: str, default: Any = None) -> Any:
    """``getattr(module, name, default)``, without raising (and catching) an AttributeError when the
    module has no such attribute (what ``nn.Module.__getattr__`` does, ~3 µs a time, for every
    module at every step): where the class neither has the name nor overrides ``__getattr__``,
    only the instance dict and nn.Module's registries can hold it, and they are read directly."""
    cls = type(module)
    if cls.__getattr__ is not nn.Module.__getattr__ or hasattr(cls, name):
        return getattr(module, name, default)  # (a property, a class attribute, a custom __getattr__)
    d = module.__dict__
    if name in d:
        return d[name]
    for reg in ("_parameters", "_buffers", "_modules"):
        r = d.get(reg)
        if r is not None and name in r:
            return r[name]
    return default


def transformers_own_class(cls: type) -> bool:
    """Whether ``cls`` is the class a ``transformers`` module defines under its name (not a user's
    class of the same name, nor a subclass that overrides its forward elsewhere). Rules matched by
    class name take only these: their check on each call compares *values*, which cannot see a
    forward that stops or reroutes the gradient without changing the value (review, round 35: a
    user's ``*ScaledWordEmbedding`` with ``torch.where(ids == k, out.detach(), out)`` was taken)."""
    mod = getattr(cls, "__module__", "") or ""
    return mod.startswith("transformers.") and getattr(sys.modules.get(mod), cls.__name__, None) is cls


def first_input(args: Tuple[Any, ...], kwargs: Mapping[str, Any], name: str = "input") -> Optional[Tensor]:
    """The layer's tensor input: first positional argument, or keyword ``name``."""
    x = args[0] if args else kwargs.get(name)
    return x if isinstance(x, Tensor) else None


class Rule:
    """Base class: per-example gradient factors of one layer type (see module docstring).

    Subclasses implement ``uses`` and may refine ``supports``. ``uses`` returns None when this
    particular call cannot be handled (unusual input layout, config the rule does not cover): the
    engine then computes that layer's parameters exactly with vmap instead. Never guess.
    """

    name = "rule"
    # A rule whose layer hides the activations it needs (e.g. an LSTM's gates) sets this and
    # implements ``forward(module, args, kwargs) -> (output, capture) | None`` (run instead of the
    # layer's forward while the engine captures; None, or a str saying why, declines the call) and
    # ``custom_uses(module, capture, grads, batch_size)``, where ``capture.targets`` are the tensors
    # whose gradients the engine passes back as ``grads`` (None where one does not reach the loss).
    custom_forward = False
    # Whether ``uses`` reads the values of ``output``. A rule that does not sets this False: the
    # engine then releases the layer's output after the forward (``output`` is passed as None).
    needs_output = True
    # Whether ``uses`` may run inside the backward, as soon as the output gradient is known, because
    # it returns small explicit uses only (e.g. LayerNorm's (B, d)): the layer's input and output
    # gradient are then released at once. Requires ``needs_output = False``.
    eager = False
    # Whether the layer acts on each row of its input alone (row r of the output from row r of the
    # input; normalisation over trailing dims only): the engine may then give it a batch that the
    # model flattened, (B·T, ...) as (B, T, ...), once it has traced the rows to their examples
    # (``bookkeeping._flat_rows``), and follows the flattening through its output.
    rowwise = False
    # Whether the rule is matched by name and checks each call against the layer's output in
    # ``uses`` (returning None when it is not the layer it knows): a flattened batch is traced
    # through such a layer only when its rule accepted that call.
    checks_call = False
    # A rule may instead check each call as it runs: ``verify(module, args, kwargs, output) -> bool``
    # is called right after the layer's forward (with the step's parameter values in place, before
    # the model may edit the output in place; under no_grad, with the dispatch modes in force set
    # aside); False, or an exception, sends that call's layer to the fallback. It then needs no
    # output in ``uses`` (``needs_output = False``).
    verify = None
    # A rule that sets this gets ``wanted`` (frozenset: the names, in the layer, of the parameters
    # the step trains) as a keyword argument of ``uses``, and may leave the others out (e.g. skip a
    # frozen weight's per-example gradient when only the bias is trained).
    wants_names = False
    # A custom-forward rule that takes one axis of the layer's first input as the batch (torch's
    # MultiheadAttention: dim 0 or 1 by ``batch_first``) sets ``batch_axis(module, args, kwargs) ->
    # Optional[int]``: the batch-dimension probe then checks that this axis follows the batch size
    # (a size equal to B by coincidence, T = B, sends the layer to the fallback).
    batch_axis = None

    def supports(self, module: nn.Module) -> Optional[str]:
        """None if the layer's configuration is covered, else a short reason (-> vmap fallback)."""
        return None

    def uses(
        self,
        module: nn.Module,
        args: Tuple[Any, ...],
        kwargs: Mapping[str, Any],
        output: Tensor,
        grad_output: Tensor,
        batch_size: int,
    ) -> Optional[Dict[str, Use]]:
        raise NotImplementedError


class CaptureAdapter:
    """Replaces one method of a (non-layer) module while the engine captures, so that a ruled layer
    inside it is called on batched input where the model would broadcast a batch-free result.

    Example: T5 looks its relative attention bias up once per forward on (T, T) position buckets
    and broadcasts the (1, H, T, T) result over the batch; its gradient then is the batch's sum and
    no rule can split it by example. The adapter (``rules.t5_relative_bias``) looks the same buckets
    up expanded to (B, T, T): the same values, now with a batch dimension, so the embedding's own
    rule gives each example's gradient.

    Contract: ``wrap(module, batch_size)`` returns the replacement for ``module.<method>``, which
    must return the same values as the original (broadcast to the batch, at most) or call the
    original unchanged, never anything else; the engine's batch-dimension probe and example-order
    check then apply to the ruled layers it calls as to any other.
    """

    name = "adapter"
    method = ""  # the name of the module's method that ``wrap`` replaces

    def wrap(self, module: nn.Module, batch_size: int):  # pragma: no cover - interface
        raise NotImplementedError
