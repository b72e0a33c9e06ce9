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

* Relative positions: the encoder hands every layer the raw table ``rel_embeddings.weight`` (2k, d),
  which each attention drops out (``pos_dropout``) and projects batch-free (``pos_proj`` /
  ``pos_q_proj`` on (1, 2span, d)), so no rule could split their gradients by example. While the
  engine captures (and in its batch-dimension probe), ``DebertaV1RelEmbeddingAdapter`` replaces the
  encoder's ``get_rel_embedding``: the table is looked up through the embedding itself on positions
  0..2k-1 expanded to (B, 2k) (its rule gives each example's use; the same values, one copy per
  example) — only while every attention under the encoder is run by the rule below (else the
  model's own table). The attention rule then runs the model's forward with ``pos_dropout`` drawing
  one mask of the batch-free shape (2k, d) for every example (the model's own draws) and
  ``disentangled_att_bias`` projecting each example's copy, (B, 2span, d) -> (B, H, 2span, dh), where
  the model projects one and broadcasts it: the same values, and the projections' Linear rule sees
  a per-example call. It takes as per-example copies only the tensor the adapter made.

All are taken only for transformers' own classes whose methods are exactly the code these rules
were written against (syntax-tree fingerprints, as ``rules/deberta_relative.py``); anything else
takes the exact fallback. An attention called with ``query_states`` (the enhanced mask decoder's
path, which does not call ``in_proj``) is declined (exact fallback), or, handed the per-example
table, refused with an error (the capture then runs again without the adapter: exact fallback).
"""
from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .base import CaptureAdapter, Dense, Explicit, Rule, Use, first_input
from .deberta_relative import _SharedDropout, matches_known, table_per_example

__all__ = ["DebertaLayerNormRule", "DebertaV1AttentionBiasRule", "DebertaV1RelEmbeddingAdapter",
           "is_deberta_layernorm", "is_deberta_v1_attention", "is_deberta_v1_rel_encoder"]

_MODULE = "transformers.models.deberta.modeling_deberta"

# transformers 5.24's DeBERTa (v1) code these rules were written against (``_fingerprint``).
_KNOWN = {
    "DebertaLayerNorm.forward": "16c01ad3776f206c92193e715cf96d8091f802d12140c1cd19d7896d9253d97d",
    "DisentangledSelfAttention.forward": "070579ab6422a668e18b097b3543e28c9c96cace55e9396bf573677d6e90f549",
    "DisentangledSelfAttention.transpose_for_scores":
        "d6458812708c2f6c865cb35b7b6676741fa8143116c339f62fc468c42964c57d",
    "DisentangledSelfAttention.disentangled_att_bias":
        "716bbfd409adc8aa511bbc53948101b1a5b21db915bee08f7609cc0183307853",
    "DebertaEncoder.get_rel_embedding": "d8d986f0753424022d087e7b31d58d702bc18bf1a8dca313778b96d447e78739",
    # the code that carries the table from the encoder to each attention (it must only pass it on)
    "DebertaEncoder.forward": "02e6a00ea346b73b87a8b4816f35706ed77b50cea215c12bb8ff9a7182ed5ba8",
    "DebertaLayer.forward": "5b3d4957b0c280b7dd62942ae94a39597fa017ac4eb0b1accbb4bdc2a3471351",
    "DebertaAttention.forward": "c4c787be1665af6e3306664192938678c63735b1c0ef7f415de7640eba8f1d72",
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
            and _known(cls, "transpose_for_scores") and _known(cls, "disentangled_att_bias")
            and set(module._parameters) == {"q_bias", "v_bias"}
            and isinstance(module._modules.get("in_proj"), nn.Linear))


def is_deberta_v1_rel_encoder(module: nn.Module) -> bool:
    """DeBERTa v1's encoder with relative attention (an nn.Embedding table), exactly the known code,
    its layers too (the code that hands the table on to each attention: it only passes it on)."""
    if not _is_v1(module, "DebertaEncoder"):
        return False
    layers = module._modules.get("layer")
    return (module.__dict__.get("relative_attention") is True
            and isinstance(module._modules.get("rel_embeddings"), nn.Embedding)
            and _known(type(module), "get_rel_embedding") and _known(type(module), "forward")
            and isinstance(layers, nn.ModuleList) and len(layers) > 0
            and all(_is_v1(la, "DebertaLayer") and _known(type(la), "forward")
                    and _is_v1(la._modules.get("attention"), "DebertaAttention")
                    and _known(type(la._modules["attention"]), "forward") for la in layers))


class _PerExampleTable(torch.Tensor):
    """Marks the (B, 2k, d) table the adapter made (a subclass view of it: the same storage and
    autograd history), so that the attention rule takes as per-example copies only this tensor."""


class DebertaV1RelEmbeddingAdapter(CaptureAdapter):
    """The encoder's ``get_rel_embedding`` per example: (2k, d) -> the same values as (B, 2k, d)."""

    name = "deberta_v1_rel_embeddings"
    method = "get_rel_embedding"

    def wrap(self, module: nn.Module, batch_size: int):
        original = type(module).get_rel_embedding
        attentions = [m for m in module.modules() if _is_v1(m, "DisentangledSelfAttention")]

        def get_rel_embedding(*args, **kwargs):
            # every attention that could receive the table must be run by the rule below right now
            # (the engine's capture or its probe): else the model's own (2k, d) table
            if args or kwargs or not attentions or not all(
                    isinstance(getattr(m.__dict__.get("forward"), "rule", None), DebertaV1AttentionBiasRule)
                    for m in attentions):
                return original(module, *args, **kwargs)
            return table_per_example(module._modules["rel_embeddings"], batch_size).as_subclass(_PerExampleTable)

        return get_rel_embedding


_signature = functools.lru_cache(maxsize=None)(inspect.signature)  # (per class: every attention call binds it)


@dataclass
class _InProjCapture:
    targets: List[Tensor]  # in_proj's output(s) of this call, (B, T, 3·H·dh)


class DebertaV1AttentionBiasRule(Rule):
    """q_bias / v_bias from the query / value columns of ``in_proj``'s output gradient (see the
    module docstring); the attention's forward runs as it is."""

    name = "deberta_v1_attention_bias"
    custom_forward = True
    probe_forward = True  # (the probe must see the per-example position projections the capture makes)

    def supports(self, module: nn.Module) -> Optional[str]:
        return None if is_deberta_v1_attention(module) else "not the DeBERTa attention code this rule knows"

    def forward(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]):
        """(the attention's own output, the in_proj output as a capture target), or None to decline."""
        original = type(module).forward
        try:
            bound = _signature(original).bind(module, *args, **kwargs)
        except TypeError:
            return None
        hs = bound.arguments.get("hidden_states")
        rel = bound.arguments.get("rel_embeddings")
        per_example = isinstance(rel, _PerExampleTable)
        if bound.arguments.get("query_states") is not None or not isinstance(hs, Tensor) or hs.dim() != 3:
            if per_example:  # the model's code would read the (B, 2k, d) table as its (2k, d) one
                raise ValueError("DeBERTa v1 adapter: an attention call the rule does not take was handed the "
                                 "per-example position table")
            return None  # (query_states: in_proj is not called; the exact fallback)
        if per_example and (rel.dim() != 3 or rel.shape[0] != hs.shape[0]):
            raise ValueError(f"DeBERTa v1 adapter: a per-example position table of {rel.shape[0]} rows for an "
                             f"attention batch of {hs.shape[0]}")
        seen: List[Tensor] = []

        def keep(mod, inp, out):
            # the output the attention's own code goes on with is a fresh alias of in_proj's output
            # (held last among its forward hooks): its gradient is that code's alone, the biases'
            # per-token gradient, even where the output is also used elsewhere (a user's hook, an
            # auxiliary loss), which in_proj's own rule still sees through its output
            if not isinstance(out, Tensor) or not out.is_floating_point():
                return None
            if torch.is_grad_enabled() and not out.requires_grad:
                # make its gradient reachable (nothing upstream is trained): out − 0 through a scalar leaf
                alias = torch.sub(out, torch.zeros((), dtype=out.dtype, device=out.device, requires_grad=True))
            else:
                alias = out.view_as(out)
            seen.append(alias)
            return alias

        hook = module._modules["in_proj"].register_forward_hook(keep)
        if per_example:
            module.__dict__["pos_dropout"] = _SharedDropout(module._modules["pos_dropout"])
            module.__dict__["disentangled_att_bias"] = functools.partial(_bias_per_example, module)
        try:
            output = original(module, *args, **kwargs)
        finally:
            hook.remove()
            module.__dict__.pop("pos_dropout", None)
            module.__dict__.pop("disentangled_att_bias", None)
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


def _bias_per_example(self: nn.Module, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
    """transformers' ``DisentangledSelfAttention.disentangled_att_bias`` (DeBERTa v1) with the position
    table per example (B, 2k, d): each example's copy is sliced and projected, (B, H, 2span, dh),
    where the model slices and projects one, (1, H, 2span, dh), and broadcasts it. Every other line is
    the model's."""
    g = type(self).disentangled_att_bias.__globals__  # the model module's own helpers
    build_relative_position, compute_attention_span = g["build_relative_position"], g["compute_attention_span"]
    c2p_dynamic_expand, p2c_dynamic_expand = g["c2p_dynamic_expand"], g["p2c_dynamic_expand"]
    scaled_size_sqrt, build_rpos, uneven_size_corrected = (g["scaled_size_sqrt"], g["build_rpos"],
                                                           g["uneven_size_corrected"])
    if relative_pos is None:
        relative_pos = build_relative_position(query_layer, key_layer, query_layer.device)
    if relative_pos.dim() == 2:
        relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos.unsqueeze(1)
    # bxhxqxk
    elif relative_pos.dim() != 4:
        raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")
    if query_layer.size(0) != rel_embeddings.size(0):
        raise ValueError(f"DeBERTa v1 adapter: {query_layer.size(0)} attention rows, not B = {rel_embeddings.size(0)}")

    att_span = compute_attention_span(query_layer, key_layer, self.max_relative_positions)
    relative_pos = relative_pos.long()
    rel_embeddings = torch.Tensor.as_subclass(rel_embeddings, torch.Tensor)[
        :, self.max_relative_positions - att_span : self.max_relative_positions + att_span, :
    ]  # (B, 2span, d)

    score = 0

    # content->position
    if "c2p" in self.pos_att_type:
        pos_key_layer = self.pos_proj(rel_embeddings)  # (B, 2span, H·dh)
        pos_key_layer = self.transpose_for_scores(pos_key_layer)  # (B, H, 2span, dh)
        c2p_att = torch.matmul(query_layer, pos_key_layer.transpose(-1, -2))
        c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
        c2p_att = torch.gather(c2p_att, dim=-1, index=c2p_dynamic_expand(c2p_pos, query_layer, relative_pos))
        score += c2p_att

    # position->content
    if "p2c" in self.pos_att_type:
        pos_query_layer = self.pos_q_proj(rel_embeddings)  # (B, 2span, H·dh)
        pos_query_layer = self.transpose_for_scores(pos_query_layer)  # (B, H, 2span, dh)
        pos_query_layer /= scaled_size_sqrt(pos_query_layer, scale_factor)
        r_pos = build_rpos(
            query_layer,
            key_layer,
            relative_pos,
        )
        p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
        p2c_att = torch.matmul(key_layer, pos_query_layer.transpose(-1, -2).to(dtype=key_layer.dtype))
        p2c_att = torch.gather(
            p2c_att, dim=-1, index=p2c_dynamic_expand(p2c_pos, query_layer, key_layer)
        ).transpose(-1, -2)

        p2c_att = uneven_size_corrected(p2c_att, query_layer, key_layer, relative_pos)
        score += p2c_att

    return score
