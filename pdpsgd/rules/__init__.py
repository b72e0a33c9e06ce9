"""Per-layer book-keeping rules: one small file per layer type, collected in ``registry``."""
from .base import CaptureAdapter, Dense, Explicit, Index, Rule, Use
from .registry import DEFAULT_REGISTRY, RuleRegistry, default_registry

__all__ = ["Rule", "Use", "Dense", "Index", "Explicit", "CaptureAdapter", "RuleRegistry", "default_registry",
           "DEFAULT_REGISTRY"]
