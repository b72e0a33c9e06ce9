"""Learned positional embeddings of Hugging Face models (OPT, BART, mBART, BioGPT, PLBart, ...): an
``nn.Embedding`` subclass whose forward computes position ids (from the input's shape, the
attention mask or ``position_ids``, plus an offset) and gathers them with ``super().forward``.

Matched by class name ending in "PositionalEmbedding" with a forward of its own, on the class
``transformers`` defines (a user's class is not taken: the checks compare values, which a forward
that detaches part of its output passes; register the rule for your class if its forward is a plain
gather). The rule finds
the ids the forward gathered by running that forward (the class's, without hooks) twice more on the
same arguments, with the weight replaced by index tables (row v holds v, then −(v+1); exact in
float64), and *verifies* them: both runs must give the same integer ids in [0, V) (the second
rules out a forward that scales, shifts, zeroes or rectifies what it gathered), the ids must be
(B or 1, T) — one row of positions per example, so a (T, d) table shared by the batch (Blenderbot,
LED) is declined even when T = B — and ``F.embedding(ids, W, padding_idx)`` must equal the module's
real output exactly; otherwise it returns None and the engine falls back to exact vmap for that
layer. The forward must be a pure function of its arguments, as these are. (Not checkable here: a
forward that gathers with ``self.weight[ids]`` although the module has a ``padding_idx``; HF's call
``super().forward``.)
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Rule, Use, transformers_own_class
from .embedding import EmbeddingRule


def is_positional_embedding(module: nn.Module) -> bool:
    """transformers' ``nn.Embedding`` subclass named ``*PositionalEmbedding`` that overrides ``forward``."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("PositionalEmbedding")
            and type(module).forward is not nn.Embedding.forward and transformers_own_class(type(module)))


def _run_with_weight(module: nn.Module, weight: Tensor, args, kwargs):
    """The class's forward (no hooks) with ``weight`` in place of the module's."""
    prev = module._parameters["weight"]
    module._parameters["weight"] = weight  # type: ignore[assignment]
    try:
        with torch.no_grad():
            return type(module).forward(module, *args, **kwargs)
    finally:
        module._parameters["weight"] = prev


class PositionalEmbeddingRule(Rule):
    """G_W,i[v] = Σ_{t: ids[i,t]=v, v≠padding_idx} g[i,t] with the ids the forward gathered (found, then checked)."""

    name = "positional_embedding"
    needs_output = True  # the check compares with what the layer returned
    broadcast_batch = True  # (1, T) positions are expanded to the batch by the engine
    batch_dim_of_output = True  # its first argument need not be batched: the probe follows the output's first dim

    def __init__(self) -> None:
        self._embedding = EmbeddingRule()

    def supports(self, module: nn.Module) -> Optional[str]:
        return self._embedding.supports(module)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        if not isinstance(output, Tensor) or grad_output is None or output.dim() != 3:
            return None  # (B or 1, T, d) only: one row of positions per example
        w = module.weight.detach()
        V, d = w.shape
        v = torch.arange(V, dtype=torch.float64, device=w.device)[:, None]
        try:
            got = _run_with_weight(module, v.expand(V, d), args, kwargs)  # row v = v
            neg = _run_with_weight(module, (-1.0 - v).expand(V, d), args, kwargs)  # row v = −(v+1)
        except Exception:  # a forward that cannot run on the index tables: not one we know
            return None
        if not isinstance(got, Tensor) or not isinstance(neg, Tensor) or got.shape != neg.shape \
                or got.dim() != 3 or got.shape[1:] != output.shape[1:] or got.shape[0] not in (1, output.shape[0]):
            return None
        ids = got[..., :1]
        ok = (got == ids).all() & (neg == -1.0 - ids).all() & (ids == ids.round()).all() & (ids >= 0).all() \
            & (ids < V).all()
        ids = ids[..., 0].clamp(0, V - 1).long()  # (B or 1, T) (clamped for the check below; ``ok`` has the range)
        ref = F.embedding(ids, w, module.padding_idx)
        if ref.dtype != output.dtype:
            return None
        ok = ok & (ref == output).all()  # (ref broadcasts over an expanded batch); one host read
        if not bool(ok):
            return None  # not a plain gather at these ids: exact fallback
        return self._embedding.uses(module, (ids,), {}, None, grad_output, batch_size)
