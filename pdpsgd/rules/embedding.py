"""nn.Embedding: y[t] = W[ids[t]]; padding_idx rows get no gradient."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .base import Index, Rule, Use, first_input


class EmbeddingRule(Rule):
    """G_W,i[v] = Σ_{t: ids[i,t]=v, v≠padding_idx} g[i,t]. Ghost norm masks on equal ids."""

    name = "embedding"
    needs_output = False
    rowwise = True
    broadcast_batch = True  # (1, T) ids (positions) are expanded to the batch by the engine

    def supports(self, module: nn.Module) -> Optional[str]:
        if module.max_norm is not None:
            return "max_norm renormalises the weight in place"
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq counts tokens over the whole batch"
        return None

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        ids = first_input(args, kwargs)
        if ids is None or ids.dim() < 1 or ids.is_floating_point():
            return None
        if ids.shape[0] == 1 and grad_output.shape[0] == batch_size:
            ids = ids.expand(batch_size, *ids.shape[1:])  # broadcast ids, see broadcast_batch
        if ids.shape[0] != batch_size:
            return None
        ids = ids.reshape(batch_size, -1).long()  # (B, T)
        d = module.weight.shape[1]
        g = grad_output.reshape(batch_size, -1, d)  # (B, T, d)
        if g.shape[1] != ids.shape[1]:
            return None
        if module.padding_idx is not None:
            pad = ids == module.padding_idx  # (B, T)
            g = torch.where(pad.unsqueeze(-1), torch.zeros((), dtype=g.dtype, device=g.device), g)
        return {"weight": Index(ids, g, int(module.weight.shape[0]))}


TYPES = (nn.Embedding,)
