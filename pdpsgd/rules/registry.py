"""The rule registry: layer type -> Rule. Passed in to the engine, never global state to mutate.

``default_registry()`` returns a fresh copy of the built-in rules; users add their own with
``reg.register(MyLayer, MyRule())`` and pass ``bk_options={"registry": reg}``. Registering a
type that already has a rule raises unless ``override=True`` (no silent replacement).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Type

from torch import nn

from .base import CaptureAdapter, Rule

__all__ = ["RuleRegistry", "default_registry", "DEFAULT_REGISTRY"]


class RuleRegistry:
    """Layer type -> rule, plus named predicate rules (e.g. custom RMSNorm by class name).

    Lookup: the exact type first; then a registered base class, but only if the subclass does not
    override ``forward`` (a subclass with its own forward computes something else); then the
    predicates in registration order.
    """

    def __init__(self) -> None:
        self._by_type: Dict[type, Rule] = {}
        self._predicates: List[Tuple[str, Callable[[nn.Module], bool], Rule]] = []
        self._adapters: List[Tuple[str, Callable[[nn.Module], bool], CaptureAdapter]] = []

    def register(self, module_type: Type[nn.Module], rule: Rule, *, override: bool = False) -> None:
        if not isinstance(module_type, type):
            raise TypeError(f"module_type must be a class, got {module_type!r}")
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must be a pdpsgd.rules.Rule, got {type(rule).__name__}")
        if module_type in self._by_type and not override:
            raise ValueError(
                f"{module_type.__name__} already has a rule ({self._by_type[module_type].name}); pass "
                "override=True to replace it"
            )
        self._by_type[module_type] = rule

    def register_predicate(self, name: str, predicate: Callable[[nn.Module], bool], rule: Rule,
                           *, override: bool = False) -> None:
        _put_named(self._predicates, (name, predicate, rule), "a predicate rule", override)

    def register_adapter(self, name: str, predicate: Callable[[nn.Module], bool], adapter: CaptureAdapter,
                         *, override: bool = False) -> None:
        """A ``CaptureAdapter`` for the modules ``predicate`` accepts (see ``rules.base``)."""
        if not isinstance(adapter, CaptureAdapter):
            raise TypeError(f"adapter must be a pdpsgd.rules.CaptureAdapter, got {type(adapter).__name__}")
        if not adapter.method:
            raise ValueError(f"adapter {name!r} names no method to replace (CaptureAdapter.method)")
        _put_named(self._adapters, (name, predicate, adapter), "an adapter", override)

    def has_adapters(self) -> bool:
        return bool(self._adapters)

    def adapter_for(self, module: nn.Module) -> Optional[CaptureAdapter]:
        """The first registered adapter whose predicate accepts ``module``, or None."""
        for _, pred, a in self._adapters:
            if pred(module):
                return a
        return None

    def lookup(self, module: nn.Module) -> Optional[Rule]:
        t = type(module)
        rule = self._by_type.get(t)
        if rule is not None:
            return rule
        for base in t.__mro__[1:]:
            if base in self._by_type and getattr(t, "forward", None) is getattr(base, "forward", None):
                return self._by_type[base]
        for _, pred, r in self._predicates:
            if pred(module):
                return r
        return None

    def copy(self) -> "RuleRegistry":
        new = RuleRegistry()
        new._by_type = dict(self._by_type)
        new._predicates = list(self._predicates)
        new._adapters = list(self._adapters)
        return new

    def __contains__(self, module_type: type) -> bool:
        return module_type in self._by_type


def _put_named(entries: List[Tuple[str, Any, Any]], entry: Tuple[str, Any, Any], what: str, override: bool) -> None:
    """Append ``entry`` (name first) to ``entries``, or replace the one of that name if ``override``."""
    for i, (n, _, _) in enumerate(entries):
        if n == entry[0]:
            if not override:
                raise ValueError(f"{what} named {entry[0]!r} exists; pass override=True to replace it")
            entries[i] = entry
            return
    entries.append(entry)


def _build() -> RuleRegistry:
    from . import (channel_norm, conv, custom_layernorm, deberta_relative, deberta_v1, embedding, hf_conv1d,
                   layernorm, linear, matmul_linear, mpnet_relative_bias, multihead_attention, positional_embedding,
                   rmsnorm, rnn, scaled_embedding, separable_conv_bias, t5_relative_bias)

    reg = RuleRegistry()
    for t in linear.TYPES:
        reg.register(t, linear.LinearRule())
    for t in embedding.TYPES:
        reg.register(t, embedding.EmbeddingRule())
    for t in layernorm.TYPES:
        reg.register(t, layernorm.LayerNormRule())
    for t in rmsnorm.TYPES:
        reg.register(t, rmsnorm.TorchRMSNormRule())
    reg.register_predicate("hf_conv1d", hf_conv1d.is_hf_conv1d, hf_conv1d.HFConv1DRule())
    reg.register_predicate("custom_rmsnorm", rmsnorm.is_custom_rmsnorm, rmsnorm.CustomRMSNormRule())
    reg.register_predicate("scaled_embedding", scaled_embedding.is_scaled_embedding,
                           scaled_embedding.ScaledEmbeddingRule())
    reg.register_predicate("positional_embedding", positional_embedding.is_positional_embedding,
                           positional_embedding.PositionalEmbeddingRule())
    reg.register_predicate("matmul_linear", matmul_linear.is_matmul_linear, matmul_linear.MatmulLinearRule())
    reg.register_predicate("cohere_layernorm", custom_layernorm.is_cohere_layernorm,
                           custom_layernorm.CohereLayerNormRule())
    reg.register_predicate("layernorm_1p", custom_layernorm.is_layernorm_1p, custom_layernorm.LayerNorm1PRule())
    reg.register_predicate("nonorm", custom_layernorm.is_nonorm, custom_layernorm.NoNormRule())
    reg.register_predicate("channel_first_layernorm", custom_layernorm.is_channel_first_layernorm,
                           custom_layernorm.ChannelFirstLayerNormRule())
    reg.register_predicate("separable_conv_bias", separable_conv_bias.is_separable_conv_bias,
                           separable_conv_bias.SeparableConvBiasRule())
    reg.register_predicate("deberta_layernorm", deberta_v1.is_deberta_layernorm, deberta_v1.DebertaLayerNormRule())
    reg.register_predicate("deberta_v1_attention_bias", deberta_v1.is_deberta_v1_attention,
                           deberta_v1.DebertaV1AttentionBiasRule())
    for t in conv.TYPES:
        reg.register(t, conv.ConvRule())
    for rule_cls, types in channel_norm.TYPES.items():
        for t in types:
            reg.register(t, rule_cls())
    for t in rnn.TYPES:
        reg.register(t, rnn.RNNRule())
    for t in multihead_attention.TYPES:
        reg.register(t, multihead_attention.MultiheadAttentionRule())
    reg.register_adapter("t5_relative_bias", t5_relative_bias.is_t5_relative_attention,
                         t5_relative_bias.T5RelativeBiasAdapter())
    reg.register_adapter("mpnet_relative_bias", mpnet_relative_bias.is_mpnet_encoder,
                         mpnet_relative_bias.MPNetRelativeBiasAdapter())
    reg.register_adapter("deberta_rel_embeddings", deberta_relative.is_deberta_rel_encoder,
                         deberta_relative.DebertaRelEmbeddingAdapter())
    reg.register_adapter("deberta_disentangled_attention", deberta_relative.is_deberta_attention,
                         deberta_relative.DebertaAttentionAdapter())
    reg.register_adapter("deberta_v1_rel_embeddings", deberta_v1.is_deberta_v1_rel_encoder,
                         deberta_v1.DebertaV1RelEmbeddingAdapter())
    return reg


DEFAULT_REGISTRY = _build()


def default_registry() -> RuleRegistry:
    """A fresh copy of the built-in rules (safe to extend)."""
    return DEFAULT_REGISTRY.copy()
