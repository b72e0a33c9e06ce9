"""Learned positional embeddings of Hugging Face models (OPT, BART, mBART, BioGPT, PLBart, ...): an
``nn.Embedding`` subclass whose forward computes position ids (from the input's shape, the
attention mask or ``position_ids``, plus an offset) and gathers them with ``super().forward``.

Matched by class name ending in "PositionalEmbedding" with a forward of its own. The rule finds
the ids the forward gathered by running that forward once more on the same arguments with the
weight replaced by an index table (row v holds v, exact in float64), and *verifies* them: the ids
must be integers in [0, V) and ``F.embedding(ids, W, padding_idx)`` must equal the module's real
output exactly; otherwise it returns None and the engine falls back to exact vmap for that layer.
(The forward runs twice, so it must be a pure function of its arguments, as these forwards are.)
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Rule, Use
from .embedding import EmbeddingRule


def is_positional_embedding(module: nn.Module) -> bool:
    """An ``nn.Embedding`` subclass named ``*PositionalEmbedding`` that overrides ``forward``."""
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("PositionalEmbedding")
            and type(module).forward is not nn.Embedding.forward)


class PositionalEmbeddingRule(Rule):
    """G_W,i[v] = Σ_{t: ids[i,t]=v, v≠padding_idx} g[i,t] with the ids the forward gathered (found, then checked)."""

    name = "positional_embedding"
    needs_output = True  # the check compares with what the layer returned
    broadcast_batch = True  # (1, T) positions are expanded to the batch by the engine

    def __init__(self) -> None:
        self._embedding = EmbeddingRule()

    def supports(self, module: nn.Module) -> Optional[str]:
        return self._embedding.supports(module)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        if not isinstance(output, Tensor) or grad_output is None or output.dim() < 2:
            return None
        w = module.weight.detach()
        V, d = w.shape
        index = torch.arange(V, dtype=torch.float64, device=w.device)[:, None].expand(V, d)  # row v = v
        try:
            with torch.no_grad():
                got = torch.func.functional_call(module, {"weight": index}, args, kwargs)
        except Exception:  # a forward that cannot run on the index table: not one we know
            return None
        if not isinstance(got, Tensor) or got.dim() != output.dim() or got.shape[1:] != output.shape[1:] \
                or got.shape[0] not in (1, output.shape[0]):
            return None
        ids = got[..., 0]
        ok = (got == ids.unsqueeze(-1)).all() & (ids == ids.round()).all() & (ids >= 0).all() & (ids < V).all()
        if not bool(ok):
            return None
        ids = ids.long()
        ref = F.embedding(ids, w, module.padding_idx)
        if ref.dtype != output.dtype or not torch.equal(ref.expand_as(output), output):
            return None  # not a plain gather at these ids: exact fallback
        return self._embedding.uses(module, (ids,), {}, None, grad_output, batch_size)
