"""Layer norms that Hugging Face models write out themselves instead of calling ``nn.LayerNorm``.

* Cohere's (``CohereLayerNorm``, ``Cohere2LayerNorm``, ...): no bias, computed in float32,
  out = (w_f32 ⊙ (x_f32 − mean) · rsqrt(var + eps)).to(x.dtype), over the last dim; ``w`` is (d,) or,
  as a per-head query / key norm, (H, d_head) on (..., H, d_head) input.
* Nemotron's ``NemotronLayerNorm1P``: ``F.layer_norm`` with weight w + 1 ("1P": the weight is stored
  as its offset from one).
* MobileBERT's ``NoNorm``: out = x ⊙ w + b (no normalisation at all).
* SqueezeBERT's ``SqueezeBertLayerNorm``: ``nn.LayerNorm`` over dim 1 of channel-first (B, C, T) input (round 54;
  also matched on its forward's syntax-tree fingerprint).

Each is matched only on the class ``transformers`` defines under its name (``transformers_own_class``:
a value check cannot see a forward that stops the gradient somewhere; a user's class of the same
shape takes the exact fallback, or a rule registered for it) and *verified on every call* as it runs
(``Rule.verify``): the rule recomputes the output by the formula it knows, with the same ops in the
same order, and requires it to equal the module's output bit for bit; otherwise that layer takes the
exact vmap fallback. Then ∂out/∂w = x̂ (x for NoNorm) and ∂out/∂b = 1, so per example
G_w,i = Σ_t g ⊙ x̂ and G_b,i = Σ_t g, both explicit ((B, *w.shape): cheap).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Explicit, Rule, Use, first_input, transformers_own_class
from .deberta_relative import matches_known
from .layernorm import LayerNormRule, _acc


def _own(module: nn.Module, names, params) -> bool:
    cls = type(module)
    return (cls.__name__ in names and transformers_own_class(cls)
            and {n for n, _ in module.named_parameters(recurse=False)} == set(params)
            and not any(True for _ in module.children()))


def _same(ref: Tensor, output: Tensor) -> bool:
    """Bit for bit the same values, NaN where both are NaN (a padded row's NaN, e.g. from an attention row
    with every key masked, is that row's either way: its example's gradient is NaN, and the step drops it)."""
    if ref.shape != output.shape or ref.dtype != output.dtype:
        return False
    if torch.equal(ref, output):
        return True
    return bool(((ref == output) | (ref.isnan() & output.isnan())).all())


def _summed(gw: Tensor, k: int) -> Tensor:
    """(B, *, *w) -> (B, *w): the per-example sum over the dims between the batch and the weight's k dims."""
    red = tuple(range(1, gw.dim() - k))
    return gw.sum(red) if red else gw


# ---- Cohere ----------------------------------------------------------------------------------------
COHERE_LAYERNORM_NAMES = ("CohereLayerNorm", "Cohere2LayerNorm", "Cohere2MoeLayerNorm", "CohereCompassLayerNorm")


def is_cohere_layernorm(module: nn.Module) -> bool:
    """transformers' own Cohere layer norm: a ``weight`` Parameter only and a float ``variance_epsilon``."""
    return _own(module, COHERE_LAYERNORM_NAMES, ("weight",)) \
        and isinstance(getattr(module, "variance_epsilon", None), float)


def _cohere_xhat(x: Tensor, eps: float) -> Tensor:
    h = x.to(torch.float32)  # as Cohere's forward: mean, variance and x̂ in float32
    mean = h.mean(-1, keepdim=True)
    variance = (h - mean).pow(2).mean(-1, keepdim=True)
    return (h - mean) * torch.rsqrt(variance + eps)


class CohereLayerNormRule(Rule):
    """G_w,i = Σ_t g ⊙ x̂ (in float32, where the layer's product w_f32 ⊙ x̂ is), after checking the call."""

    name = "cohere_layernorm"
    needs_output = False  # checked as the layer ran (``verify``)
    rowwise = True  # over the last dim only: each row alone
    checks_call = True
    eager = True

    @staticmethod
    def verify(module: nn.Module, args, kwargs, output) -> bool:
        x = first_input(args, kwargs, "hidden_states")
        w = module.weight
        if x is None or not isinstance(output, Tensor) or x.dim() <= w.dim() or tuple(x.shape[-w.dim():]) != tuple(w.shape):
            return False
        with torch.no_grad():
            ref = (w.to(torch.float32) * _cohere_xhat(x, module.variance_epsilon)).to(x.dtype)
        return _same(ref, output)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "hidden_states")
        w = module.weight
        if x is None or x.dim() <= w.dim() or x.shape[0] != batch_size:
            return None
        xhat = _cohere_xhat(x, module.variance_epsilon)  # (B, *, *w) float32
        gw = grad_output.to(torch.float32) * xhat  # autograd's product and sum: float32, then w's dtype
        return {"weight": Explicit(_summed(gw, w.dim()).to(w.dtype).to(_acc(x.dtype)))}


# ---- Nemotron --------------------------------------------------------------------------------------
LAYERNORM_1P_NAMES = ("NemotronLayerNorm1P",)


def is_layernorm_1p(module: nn.Module) -> bool:
    """transformers' own ``NemotronLayerNorm1P`` (an ``nn.LayerNorm`` whose forward adds 1 to the weight)."""
    return isinstance(module, nn.LayerNorm) and module.weight is not None \
        and _own(module, LAYERNORM_1P_NAMES, [n for n in ("weight", "bias") if getattr(module, n) is not None])


class LayerNorm1PRule(LayerNormRule):
    """y = x̂ ⊙ (w + 1) + b: ∂y/∂w = x̂ as for nn.LayerNorm (``LayerNormRule``), after checking the call."""

    name = "layernorm_1p"
    checks_call = True

    @staticmethod
    def verify(module: nn.Module, args, kwargs, output) -> bool:
        x = first_input(args, kwargs)
        if x is None or not isinstance(output, Tensor):
            return False
        with torch.no_grad():  # as NemotronLayerNorm1P.forward computes it (outside autocast)
            ref = F.layer_norm(x, module.normalized_shape, module.weight + 1.0, module.bias, module.eps)
        return _same(ref, output)


# ---- MobileBERT's NoNorm ---------------------------------------------------------------------------
NONORM_NAMES = ("NoNorm",)


def is_nonorm(module: nn.Module) -> bool:
    """transformers' own ``NoNorm`` (MobileBERT): a 1-d ``weight`` and ``bias``, out = x ⊙ w + b."""
    return _own(module, NONORM_NAMES, ("weight", "bias")) and module.weight.dim() == 1 \
        and module.bias.shape == module.weight.shape


class NoNormRule(Rule):
    """G_w,i = Σ_t g ⊙ x, G_b,i = Σ_t g, after checking out == x ⊙ w + b."""

    name = "nonorm"
    needs_output = False
    rowwise = True
    checks_call = True
    eager = True

    @staticmethod
    def verify(module: nn.Module, args, kwargs, output) -> bool:
        x = first_input(args, kwargs, "input_tensor")
        if x is None or not isinstance(output, Tensor) or x.dim() < 2 or x.shape[-1] != module.weight.shape[0]:
            return False
        with torch.no_grad():
            ref = x * module.weight + module.bias
        return _same(ref, output)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "input_tensor")
        if x is None or x.dim() < 2 or x.shape[0] != batch_size:
            return None
        acc = _acc(x.dtype)
        g = grad_output.to(acc)
        return {"weight": Explicit(_summed(g * x.to(acc), 1)), "bias": Explicit(_summed(g, 1))}


# ---- SqueezeBERT's channel-first layer norm --------------------------------------------------------
CHANNEL_FIRST_LAYERNORM_NAMES = ("SqueezeBertLayerNorm",)
# its forward as transformers 5.24 writes it (a syntax-tree fingerprint, ``deberta_relative.matches_known``): a class
# patched with a forward of the same values but another gradient (review, round 54: ``y.detach() + (y - y.detach()) * 2``)
# is not taken on the value check alone
_KNOWN = {"SqueezeBertLayerNorm.forward": "8cac054ce27d8b450f3a806fd0429be21bd24dcc2bc80377c6936174f46859a4"}


def is_channel_first_layernorm(module: nn.Module) -> bool:
    """transformers' own ``SqueezeBertLayerNorm`` with the known forward: an ``nn.LayerNorm`` over dim 1 of (B, C, T)
    input (the forward permutes to (B, T, C), runs ``nn.LayerNorm.forward`` and permutes back)."""
    return isinstance(module, nn.LayerNorm) and module.weight is not None and len(module.normalized_shape) == 1 \
        and _own(module, CHANNEL_FIRST_LAYERNORM_NAMES, [n for n in ("weight", "bias") if getattr(module, n) is not None]) \
        and matches_known(_KNOWN, type(module), "forward")


class ChannelFirstLayerNormRule(LayerNormRule):
    """y = permute(layer_norm(permute(x))) on (B, C, T): ``LayerNormRule`` on the permuted input and output
    gradient, (B, T, C), after checking the call."""

    name = "channel_first_layernorm"
    rowwise = False  # normalised over dim 1, not the last dim
    checks_call = True

    @staticmethod
    def verify(module: nn.Module, args, kwargs, output) -> bool:
        x = first_input(args, kwargs, "x")
        if x is None or not isinstance(output, Tensor) or x.dim() != 3:
            return False
        with torch.no_grad():  # as SqueezeBertLayerNorm.forward computes it
            ref = F.layer_norm(x.permute(0, 2, 1), module.normalized_shape, module.weight, module.bias,
                               module.eps).permute(0, 2, 1)
        return _same(ref, output)

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs, "x")
        if x is None or x.dim() != 3 or grad_output is None or grad_output.shape != x.shape:
            return None
        return super().uses(module, (x.permute(0, 2, 1),), {}, None, grad_output.permute(0, 2, 1), batch_size)
