"""The bias of ConvBERT's ``SeparableConv1D``: a raw (C_out, 1) Parameter added in the module's own forward
after its depthwise and pointwise ``nn.Conv1d`` (both bias-free, each on the conv rule):

    x = self.depthwise(hidden_states)   # (B, C_in, T)
    x = self.pointwise(x)               # (B, C_out, T)
    x += self.bias                      # (C_out, 1) broadcast over T

So ∂out/∂bias = 1 at every position, and example i's gradient is G_i = Σ_t g[i, :, t] (g: the module's
output gradient, (B, C_out, T)), explicit (B, C_out, 1). Matched only on the class ``transformers`` defines
(``transformers_own_class``) whose forward is exactly the code above (a syntax-tree fingerprint,
``deberta_relative.matches_known``, of transformers 5.24's): any other version of the code, or a subclass,
takes the exact fallback. The two convolutions are their own layers with their own rule.
"""
from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor, nn

from .base import Explicit, Rule, Use, transformers_own_class
from .deberta_relative import matches_known
from .layernorm import _acc

SEPARABLE_CONV_NAMES = ("SeparableConv1D",)
_KNOWN = {"SeparableConv1D.forward": "b47c70a9204561b781cf2d9867002ebfede0b0482714e6d6967874e5db1e6877"}


def is_separable_conv_bias(module: nn.Module) -> bool:
    """transformers' own ``SeparableConv1D`` (the known forward), owning only a (C_out, 1) ``bias``, its
    depthwise and pointwise ``nn.Conv1d`` bias-free, the pointwise one C_out wide."""
    cls = type(module)
    if cls.__name__ not in SEPARABLE_CONV_NAMES or not transformers_own_class(cls) \
            or not matches_known(_KNOWN, cls, "forward") or set(module._parameters) != {"bias"}:
        return False
    dw, pw, b = module._modules.get("depthwise"), module._modules.get("pointwise"), module._parameters["bias"]
    return (set(module._modules) == {"depthwise", "pointwise"} and type(dw) is nn.Conv1d and type(pw) is nn.Conv1d
            and dw.bias is None and pw.bias is None and b is not None and b.dim() == 2 and b.shape[1] == 1
            and b.shape[0] == pw.out_channels)


class SeparableConvBiasRule(Rule):
    """G_bias,i = Σ_t g[i, :, t] -> (B, C_out, 1); the module's convolutions are left to their own rule."""

    name = "separable_conv_bias"
    needs_output = False
    eager = True

    def supports(self, module: nn.Module) -> Optional[str]:
        return None if is_separable_conv_bias(module) else "not the SeparableConv1D code this rule knows"

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        b = module.bias
        if not isinstance(grad_output, Tensor) or grad_output.dim() != 3 or grad_output.shape[0] != batch_size \
                or grad_output.shape[1] != b.shape[0]:
            return None  # (B, C_out, T) only
        g = grad_output.to(_acc(grad_output.dtype))
        return {"bias": Explicit(g.sum(2, keepdim=True))}  # (B, C_out, T) -> (B, C_out, 1)
