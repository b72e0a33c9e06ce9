"""Linear layers of Hugging Face models that compute ``x @ W.T (+ b)`` in their own forward
instead of ``F.linear`` (Falcon's ``FalconLinear``).

Matched by class name (``MATMUL_LINEAR_NAMES``) on the class ``transformers`` defines (an
``nn.Linear`` subclass with no parameters but ``weight`` and ``bias``; a user's class of that name
is not taken), and *verified on every call* as it runs (``Rule.verify``): the rule
recomputes ``x @ W.T`` (+ b) as that forward does and requires it to equal the module's output
exactly (Falcon adds the residual into this output in place later, so it is checked at once);
otherwise the engine falls back to exact vmap for that layer. Then the layer is y = x Wᵀ + b and
its per-example gradients are the Linear rule's.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor, nn

from .base import Rule, Use, first_input, transformers_own_class
from .linear import LinearRule

MATMUL_LINEAR_NAMES = ("FalconLinear",)


def is_matmul_linear(module: nn.Module) -> bool:
    """Hugging Face's own class (defined in a ``transformers`` module under a name in
    ``MATMUL_LINEAR_NAMES``, its ``forward`` not overridden by a subclass), an ``nn.Linear`` whose
    own parameters are weight (and bias) and which has no submodules."""
    cls = type(module)
    if not isinstance(module, nn.Linear) or cls.__name__ not in MATMUL_LINEAR_NAMES or not transformers_own_class(cls):
        return False
    return ({n for n, _ in module.named_parameters(recurse=False)} <= {"weight", "bias"}
            and not any(True for _ in module.children()))


class MatmulLinearRule(Rule):
    """G_W,i = Σ_t g[i,t] ⊗ a[i,t]; G_b,i = Σ_t g[i,t] — after checking out == x @ Wᵀ (+ b)."""

    name = "matmul_linear"
    needs_output = False  # checked as the layer ran (``verify``): Falcon edits this output in place later
    rowwise = True
    checks_call = True  # matched by name: a call it declines is not the layer it knows

    def __init__(self) -> None:
        self._linear = LinearRule()

    @staticmethod
    def verify(module: nn.Module, args, kwargs, output) -> bool:
        x = first_input(args, kwargs)
        if x is None or not isinstance(output, Tensor):
            return False
        with torch.no_grad():
            ref = x @ module.weight.T  # as FalconLinear.forward computes it
            if module.bias is not None:
                ref = ref + module.bias
        return ref.shape == output.shape and ref.dtype == output.dtype and bool(torch.equal(ref, output))

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        return self._linear.uses(module, args, kwargs, None, grad_output, batch_size)
