"""Per-example clip factors from per-example gradient norms.

Formal guarantee: with groups G_1..G_K and thresholds C_k = C * sqrt(w_k / Σ_j w_j), every
example's clipped gradient (c_{i,k} g_{i,G_k})_k has norm ≤ sqrt(Σ_k C_k²) = C for the "abadi"
function (c = min(1, C_k/‖g‖)) and < C for "automatic" (c = C_k/(‖g‖ + γ)). So the clipped sum
has L2 sensitivity C under adding or removing one example, whatever the grouping.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = ["ClipGroups", "as_spec", "make_groups", "clip_factor", "make_weights_fn", "sum_sq_norms"]

Clipping = Union[str, Mapping[str, Sequence[str]], Sequence[Sequence[str]]]


class ClipGroups(NamedTuple):
    names: List[List[str]]  # parameter names of each group
    thresholds: List[float]  # C_k per group; sqrt(Σ C_k²) == max_grad_norm


def as_spec(clipping: Clipping) -> Clipping:
    """A clipping spec read once into plain containers: a string as is, a dict as a dict of name
    lists, any other iterable (a generator included: it is read here, once, not at each step) as a
    list of name lists. A flat list of names is refused: it reads as one group and as one group per
    name (review, round 38: it was taken as per-name groups, i.e. per-layer clipping)."""
    if isinstance(clipping, str):
        return clipping
    if isinstance(clipping, Mapping):
        return {k: ([g] if isinstance(g, str) else list(g)) for k, g in clipping.items()}
    try:
        groups = list(clipping)
    except TypeError:
        raise TypeError(f"clipping must be 'flat', 'per_layer', a dict group -> parameter names or a list of name "
                        f"lists, got {type(clipping).__name__}") from None
    if len(groups) > 1 and all(isinstance(g, str) for g in groups):
        raise ValueError(
            f"clipping={groups[:3]}{'...' if len(groups) > 3 else ''} is a flat list of parameter names: give a list "
            "of groups (wrap it in a list, [names], for one group; clipping='flat' for all parameters), or "
            "clipping='per_layer' for one group per tensor")
    return [[g] if isinstance(g, str) else list(g) for g in groups]


def make_groups(
    param_names: Sequence[str],
    clipping: Clipping,
    max_grad_norm: float,
    *,
    budget: Optional[Sequence[float]] = None,
    complete: bool = True,
) -> ClipGroups:
    """Split ``param_names`` into clipping groups and share the budget C between them.

    ``clipping``: ``"flat"`` (one group), ``"per_layer"`` (one group per parameter tensor, as in
    Opacus), or user groups: a dict group -> names or a list of name lists (every trainable
    parameter in exactly one group). ``budget``: relative weights w_k (default equal); group k
    gets C_k = C * sqrt(w_k / Σ w), so Σ_k C_k² = C² and the step's sensitivity stays C.
    ``complete=False`` skips the check that every name of ``param_names`` is in a group (a spec
    checked against all of a model's parameters before the step's are known).
    """
    names = list(param_names)
    if isinstance(clipping, str):
        if clipping == "flat":
            groups = [names]
        elif clipping == "per_layer":
            groups = [[n] for n in names]
        else:
            raise ValueError(
                f"clipping={clipping!r} is unknown: use 'flat', 'per_layer', or a dict of parameter groups"
            )
    else:
        spec = as_spec(clipping)
        groups = list(spec.values()) if isinstance(spec, Mapping) else spec
        if not groups:  # (review, round 39: "min() arg is an empty sequence")
            raise ValueError("the clipping spec names no group: give one or more groups of parameter names, or "
                             "clipping='flat' / 'per_layer'")
        known = set(names)
        seen: Dict[str, int] = {}
        for k, g in enumerate(groups):
            if not g:
                raise ValueError(f"clipping group {k} is empty")
            for n in g:
                if n not in known:
                    raise ValueError(f"clipping group {k} names {n!r}, which is not a trained parameter")
                if n in seen:
                    raise ValueError(f"parameter {n!r} is named twice in clipping group {k}; name it once" if seen[n] == k
                                     else f"parameter {n!r} is in clipping groups {seen[n]} and {k}; put it in one")
                seen[n] = k
        missing = [n for n in names if n not in seen]
        if missing and complete:
            raise ValueError(
                f"trained parameters {missing[:5]} are in no clipping group; every trained parameter "
                "must be clipped (add them to a group or freeze them)"
            )
    if budget is None:
        w = [1.0] * len(groups)
    else:
        try:
            if isinstance(budget, (str, bytes, Mapping)):
                raise TypeError
            w = [float(x) for x in budget]
        except (TypeError, ValueError):
            raise ValueError(f"clip_budget must be a sequence of {len(groups)} positive numbers, one per clipping "
                             f"group in their order, got {budget!r}") from None
        if len(w) != len(groups) or any(not (math.isfinite(x) and x > 0) for x in w):
            raise ValueError(f"budget needs {len(groups)} positive finite weights, one per clipping group; got "
                             f"{budget}")
        top = max(w)
        w = [x / top for x in w]  # (relative weights: their sum cannot overflow; review, round 34)
    total = sum(w)
    thresholds = [max_grad_norm * math.sqrt(x / total) for x in w]
    if min(thresholds) < MIN_THRESHOLD:
        raise ValueError(
            f"clipping threshold {min(thresholds):.3g} (max_grad_norm={max_grad_norm:g}"
            f"{', split over the clipping groups' if len(w) > 1 else ''}) is below {MIN_THRESHOLD:g}: "
            "per-example squared norms are sums of squares in float32, which underflow near there, so "
            "an example's norm could be under-stated and escape its clip. Scale the loss up (and C with "
            "it) instead, or use fewer clipping groups / a more even budget.")
    return ClipGroups(groups, thresholds)


#: Smallest clipping threshold (per group) and automatic-clipping γ accepted. A float32 squared norm
#: loses to underflow at most ~(entries)·2^-126; below ~1e-10 that can reach C itself (review, round
#: 32: C = 1e-30 with gradient entries of 1e-25 gave norm 0 and a contribution of 1e5·C).
MIN_THRESHOLD = 1e-10


def clip_factor(norm: Tensor, threshold: float, fn: str = "abadi", gamma: float = 0.01) -> Tensor:
    """c(‖g‖): "abadi" min(1, C/‖g‖); "automatic" C/(‖g‖+γ) (Bu et al. 2022). Non-finite → 0."""
    if fn == "abadi":
        c = torch.clamp(threshold / norm.clamp_min(1e-30), max=1.0)
        if math.isinf(threshold):
            c = torch.ones_like(norm)
    elif fn == "automatic":
        c = threshold / (norm + gamma)
    else:
        raise ValueError(f"clip_fn={fn!r} is unknown: use 'abadi' or 'automatic'")
    return torch.where(torch.isfinite(norm), c, torch.zeros_like(c))


def sum_sq_norms(sq_norms: Mapping[str, Tensor], names: Optional[Sequence[str]] = None) -> Tensor:
    """Σ_n sq_norms[n] over ``names`` (default: all), (b,), in the widest dtype among them: two
    launches (stack, sum) instead of one add per parameter (148 adds for GPT-2 small, each a
    kernel launch on a GPU)."""
    vals = list(sq_norms.values()) if names is None else [sq_norms[n] for n in names]
    if len(vals) == 1:
        return vals[0]
    dts = {v.dtype for v in vals}
    if len(dts) > 1:
        dt = max(dts, key=lambda d: torch.finfo(d).bits)  # float dtypes: the widest holds the others
        vals = [v.to(dt) for v in vals]
    return torch.stack(vals).sum(0)  # (n, b) -> (b,)


def make_weights_fn(groups: ClipGroups, *, clip_fn: str = "abadi", gamma: float = 0.01):
    """Return ``weights_fn(sq_norms, losses, mask) -> name -> Tensor[b]`` (see ``_types.WeightsFn``).

    Weight of example i for a parameter in group k: c(‖g_{i,G_k}‖) if the example is real
    (mask True) and its loss and whole gradient are finite; exactly 0 otherwise.
    """
    if clip_fn not in ("abadi", "automatic"):
        raise ValueError(f"clip_fn={clip_fn!r} is unknown: use 'abadi' or 'automatic'")
    if clip_fn == "automatic" and isinstance(gamma, torch.Tensor) and gamma.numel() == 1 and not gamma.is_complex():
        gamma = float(gamma)  # (a one-element tensor, as make_dp_step takes it)
    if clip_fn == "automatic" and not (isinstance(gamma, numbers.Real) and not isinstance(gamma, bool)
                                       and gamma >= MIN_THRESHOLD and math.isfinite(gamma)):
        raise ValueError(f"gamma must be finite and ≥ {MIN_THRESHOLD:g} for automatic clipping (smaller ones let an "
                         f"under-stated, underflowed norm exceed C), got {gamma!r}")

    single = len(groups.names) == 1  # flat clipping: the group's norm is the total

    def weights_fn(sq_norms: Mapping[str, Tensor], losses: Tensor, mask: Tensor) -> Dict[str, Tensor]:
        total = sum_sq_norms(sq_norms)  # (b,)
        # (the loss as returned, as the step's count reads it; review, round 37: cast to float32 first, a
        # float64 loss beyond float32's range was dropped here and counted as kept there)
        keep = mask & torch.isfinite(total) & torch.isfinite(losses)
        out: Dict[str, Tensor] = {}
        for names, threshold in zip(groups.names, groups.thresholds):
            whole = single and len(names) == len(sq_norms) and all(n in sq_norms for n in names)
            sq = total if whole else sum_sq_norms(sq_norms, names)
            c = clip_factor(sq.sqrt(), threshold, clip_fn, gamma)
            c = torch.where(keep, c, torch.zeros_like(c))
            for n in names:
                out[n] = c
        return out

    # (a description of the function, read by the book-keeping engine: a parameter's clip factor is
    # set by its group's norm; see bookkeeping._settle_pending)
    weights_fn.clip_groups = tuple(tuple(ns) for ns in groups.names)  # type: ignore[attr-defined]
    return weights_fn
