"""DeBERTa (v1, ``transformers.models.deberta``): its own LayerNorm class and the attention's raw
query/value biases.

* ``DebertaLayerNorm`` normalises in float32 with the epsilon inside the square root and then
  applies ``weight * x̂ + bias`` (x̂ cast back to the input's dtype): G_w,i = Σ_t g ⊙ x̂,
  G_b,i = Σ_t g, x̂ recomputed exactly as its forward does.
* ``DisentangledSelfAttention`` owns two raw parameters, ``q_bias`` and ``v_bias`` (H·dh each),
  added to the query and value heads after its bias-free ``in_proj``:
  ``query_layer = chunk(transpose_for_scores(in_proj(h)))[0] + transpose_for_scores(q_bias)``.
  The query (value) columns of ``in_proj``'s output feed only that sum, so its output gradient's
  query (value) columns are the bias's per-token gradient: G_qb,i = Σ_t g_q[i, t] with g_q the
  query columns of ∂L/∂(in_proj output), per head [q | k | v] as ``transpose_for_scores`` splits
  them (a ``Dense`` bias use). The rule runs the attention's own forward unchanged (a custom-forward
  rule only to keep ``in_proj``'s output as a capture target, through a forward hook held for that
  call), so every value is the model's.

Both are taken only for transformers' own classes whose methods are exactly the code these rules
were written against (syntax-tree fingerprints, as ``rules/deberta_relative.py``); anything else
takes the exact fallback. Not covered here: DeBERTa v1's relative positions (its encoder hands every
layer the raw table ``rel_embeddings.weight``, projected batch-free): the table and the position
projections still take the exact fallback; so does an attention called with ``query_states`` (the
enhanced mask decoder's path, which does not call ``in_proj``).
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .base import Dense, Explicit, Rule, Use, first_input
from .deberta_relative import matches_known

__all__ = ["DebertaLayerNormRule", "DebertaV1AttentionBiasRule", "is_deberta_layernorm",
           "is_deberta_v1_attention"]

_MODULE = "transformers.models.deberta.modeling_deberta"

# transformers 5.24's DeBERTa (v1) code these rules were written against (``_fingerprint``).
_KNOWN = {
    "DebertaLayerNorm.forward": "16c01ad3776f206c92193e715cf96d8091f802d12140c1cd19d7896d9253d97d",
    "DisentangledSelfAttention.forward": "070579ab6422a668e18b097b3543e28c9c96cace55e9396bf573677d6e90f549",
    "DisentangledSelfAttention.transpose_for_scores":
        "d6458812708c2f6c865cb35b7b6676741fa8143116c339f62fc468c42964c57d",
}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _is_v1(module: nn.Module, name: str) -> bool:
    """transformers' own DeBERTa (v1) class of that name (by name: nothing imported per call)."""
    kind = type(module)
    return kind.__module__ == _MODULE and kind.__name__ == name \
        and getattr(sys.modules.get(_MODULE), name, None) is kind


def _known(cls: type, method: str) -> bool:
    return matches_known(_KNOWN, cls, method)


def is_deberta_layernorm(module: nn.Module) -> bool:
    """DeBERTa v1's ``DebertaLayerNorm``, exactly the known code, with its weight and bias."""
    return (_is_v1(module, "DebertaLayerNorm") and _known(type(module), "forward")
            and set(module._parameters) == {"weight", "bias"}
            and isinstance(module.__dict__.get("variance_epsilon"), float))


class DebertaLayerNormRule(Rule):
    """G_w,i = Σ_t g ⊙ x̂, G_b,i = Σ_t g (B, d), x̂ as ``DebertaLayerNorm.forward`` computes it."""

    name = "deberta_layernorm"
    needs_output = False
    rowwise = True
    eager = True

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "hidden_states")
        if x is None or x.dim() < 2 or x.shape[0] != batch_size or module.weight.dim() != 1:
            return None
        # x̂ line for line as the forward: float32, the mean subtracted, epsilon inside the root
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        xhat = ((h - mean) / torch.sqrt(variance + module.variance_epsilon)).to(x.dtype)  # (B, *, d)
        acc = _acc(torch.promote_types(x.dtype, module.weight.dtype))
        g = grad_output.to(acc)  # (B, *, d)
        red = tuple(range(1, g.dim() - 1))  # dims summed per example
        gw = g * xhat.to(acc)
        return {"weight": Explicit(gw.sum(red) if red else gw), "bias": Explicit(g.sum(red) if red else g)}


def is_deberta_v1_attention(module: nn.Module) -> bool:
    """DeBERTa v1's ``DisentangledSelfAttention``, exactly the known code, owning q_bias and v_bias."""
    cls = type(module)
    return (_is_v1(module, "DisentangledSelfAttention") and _known(cls, "forward")
            and _known(cls, "transpose_for_scores") and set(module._parameters) == {"q_bias", "v_bias"}
            and isinstance(module._modules.get("in_proj"), nn.Linear))


@dataclass
class _InProjCapture:
    targets: List[Tensor]  # in_proj's output(s) of this call, (B, T, 3·H·dh)


class DebertaV1AttentionBiasRule(Rule):
    """q_bias / v_bias from the query / value columns of ``in_proj``'s output gradient (see the
    module docstring); the attention's forward runs as it is."""

    name = "deberta_v1_attention_bias"
    custom_forward = True

    def supports(self, module: nn.Module) -> Optional[str]:
        return None if is_deberta_v1_attention(module) else "not the DeBERTa attention code this rule knows"

    def forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        """(the attention's own output, the in_proj output as a capture target), or None to decline."""
        original = type(module).forward
        try:
            bound = inspect.signature(original).bind(module, *args, **kwargs)
        except TypeError:
            return None
        hs = bound.arguments.get("hidden_states")
        if bound.arguments.get("query_states") is not None or not isinstance(hs, Tensor) or hs.dim() != 3:
            return None  # (query_states: in_proj is not called; the exact fallback)
        seen: List[Tensor] = []

        def keep(mod, inp, out):
            if not isinstance(out, Tensor):
                return None
            if torch.is_grad_enabled() and not out.requires_grad and out.is_floating_point():
                # make its gradient reachable (nothing upstream is trained): out − 0 through a scalar leaf
                out = torch.sub(out, torch.zeros((), dtype=out.dtype, device=out.device, requires_grad=True))
                seen.append(out)
                return out
            seen.append(out)
            return None

        hook = module._modules["in_proj"].register_forward_hook(keep)
        try:
            output = original(module, *args, **kwargs)
        finally:
            hook.remove()
        return output, _InProjCapture(seen)

    def custom_uses(self, module: nn.Module, capture: _InProjCapture, grads: List[Optional[Tensor]],
                    batch_size: int) -> Optional[Dict[str, Use]]:
        if len(capture.targets) != 1:
            return None  # the known forward calls in_proj once on this path; anything else: fallback
        qp, g = capture.targets[0], grads[0]
        H, D = module.num_attention_heads, module.all_head_size
        if qp.dim() != 3 or qp.shape[0] != batch_size or qp.shape[-1] != 3 * D or D % H:
            return None
        B, T = qp.shape[0], qp.shape[1]
        acc = _acc(torch.promote_types(qp.dtype, module.q_bias.dtype))
        g = torch.zeros(qp.shape, dtype=acc, device=qp.device) if g is None else g.to(acc)
        dh = D // H
        g4 = g.view(B, T, H, 3 * dh)  # (B, T, 3·H·dh) -> (B, T, H, [q | k | v]), as transpose_for_scores splits it
        gq = g4[..., :dh].reshape(B, T, D)  # (B, T, H·dh): q_bias[h·dh + j] <- head h, column j
        gv = g4[..., 2 * dh:].reshape(B, T, D)
        return {"q_bias": Dense(gq, None), "v_bias": Dense(gv, None)}
