"""Scaled word embeddings of Hugging Face models (Gemma 1–4, VaultGemma, BART, mBART, BioGPT, ...):
an ``nn.Embedding`` subclass whose forward is ``super().forward(ids) * embed_scale``.

Matched by class name ending in "ScaledWordEmbedding" with an ``embed_scale`` attribute, on the
class ``transformers`` defines (a user's class of such a name is not taken: the check compares
values, and a forward can stop the gradient without changing them; register the rule for your
class, ``registry.register(MyEmbedding, ScaledEmbeddingRule())``, if its forward is exactly
s·W[ids]), and *verified on every call*: the rule recomputes ``F.embedding(ids, W, padding_idx) * embed_scale``
and requires it to equal the module's output exactly; otherwise it returns None and the engine
falls back to exact vmap for that layer. Then out = s·W[ids], so G_W,i = s · (the embedding rule's
G_W,i of g), which is the embedding rule applied to s·g.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Rule, Use, first_input, transformers_own_class
from .embedding import EmbeddingRule


def is_scaled_embedding(module: nn.Module) -> bool:
    """transformers' ``nn.Embedding`` subclass named ``*ScaledWordEmbedding`` with an ``embed_scale``
    (number or 0-d tensor)."""
    s = getattr(module, "embed_scale", None)
    return (isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")
            and transformers_own_class(type(module))
            and (isinstance(s, (int, float)) and not isinstance(s, bool) or isinstance(s, Tensor) and s.dim() == 0))


class ScaledEmbeddingRule(Rule):
    """G_W,i[v] = s · Σ_{t: ids[i,t]=v, v≠padding_idx} g[i,t], after checking out == s · W[ids]."""

    name = "scaled_embedding"
    needs_output = True  # the check compares with what the layer returned
    rowwise = True
    checks_call = True  # matched by name: a call it declines is not the layer it knows

    def __init__(self) -> None:
        self._embedding = EmbeddingRule()

    def supports(self, module: nn.Module) -> Optional[str]:
        return self._embedding.supports(module)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        ids = first_input(args, kwargs, "input_ids")
        if ids is None or ids.is_floating_point() or ids.dim() < 1 or ids.shape[0] != batch_size:
            return None
        if not isinstance(output, Tensor) or grad_output is None:
            return None
        w = module.weight.detach()
        s = module.embed_scale
        s = s.detach().to(device=w.device, dtype=w.dtype) if isinstance(s, Tensor) else s  # as the forward scales
        ref = F.embedding(ids, w, module.padding_idx) * s
        if ref.shape != output.shape or ref.dtype != output.dtype or not torch.equal(ref, output):
            return None  # not the forward we know: exact fallback
        return self._embedding.uses(module, (ids,), {}, None, grad_output * s, batch_size)
