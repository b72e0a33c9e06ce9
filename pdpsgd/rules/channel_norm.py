"""Per-channel affine norms over (B, C, *) input: nn.GroupNorm, nn.InstanceNorm1d/2d/3d (affine),
and nn.BatchNorm1d/2d/3d in eval mode (running statistics): y = x̂ ⊙ w[c] + b[c], where x̂ is
normalised per example (GroupNorm, InstanceNorm) or by fixed running statistics (eval BatchNorm,
InstanceNorm with them): no example's x̂ depends on another's.

BatchNorm in training mode (batch statistics) mixes examples and is refused before any rule runs
(``functional.check_no_batch_mixing``); so is InstanceNorm that updates its running statistics."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Explicit, Rule, Use, first_input


class _ChannelNormRule(Rule):
    """G_w,i[c] = Σ_s g[i, c, s] · x̂[i, c, s] and G_b,i[c] = Σ_s g[i, c, s] (s: the positions),
    both (B, C): explicit, always cheap. x̂ is recomputed from the input in float32 at least."""

    needs_output = False
    eager = True
    base: type = nn.Module

    def supports(self, module: nn.Module) -> Optional[str]:
        if getattr(type(module), "forward", None) is not getattr(self.base, "forward", None):
            return f"{type(module).__name__} has its own forward"
        return None

    def xhat(self, module: nn.Module, x: Tensor) -> Optional[Tensor]:  # pragma: no cover - interface
        raise NotImplementedError

    def uses(self, module, args, kwargs, output, grad_output, batch_size) -> Optional[Dict[str, Use]]:
        x = first_input(args, kwargs)
        C = getattr(module, "num_features", None) or getattr(module, "num_channels", None)
        if x is None or x.dim() < 2 or x.shape[0] != batch_size or x.shape[1] != C \
                or grad_output is None or grad_output.shape != x.shape:
            return None  # (an unbatched (C, *) call, or one whose first dim is not the batch)
        acc = torch.promote_types(x.dtype, torch.float32)
        g = grad_output.to(acc).reshape(batch_size, C, -1)  # (B, C, S)
        out: Dict[str, Use] = {}
        if module.weight is not None:
            xh = self.xhat(module, x.to(acc))
            if xh is None:
                return None
            out["weight"] = Explicit((g * xh.reshape(batch_size, C, -1)).sum(2))  # (B, C)
        if module.bias is not None:
            out["bias"] = Explicit(g.sum(2))  # (B, C)
        return out


class GroupNormRule(_ChannelNormRule):
    name = "groupnorm"
    base = nn.GroupNorm

    def xhat(self, module, x):  # per example, per group of channels
        return F.group_norm(x, module.num_groups, None, None, module.eps)


class InstanceNormRule(_ChannelNormRule):
    name = "instancenorm"
    base = nn.modules.instancenorm._InstanceNorm

    def xhat(self, module, x):
        if x.dim() == module._get_no_batch_dim():
            return None
        if module.training or not module.track_running_stats:  # each example's own statistics
            return F.instance_norm(x, None, None, None, None, True, 0.0, module.eps)
        if module.running_mean is None or module.running_var is None:
            return None
        return F.instance_norm(x, module.running_mean.to(x.dtype), module.running_var.to(x.dtype), None, None, False,
                               0.0, module.eps)


class EvalBatchNormRule(_ChannelNormRule):
    name = "batchnorm_eval"
    base = nn.modules.batchnorm._BatchNorm

    def xhat(self, module, x):
        if module.training or module.running_mean is None or module.running_var is None:
            return None  # batch statistics: mixes examples (refused before the step runs)
        return F.batch_norm(x, module.running_mean.to(x.dtype), module.running_var.to(x.dtype), None, None, False, 0.0,
                            module.eps)


TYPES = {
    GroupNormRule: (nn.GroupNorm,),
    InstanceNormRule: (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d),
    EvalBatchNormRule: (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
}
