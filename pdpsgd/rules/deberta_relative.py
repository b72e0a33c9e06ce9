"""DeBERTa-v2/v3's relative position embeddings, computed per example while the engine captures.

DeBERTa-v2 (and v3, the same code) keeps one table of relative-position embeddings for the whole
model, ``encoder.rel_embeddings`` (an nn.Embedding of 2k × d, k = position buckets), layer-normed
by ``encoder.LayerNorm`` (``norm_rel_ebd="layer_norm"``). ``get_rel_embedding`` returns it batch-free,
(2k, d), and every layer's attention projects it (``pos_key_proj`` / ``pos_query_proj``, or with
``share_att_key`` the attention's own ``key_proj`` / ``query_proj``) to (1, 2k, H·dh) and ``.repeat``s
that to the batch inside ``disentangled_attention_bias``. The gradients of the table, its layer norm
and the projections from those calls are then summed over the batch before any layer sees them, so
no rule can split them by example (without these adapters: the exact vmap fallback for 19
parameters of a 4-layer model, 2.2× the non-private step on ``deberta-128``).

While the engine captures, two adapters make that prefix per example:

* ``DebertaRelEmbeddingAdapter`` replaces the encoder's ``get_rel_embedding``: the table is looked up
  through the embedding itself on positions 0..2k-1 expanded to (B, 2k) and layer-normed through
  ``encoder.LayerNorm``, so their own rules give each example's use (``Index``, LayerNorm's
  explicit one): (B, 2k, d), the same values as the model's (2k, d), one copy per example.
* ``DebertaAttentionAdapter`` replaces each attention's ``forward``: while it runs, its position
  dropout draws one mask of the batch-free shape (2k, d) and applies it to every example (the
  model's own, shared, mask; the same draws from the generator) and ``disentangled_attention_bias``
  projects each example's copy, (B, 2k, d) -> (B·H, 2k, dh), in place of the (H, 2k, dh) result
  repeated B times: the same values, and the projections' own rule (Linear) now sees a per-example
  call. The rest of ``disentangled_attention_bias`` is the model's, line for line. It takes as
  per-example copies only the tensor the encoder's adapter made in this capture (any other
  ``rel_embeddings``: the model's own code).

Both adapters accept a module only where the model's methods are exactly the code they were written
against (transformers' DeBERTa-v2 ``get_rel_embedding``, ``DisentangledSelfAttention.forward`` and
``.disentangled_attention_bias``, compared as syntax trees: comments, docstrings and layout aside),
and the encoder's only where every attention under it takes the other adapter: anything else and the
model runs as written, its relative-position parameters on the exact fallback, as before. The
projections of the shared embeddings then cost B times theirs in the model (the price of a
per-example gradient of a batch-free input: B·n·d·p per projection and layer), but only on the n rows
of the 2k that the attention's gathers read (round 54: n = 2T − 1 where every relative position of a
length-T batch has its own bucket, e.g. T < 128 with DeBERTa-v3's 256 buckets; the other rows'
gradients are exactly 0). On DeBERTa-v3-shaped models (256 buckets, 4 layers, width 256, B = 8, one
thread) that took a bk step from 1.9-2.0× to 1.2-1.3× the non-private one at T = 64, from 1.4-1.6× to
1.2-1.25× at T = 128 (``benchmarks/README.md``, round 54).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import textwrap
from typing import Callable, Mapping

import torch
from torch import nn

from .base import CaptureAdapter

__all__ = ["DebertaRelEmbeddingAdapter", "DebertaAttentionAdapter", "is_deberta_rel_encoder",
           "is_deberta_attention"]

_MODULE = "transformers.models.deberta_v2.modeling_deberta_v2"

# Syntax-tree fingerprints (``_fingerprint``) of the methods these adapters were written against:
# transformers 5.24's DeBERTa-v2 (the same code since transformers 4.x' ``share_att_key`` rewrite).
_KNOWN = {
    "DebertaV2Encoder.get_rel_embedding": "4ae5f5fe809f6d54ac3a171a5d578a166628622e7093486f82f2cf9c9f5bd531",
    "DisentangledSelfAttention.forward": "f193a4397e78bdeca34868fa670814547d64751bdd486b0c789ff759ba6088ed",
    "DisentangledSelfAttention.disentangled_attention_bias":
        "3c96b20d9c1d349eeae914408922e91f58ec3563fb3fc028a8c68648e32e43ec",
}


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _canon(node) -> str:
    """A syntax tree as text, the same on every Python this runs on: fields that are empty or None,
    and those newer Pythons added (``type_params``) or that carry no code (``type_comment``, ``kind``),
    are left out."""
    if isinstance(node, ast.AST):
        parts = [type(node).__name__]
        for f in node._fields:
            v = getattr(node, f, None)
            if f in ("type_params", "type_comment", "kind") or v is None or (isinstance(v, list) and not v):
                continue
            parts.append(f"{f}={_canon(v)}")
        return "(" + " ".join(parts) + ")"
    if isinstance(node, list):
        return "[" + " ".join(_canon(v) for v in node) + "]"
    return repr(node)


@functools.lru_cache(maxsize=None)
def _fingerprint(fn: Callable) -> str:
    """sha256 of the function's syntax tree without docstrings (comments and layout do not count);
    '' when its source cannot be read."""
    try:
        tree = _strip_docstrings(ast.parse(textwrap.dedent(inspect.getsource(fn))))
    except (OSError, TypeError, SyntaxError):
        return ""
    return hashlib.sha256(_canon(tree).encode()).hexdigest()


def matches_known(known: Mapping[str, str], cls: type, method: str) -> bool:
    """Whether ``cls`` defines ``method`` itself with the fingerprint ``known`` records for
    "Class.method" (also used by ``rules/deberta_v1.py``)."""
    want = known.get(f"{cls.__name__}.{method}")
    fn = cls.__dict__.get(method)
    return bool(want) and fn is not None and _fingerprint(fn) == want


def _known(cls: type, method: str) -> bool:
    return matches_known(_KNOWN, cls, method)


def _is_v2(module: nn.Module, name: str) -> bool:
    kind = type(module)  # (by name: no import of transformers on this per-call path)
    return kind.__module__ == _MODULE and kind.__name__ == name


def is_deberta_attention(module: nn.Module) -> bool:
    """DeBERTa-v2's ``DisentangledSelfAttention`` with relative attention, exactly the known code."""
    if not _is_v2(module, "DisentangledSelfAttention") or module.__dict__.get("relative_attention") is not True:
        return False
    cls = type(module)
    return _known(cls, "forward") and _known(cls, "disentangled_attention_bias")


def is_deberta_rel_encoder(module: nn.Module) -> bool:
    """DeBERTa-v2's encoder with relative attention (an nn.Embedding table), exactly the known code."""
    return (_is_v2(module, "DebertaV2Encoder") and module.__dict__.get("relative_attention") is True
            and isinstance(module._modules.get("rel_embeddings"), nn.Embedding)
            and _known(type(module), "get_rel_embedding"))


class DebertaRelEmbeddingAdapter(CaptureAdapter):
    """The encoder's ``get_rel_embedding`` per example: (2k, d) -> the same values as (B, 2k, d)."""

    name = "deberta_rel_embeddings"
    method = "get_rel_embedding"

    def wrap(self, module: nn.Module, batch_size: int):
        original = type(module).get_rel_embedding
        attentions = [m for m in module.modules() if _is_v2(m, "DisentangledSelfAttention")]

        def get_rel_embedding(*args, **kwargs):
            # every attention that could receive the result must take the per-example copy
            forwards = [m.__dict__.get("forward") for m in attentions]
            if args or kwargs or not all(isinstance(f, _AttentionForward) and f.batch_size == batch_size
                                         for f in forwards):
                return original(module, *args, **kwargs)
            rel = table_per_example(module._modules["rel_embeddings"], batch_size)  # (B, 2k, d)
            if "layer_norm" in module.norm_rel_ebd:
                rel = module.LayerNorm(rel)  # (B, 2k, d), row by row: LayerNorm's rule
            for f in forwards:  # the attentions take this tensor, and no other, as per-example copies
                f.made.append(rel)
            return rel

        return get_rel_embedding


def table_per_example(emb: nn.Embedding, batch_size: int) -> torch.Tensor:
    """The whole table looked up through the embedding itself on positions 0..n-1 expanded to
    (B, n): (B, n, d), the table's values once per example, and the embedding's rule gives each
    example's use (also used by ``rules/deberta_v1.py``)."""
    n = emb.num_embeddings
    return emb(torch.arange(n, device=emb.weight.device).expand(batch_size, n))  # (B, n) -> (B, n, d)


class _SharedDropout:
    """The model's position dropout with one mask of the batch-free shape for every example: the
    mask the module draws on (2k, d) (the same draws from the generator as the model's own call)."""

    def __init__(self, dropout: nn.Module):
        self.dropout = dropout

    def __call__(self, x):  # (B, 2k, d)
        if not self.dropout.training or not getattr(self.dropout, "p", 0.0):
            return self.dropout(x)  # identity
        mask = self.dropout(torch.ones(x.shape[1:], dtype=x.dtype, device=x.device))  # (2k, d): 0 or 1/(1-p)
        return x * mask


class _AttentionForward:
    """The attention's ``forward`` with the per-example relative embeddings (see the module docstring)."""

    def __init__(self, module: nn.Module, batch_size: int):
        self.module = module
        self.batch_size = batch_size
        self.original = type(module).forward
        self.signature = inspect.signature(self.original)
        # the per-example embeddings the encoder's adapter made in this capture (only these are taken
        # per example: any other 3-D ``rel_embeddings`` goes to the model's own code)
        self.made: list = []

    def __call__(self, *args, **kwargs):
        m = self.module
        bound = self.signature.bind(m, *args, **kwargs)
        rel = bound.arguments.get("rel_embeddings")
        if not (isinstance(rel, torch.Tensor) and rel.dim() == 3 and rel.shape[0] == self.batch_size
                and any(rel is r for r in self.made)):
            return self.original(m, *args, **kwargs)
        m.__dict__["pos_dropout"] = _SharedDropout(m._modules["pos_dropout"])
        m.__dict__["disentangled_attention_bias"] = functools.partial(_bias_per_example, m, self.batch_size)
        try:
            return self.original(m, *args, **kwargs)
        finally:
            m.__dict__.pop("pos_dropout", None)
            m.__dict__.pop("disentangled_attention_bias", None)


class DebertaAttentionAdapter(CaptureAdapter):
    """Each attention's ``forward`` with per-example position projections, see the module docstring."""

    name = "deberta_disentangled_attention"
    method = "forward"

    def wrap(self, module: nn.Module, batch_size: int):
        return _AttentionForward(module, batch_size)


def _bias_per_example(self: nn.Module, B: int, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
    """transformers' ``DisentangledSelfAttention.disentangled_attention_bias`` (DeBERTa-v2), with the
    relative embeddings per example (B, 2k, d): each example's copy is projected, (B·H, n, dh), where
    the model projects one and repeats it B times, and only the n rows the gathers read (their indices
    shifted by the first one's). Every other line is the model's."""
    g = type(self).disentangled_attention_bias.__globals__  # the model module's own helpers
    build_relative_position, build_rpos, scaled_size_sqrt = (g["build_relative_position"], g["build_rpos"],
                                                            g["scaled_size_sqrt"])
    if relative_pos is None:
        relative_pos = build_relative_position(
            query_layer,
            key_layer,
            bucket_size=self.position_buckets,
            max_position=self.max_relative_positions,
        )
    if relative_pos.dim() == 2:
        relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
    elif relative_pos.dim() == 3:
        relative_pos = relative_pos.unsqueeze(1)
    # bsz x height x query x key
    elif relative_pos.dim() != 4:
        raise ValueError(f"Relative position ids must be of dim 2 or 3 or 4. {relative_pos.dim()}")

    att_span = self.pos_ebd_size
    relative_pos = relative_pos.to(device=query_layer.device, dtype=torch.long)
    H = self.num_attention_heads
    if query_layer.size(0) != B * H:
        raise ValueError(f"DeBERTa adapter: {query_layer.size(0)} attention rows, not B·H = {B}·{H}")

    # the rows of the table the gathers below read, [lo, hi]: the model projects all 2k rows and gathers these; a
    # row no gather reads has gradient exactly 0, and is not projected here (round 54: B·(hi − lo + 1) rows, not
    # B·2k; 2T − 1 of 2k = 512 at T = 64 with DeBERTa-v3's 256 buckets, where the projections of every row
    # cost about as much as the non-private step)
    c2p_pos = p2c_pos = None
    if "c2p" in self.pos_att_type:
        c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1)
    if "p2c" in self.pos_att_type:
        r_pos = build_rpos(
            query_layer,
            key_layer,
            relative_pos,
            self.max_relative_positions,
            self.position_buckets,
        )
        p2c_pos = torch.clamp(-r_pos + att_span, 0, att_span * 2 - 1)
    used = [p for p in (c2p_pos, p2c_pos) if p is not None and p.numel()]
    lo, hi = 0, att_span * 2 - 1
    if used:  # (one read to the host per call, not one per bound)
        lo, hi = torch.stack([torch.stack([p.min() for p in used]).min(),
                              torch.stack([p.max() for p in used]).max()]).tolist()

    rel_embeddings = rel_embeddings[:, lo: hi + 1, :]  # (B, n, d), n = hi − lo + 1 of the 2k rows
    if self.share_att_key:
        pos_query_layer = self.transpose_for_scores(self.query_proj(rel_embeddings), H)  # (B·H, n, dh)
        pos_key_layer = self.transpose_for_scores(self.key_proj(rel_embeddings), H)
    else:
        if "c2p" in self.pos_att_type:
            pos_key_layer = self.transpose_for_scores(self.pos_key_proj(rel_embeddings), H)
        if "p2c" in self.pos_att_type:
            pos_query_layer = self.transpose_for_scores(self.pos_query_proj(rel_embeddings), H)

    score = 0
    # content->position
    if "c2p" in self.pos_att_type:
        scale = scaled_size_sqrt(pos_key_layer, scale_factor)
        c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2))
        c2p_att = torch.gather(
            c2p_att,
            dim=-1,
            index=(c2p_pos - lo).squeeze(0).expand([query_layer.size(0), query_layer.size(1), relative_pos.size(-1)]),
        )
        score += c2p_att / scale.to(dtype=c2p_att.dtype)

    # position->content
    if "p2c" in self.pos_att_type:
        scale = scaled_size_sqrt(pos_query_layer, scale_factor)
        p2c_att = torch.bmm(key_layer, pos_query_layer.transpose(-1, -2))
        p2c_att = torch.gather(
            p2c_att,
            dim=-1,
            index=(p2c_pos - lo).squeeze(0).expand([query_layer.size(0), key_layer.size(-2), key_layer.size(-2)]),
        ).transpose(-1, -2)
        score += p2c_att / scale.to(dtype=p2c_att.dtype)

    return score
