"""Small shared types: the values that flow between the pillars.

Leaf module: imports nothing from pdpsgd.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

Params = Dict[str, Tensor]
"""Trainable parameters by their (deduplicated) ``named_parameters`` name."""

Batch = Any
"""Any pytree (dict / tuple / list / tensor) whose tensor leaves share the leading dim B."""


class LossFn(Protocol):
    """``loss_fn(model, batch) -> Tensor[B]``: one loss per example (``reduction='none'``)."""

    def __call__(self, model: torch.nn.Module, batch: Batch) -> Tensor: ...


WeightsFn = Callable[[Dict[str, Tensor], Tensor, Tensor], Dict[str, Tensor]]
"""``weights_fn(sq_norms, losses, mask) -> weights``.

``sq_norms``: name -> Tensor[b], each example's squared gradient norm for that parameter
(the gradient summed over *all* uses of the parameter, tied weights included).
``losses``: Tensor[b]; ``mask``: BoolTensor[b] (False = padding).
Returns name -> Tensor[b] of per-example weights (clip factor; exactly 0 for masked or
non-finite examples). Applied per example, so an engine may call it chunk by chunk.
"""


class EngineResult(NamedTuple):
    """What a per-example engine (``per_sample`` or ``bookkeeping``) returns for one batch.

    Read-only: entries may share storage (with flat clipping every ``weights`` entry is one
    tensor; ``sq_norms`` and ``clipped_sum`` entries of stacked small parameters are views into
    one buffer), so an in-place edit of one would change others."""

    losses: Tensor  # (B,) per-example losses, detached
    sq_norms: Dict[str, Tensor]  # name -> (B,) per-example squared norms (float32 or wider)
    weights: Dict[str, Tensor]  # name -> (B,) the weights weights_fn returned
    clipped_sum: Dict[str, Tensor]  # name -> Σ_i weights[name][i] * g_i[name] (same shape as param)
    routes: Dict[str, str]  # name -> how it was computed ("vmap", "ghost", "explicit", ...)


class StepOutput(NamedTuple):
    grads: Dict[str, Tensor]
    per_sample_norms: Tensor
    loss: Tensor
    clip_fraction: Tensor  # kept examples clipped in some group (factor < 1) / kept; 1 under automatic clipping
    num_examples: Tensor
    num_nonfinite: Tensor
    noise_std: float
    routes: Dict[str, str]
    # per slot, like per_sample_norms (accumulated parts: concatenated in the order they were added):
    # True for a real example (the step's mask), and for a real one whose loss and gradient were finite
    # (not dropped by on_nonfinite="drop"); select per_sample_norms[out.kept] for the examples that trained
    mask: Optional[Tensor] = None
    kept: Optional[Tensor] = None
