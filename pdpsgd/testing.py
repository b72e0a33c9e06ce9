"""The naive per-example oracle and helpers for property-testing a model (yours or ours).

The oracle shares no code with the fast paths: it deep-copies the model, loads the given
parameter values into it, and loops over examples one at a time with ``torch.autograd.grad``.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "naive_per_sample_grads",
    "naive_clipped_sum",
    "assert_exact",
    "ExactnessReport",
    "to_float64",
    "token_batches",
    "check_sensitivity",
    "SensitivityReport",
]


def _example(batch: Any, i: int) -> Any:
    return tree_map(lambda x: x[i : i + 1] if isinstance(x, Tensor) else x, batch)


def _batch_len(batch: Any) -> int:
    leaves, _ = tree_flatten(batch)
    return next(int(x.shape[0]) for x in leaves if isinstance(x, Tensor))


def naive_per_sample_grads(
    model: nn.Module,
    loss_fn,
    batch: Any,
    params: Optional[Mapping[str, Tensor]] = None,
) -> tuple[Tensor, Dict[str, Tensor]]:
    """Losses (B,) and per-example gradients name -> (B, *shape), one example at a time.

    ``params``: names (of ``model.named_parameters()``, tied aliases allowed) -> values to
    evaluate at and differentiate; default: every trainable parameter at its current value.
    A tied parameter's gradient is the sum over all its uses (autograd does this).
    """
    m = copy.deepcopy(model)
    named = dict(m.named_parameters(remove_duplicate=False))
    if params is None:
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in m.parameters():
        p.requires_grad_(False)
    targets: Dict[str, nn.Parameter] = {}
    seen: Dict[int, str] = {}
    for n in params:
        if n not in named:
            raise KeyError(f"{n!r} is not a parameter of the model")
        if id(named[n]) in seen:  # (review of round 40: each alias got the whole gradient, counted twice)
            raise ValueError(f"{seen[id(named[n])]!r} and {n!r} are the same tied tensor: pass it once (its "
                             "gradient is the sum over all its uses, under either name)")
        seen[id(named[n])] = n
    with torch.no_grad():
        for n, v in params.items():
            p = named[n]
            p.copy_(v)
            p.requires_grad_(True)
            targets[n] = p
    losses, grads = [], {n: [] for n in targets}
    for i in range(_batch_len(batch)):
        loss = loss_fn(m, _example(batch, i))
        if loss.dim() != 1 or loss.shape[0] != 1:
            raise ValueError(f"loss_fn must return shape [B]; got {tuple(loss.shape)} for a batch of 1")
        gs = torch.autograd.grad(loss.sum(), list(targets.values()), allow_unused=True)
        losses.append(loss.detach()[0])
        for n, g in zip(targets, gs):
            grads[n].append(torch.zeros_like(targets[n]) if g is None else g)
    if not losses:  # (an empty batch: no example, no gradient; review of round 40: torch.stack([]) raised)
        return (torch.zeros(0, dtype=torch.float64),
                {n: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for n, p in targets.items()})
    return torch.stack(losses), {n: torch.stack(v) for n, v in grads.items()}


def naive_clipped_sum(
    model: nn.Module,
    loss_fn,
    batch: Any,
    *,
    max_grad_norm: float,
    params: Optional[Mapping[str, Tensor]] = None,
    groups: Optional[Sequence[Sequence[str]]] = None,
    thresholds: Optional[Sequence[float]] = None,
    clip_fn: str = "abadi",
    gamma: float = 0.01,
    mask: Optional[Tensor] = None,
) -> tuple[Tensor, Dict[str, Tensor]]:
    """Per-example unclipped norms (B,) and Σ_i c_i g_i (no noise), by the textbook formulas.

    The sum is accumulated in float64 and returned in the parameter's dtype promoted to float32 at
    least (a bf16 / fp16 model's sums in float32, as the step's; review, round 37: accumulated in the
    parameter's dtype, a bf16 oracle was 0.4 % off its own per-example gradients' sum)."""
    if clip_fn not in ("abadi", "automatic"):  # (review, round 42: anything else read as "automatic")
        raise ValueError(f"clip_fn must be 'abadi' or 'automatic', got {clip_fn!r}")
    if groups is not None and (thresholds is None or len(thresholds) != len(groups)):
        raise ValueError(f"groups needs one threshold each: {len(groups)} group(s), thresholds={thresholds!r}")
    losses, grads = naive_per_sample_grads(model, loss_fn, batch, params)
    names = list(grads)
    if groups is None:
        groups, thresholds = [names], [max_grad_norm]
    B = _batch_len(batch)
    norms = torch.zeros(B, dtype=torch.float64)
    sums = {n: torch.zeros(g.shape[1:], dtype=torch.float64, device=g.device) for n, g in grads.items()}
    for i in range(B):
        norms[i] = math.sqrt(sum(float(grads[n][i].double().pow(2).sum()) for n in names))
        if mask is not None and not bool(mask[i]):
            continue
        if not (math.isfinite(norms[i]) and math.isfinite(float(losses[i]))):
            continue  # (dropped whole, as the step drops it; review, round 37: per group, loss unread)
        for gnames, thr in zip(groups, thresholds):
            gn = math.sqrt(sum(float(grads[n][i].double().pow(2).sum()) for n in gnames))
            c = min(1.0, thr / gn) if clip_fn == "abadi" and gn > 0 else (1.0 if clip_fn == "abadi" else thr / (gn + gamma))
            for n in gnames:
                sums[n] = sums[n] + c * grads[n][i].double()
    return norms, {n: v.to(torch.promote_types(grads[n].dtype, torch.float32)) for n, v in sums.items()}


def to_float64(x: Any) -> Any:
    """A float64 copy of a model (deep copy) or of a batch pytree (floating tensors only)."""
    if isinstance(x, nn.Module):
        return copy.deepcopy(x).double()
    return tree_map(lambda t: t.double() if isinstance(t, Tensor) and t.is_floating_point() else t, x)


class ExactnessReport(NamedTuple):
    max_rel_err_norms: float
    max_rel_err_sum: float
    per_param: Dict[str, float]  # name -> rel. error of its clipped sum
    routes: Dict[str, str]

    def __str__(self) -> str:
        lines = [f"per-example norms: max rel. err {self.max_rel_err_norms:.3g}",
                 f"clipped sum: max rel. err {self.max_rel_err_sum:.3g}"]
        for n, e in sorted(self.per_param.items(), key=lambda kv: -kv[1])[:20]:
            lines.append(f"  {n:60s} {e:.3g}  ({self.routes.get(n, '?')})")
        return "\n".join(lines)


def _rel(a: Tensor, b: Tensor, floor: float = 0.0) -> float:
    """‖a - b‖ / max(‖b‖, floor): relative error; ``floor`` keeps a parameter whose true value is
    rounding noise (e.g. attention q/k with one token, whose gradient is exactly 0 in exact
    arithmetic) from dividing by ~0."""
    a, b = a.double(), b.double()
    den = max(float(b.norm()), floor, 1e-300)
    return float((a - b).norm()) / den


def _canonical_names(model: nn.Module) -> Dict[str, str]:
    """Every parameter name, tied aliases included -> the first name of its tensor in the model."""
    first: Dict[int, str] = {}
    out: Dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(p), n)
    return out


def _oracle_groups(model: nn.Module, params: Mapping[str, Tensor], clipping: Any, C: float,
                   budget: Optional[Sequence[float]]) -> Tuple[List[List[str]], List[float]]:
    """The clipping groups and their bounds, written from the definitions (not the step's code; review
    of round 40: assert_exact used the step's own group builder, so a budget applied to the wrong
    groups passed): "flat", one group; "per_layer", one per trained tensor in the model's parameter
    order; otherwise the groups as given (a dict's values in order). Group k's bound is
    C·√(w_k / Σ w), w the budget's weights (equal by default)."""
    canon = _canonical_names(model)
    order = [n for n in dict.fromkeys(canon.values()) if n in params]
    if isinstance(clipping, str) and clipping == "flat":
        groups = [order]
    elif isinstance(clipping, str) and clipping == "per_layer":
        groups = [[n] for n in order]
    else:
        spec = list(clipping.values()) if isinstance(clipping, Mapping) else list(clipping)
        groups = [list(dict.fromkeys(canon.get(n, n) for n in ([g] if isinstance(g, str) else g))) for g in spec]
    w = [1.0] * len(groups) if budget is None else [float(x) for x in budget]
    total = sum(w)
    return groups, [C * math.sqrt(x / total) for x in w]


def assert_exact(
    model: nn.Module,
    loss_fn,
    batch: Any,
    *,
    method: str = "vmap",
    params: Optional[Mapping[str, Tensor]] = None,
    max_grad_norm: float = 1.0,
    mask: Optional[Tensor] = None,
    rtol: float = 1e-9,
    float64: bool = True,
    allow_empty: bool = False,
    **step_kwargs: Any,
) -> ExactnessReport:
    """Check ``make_dp_step(method=...)`` against the naive loop (σ = 0), in float64 by default.

    Compares per-example norms and the clipped sum; raises ``AssertionError`` with a report of the
    parameters that differ when the relative error exceeds ``rtol``. Returns the report. The model
    is compared in eval mode (on a copy): dropout masks are random, so a train-mode run can only
    be compared with itself. A batch with no real, finite example (all masked out, or NaN / inf
    in the naive loop) is an ``AssertionError``: no norm would be compared; ``allow_empty=True``
    takes it and checks the sums alone (which must then be 0: nothing added, nothing non-finite).
    """
    from .step import make_dp_step

    spec = step_kwargs.get("clipping", "flat")
    if not isinstance(spec, (str, Mapping)):  # (a generator is read once: the step and the oracle read a list)
        step_kwargs["clipping"] = [g if isinstance(g, str) else list(g) for g in spec]
    model = copy.deepcopy(model).eval()
    if float64:
        model = to_float64(model)
        batch = to_float64(batch)
        if params is not None:
            params = {n: v.detach().double() for n, v in params.items()}
    if params is None:
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    step = make_dp_step(model, loss_fn, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
                        expected_batch_size=1.0, method=method, **step_kwargs)
    part = step.clipped_sum(params, batch, mask)
    canon = _canonical_names(model)
    cparams = {canon[n]: v for n, v in params.items()}
    g_names, g_thresholds = _oracle_groups(model, cparams, step_kwargs.get("clipping", "flat"), max_grad_norm,
                                           step_kwargs.get("clip_budget"))
    norms, sums = naive_clipped_sum(model, loss_fn, batch, max_grad_norm=max_grad_norm, params=cparams,
                                    groups=g_names, thresholds=g_thresholds,
                                    clip_fn=step_kwargs.get("clip_fn", "abadi"),
                                    gamma=step_kwargs.get("gamma", 0.01), mask=mask)
    real = mask if mask is not None else torch.ones(norms.shape[0], dtype=torch.bool)
    finite = torch.isfinite(norms)
    sel = real.cpu() & finite
    if not bool(sel.any()) and not allow_empty:
        # (review, round 41: NaNs inside a model's own float64 forward passed with error 0)
        why = "masked out" if not bool(real.any()) else \
            "non-finite (loss or gradient) in the naive loop" if bool(real.all()) else \
            "masked out or non-finite (loss or gradient) in the naive loop"
        raise AssertionError(
            f"nothing to compare: every example of the batch ({norms.shape[0]}) is {why}, so no "
            "per-example norm or clipping was checked. Give a batch with real examples whose loss and "
            "gradient are finite (a model that yields NaN in float64 itself: float64=False), or "
            "allow_empty=True to check only that the sums are 0.")
    e_norm = _rel(part.per_sample_norms.cpu()[sel], norms[sel]) if bool(sel.any()) else 0.0
    scale = math.sqrt(sum(float(v.double().pow(2).sum()) for v in sums.values()))
    per = {n: _rel(part.sums[n].cpu(), sums[n].cpu(), 1e-6 * scale) for n in sums}
    report = ExactnessReport(e_norm, max(per.values()) if per else 0.0, per, part.routes)
    if not (e_norm <= rtol and report.max_rel_err_sum <= rtol):
        raise AssertionError(f"method={method!r} differs from the naive per-example loop (rtol={rtol}):\n{report}")
    return report


class SensitivityReport(NamedTuple):
    """What ``check_sensitivity`` measured on the step's own noise-free clipped sums S(·)."""

    bound: float  # the step's sensitivity C (add/remove one example)
    contributions: Tensor  # (B,) ‖S(example i alone, the others masked out)‖, each ≤ C
    remove_one: Tensor  # (B,) ‖S(batch) − S(batch, example i masked out)‖, each ≤ C
    remove_one_sliced: Optional[Tensor]  # (B,) ‖S(batch) − S(batch without row i)‖ (None: not measured, see sliced_mode)
    replace: Optional[float]  # ‖S(batch) − S(neighbour)‖ (≤ 2C per example that differs), if given
    differing: Tuple[int, ...]  # the examples in which ``neighbour`` differs from ``batch``
    deterministic: bool  # whether S(batch) is the same under two seeds, up to rounding (no dropout or other draws)
    max_ratio: float  # the largest measured distance over its bound (≤ 1 within rounding; nan fails)
    dropped: Tuple[int, ...] = ()  # real examples of ``batch`` the step dropped as non-finite (bounds hold on the rest)
    # how ``remove_one_sliced`` was measured: "as trained" (deterministic), "dropout at rate 0" (the only draws were
    # torch's dropouts, run at rate 0 in the model's own mode), None (not measured: the forward draws otherwise)
    sliced_mode: Optional[str] = None
    # (B,) ‖S(batch) − S(batch with row i replaced by a copy of row i + 1 mod B)‖ on the same random draws, each
    # ≤ 2C; measured where removal is not (sliced_mode None), the step is reproducible on one seed and every such
    # batch draws as many numbers (round 45)
    replace_one_same_draws: Optional[Tensor] = None


def _removed_one(sums, full: Mapping[str, Tensor], batch: Any, B: int) -> Tensor:
    """(B,) ‖S(batch) − S(batch without row i)‖, with ``full`` = S(batch)."""
    out = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        out[i] = _distance(full, sums(_without(batch, i, B)))
    return out


def _copied_over(batch: Any, i: int, B: int) -> Any:
    """The batch with row i replaced by a copy of row (i + 1) mod B in every tensor whose leading dim is B."""
    idx = torch.arange(B)
    idx[i] = (i + 1) % B
    return _per_row(batch, B, lambda x: x.index_select(0, idx.to(x.device)))


def _agree(a: Mapping[str, Tensor], b: Mapping[str, Tensor], tol: float) -> bool:
    """The same sums up to rounding (relative ``tol``): a step that drew nothing that matters."""
    return _distance(a, b) <= tol * max(_distance(a), 1e-30)


def _distance(a: Mapping[str, Tensor], b: Optional[Mapping[str, Tensor]] = None) -> float:
    return math.sqrt(sum(float((a[n].double() - (0 if b is None else b[n].double())).pow(2).sum()) for n in a))


def _without(batch: Any, i: int, B: int) -> Any:
    """The batch with row i removed from every tensor whose leading dim is B."""
    return _per_row(batch, B, lambda x: torch.cat([x[:i], x[i + 1:]]))


def _per_row(batch: Any, B: int, f) -> Any:
    """``f`` applied to every tensor of the batch whose leading dim is B (the others, shared ones, as they are)."""
    return tree_map(lambda x: f(x) if isinstance(x, Tensor) and x.dim() and x.shape[0] == B else x, batch)


def _differing(batch: Any, other: Any, B: int) -> Tuple[int, ...]:
    x, spec = tree_flatten(batch)
    y, spec2 = tree_flatten(other)
    if spec != spec2 or len(x) != len(y):
        raise ValueError("neighbour must have the batch's structure (the same keys and nesting)")
    out = set()
    for u, v in zip(x, y):
        if isinstance(u, Tensor) != isinstance(v, Tensor) or (isinstance(u, Tensor) and u.shape != v.shape):
            raise ValueError("neighbour must have the batch's shapes: replace examples, do not add or drop them "
                             "(add/remove adjacency is what remove_one measures)")
        if isinstance(u, Tensor) and u.dim() and u.shape[0] == B:
            ne = u != v
            if u.is_floating_point() or u.is_complex():  # (NaN in both is no change; review, round 42: a NaN row
                ne = ne & ~(torch.isnan(u) & torch.isnan(v))  # counted as replaced, which loosened the bound by 2C)
            out.update(int(i) for i in torch.nonzero(ne.reshape(B, -1).any(1).cpu()).flatten())
            continue
        same = _same_leaf(u, v)
        if not same:
            raise ValueError("neighbour differs from batch outside its examples (a non-batched entry)")
    return tuple(sorted(out))


def _same_leaf(u: Any, v: Any) -> bool:
    """A non-batched leaf unchanged: tensors equal with NaN in the same places, floats equal or both NaN."""
    if isinstance(u, Tensor):
        return torch.equal(u, v) or (u.is_floating_point() and u.dtype == v.dtype and u.device == v.device
                                     and torch.allclose(u, v, rtol=0, atol=0, equal_nan=True))
    if isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v):
        return True
    return bool(u == v)


@contextlib.contextmanager
def _all_seeded(devices: Sequence[int], seed: int) -> Iterator[None]:
    """torch's (CPU and ``devices``), Python's and numpy's global random states seeded with ``seed``
    inside the block and restored after it."""
    import random

    import numpy as np

    py, npst = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2 ** 32)
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npst)


def check_sensitivity(
    step,
    params: Mapping[str, Tensor],
    batch: Any,
    *,
    neighbour: Any = None,
    mask: Optional[Tensor] = None,
    seed: int = 0,
    rtol: float = 1e-5,
) -> SensitivityReport:
    """Test the privacy guarantee of a DP step on a batch: the sensitivity of its clipped sum.

    Measured on what the step itself adds noise to (``step.clipped_sum``, σ plays no part), with
    C = ``step.sensitivity``:

    * every example's clipped contribution alone (the others masked out) is at most C: tied and
      shared weights included (a norm that misses a cross term shows here);
    * masking any one example out moves the sum by at most C;
    * removing any one example from the batch (its row dropped: a batch of B − 1, so a model that
      mixes examples shows here) moves the sum by at most C: measured when the step is
      deterministic (the same sums under two seeds), as different draws (train-mode dropout) on a
      batch of another shape would move the others' contributions too; where the only draws are
      torch's dropouts, with them at rate 0 in the model's own mode (``sliced_mode`` says which);
      where it is not measured (other draws: a drop path's, LayerDrop's) and the step gives the same sums
      twice on one seed, each example replaced by a copy of the next, on the same draws, moves the sum by
      at most 2C (``replace_one_same_draws``; a batch statistic used in training shows there; not
      measured where the replaced batches draw other numbers: their count follows the data);
    * given ``neighbour`` (the batch with some examples replaced, same shapes), the sum moves by at
      most 2C per replaced example.

    ``mask`` (a physical batch's padding mask, True for real rows): the check runs on the real rows
    alone (a padding row is no example), and the report's example indices count those rows; the
    ``neighbour``, if given, is cut to the same rows.

    Every call runs with the same seed of torch's, Python's ``random`` and numpy's global generators,
    so a train-mode model's dropout masks (and a forward's own draws from them) are the same in each
    (the caller's states are restored afterwards). Raises ``AssertionError``
    naming the example when a bound is exceeded by more than ``rtol`` or a distance is not finite;
    returns the report. Examples the step drops as non-finite are listed in ``dropped``; a batch
    whose every example is dropped fails (its sum is 0: the bounds hold vacuously). Cost: 2·B + 3
    clipped sums, B more when deterministic; otherwise 2 more (the same at rate 0 of torch's dropouts), and B
    more if those agree, else 1 more (the same seed again) and B more if that agrees; 1 more with ``neighbour``.
    """
    if mask is not None:  # (round 43, a user's walkthrough: a padded physical batch needed slicing by hand)
        from .per_sample import select_examples

        B = _batch_len(batch)
        m = torch.as_tensor(mask)
        if m.dtype != torch.bool or m.shape != (B,):
            raise ValueError(f"mask must be a bool tensor of shape ({B},), one entry per row of the batch (True for "
                             f"real rows), got {m.dtype} of shape {tuple(m.shape)}")
        rows = m.nonzero().flatten()
        if rows.numel() == 0:  # (every bound would hold vacuously)
            raise ValueError("mask keeps no row of the batch: there is no example to check")
        batch = select_examples(batch, rows)
        neighbour = None if neighbour is None else select_examples(neighbour, rows)
    B = _batch_len(batch)
    C = float(step.sensitivity)
    dev = next(iter(params.values())).device
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []

    from .per_sample import _rng_state, _same_state

    drawn: List[Any] = []  # the seeded streams as each call left them (``drawn_to``)

    def part(b: Any, mask: Optional[Tensor] = None, s: int = seed, drawn_to: Optional[List[Any]] = None):
        # (the masks here are the check's own: the step's "padding rows" divisor warning is not about the
        # user's batches, and stays armed for them; review, round 37)
        armed = getattr(step, "_padding_warned", None)
        with _all_seeded(devices, s), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="the batch has padding rows")
            out = step.clipped_sum(params, b, mask)
            if drawn_to is not None:
                drawn_to.append(_rng_state(dev))
        if armed is not None:
            step._padding_warned = armed
        return out

    def sums(b: Any, mask: Optional[Tensor] = None, s: int = seed) -> Dict[str, Tensor]:
        return part(b, mask, s).sums

    sums(batch)  # (a step's first call of a batch shape may run probes of its own)
    first = part(batch)
    full = first.sums
    dropped = tuple(int(i) for i in torch.nonzero((first.mask & ~first.kept).cpu()).flatten())
    if B and len(dropped) == int(first.mask.sum()):
        raise AssertionError(
            f"every example of the batch ({len(dropped)}) was dropped as non-finite (a loss or gradient of "
            "nan/inf), so the clipped sum is 0 and every bound holds vacuously: a step on such batches adds "
            "noise alone. Find the non-finite values (e.g. batch statistics of a single example, as vmap "
            "runs them, or a float32 overflow) and check again")
    other = sums(batch, s=seed + 1)
    # (up to rounding: kernels that are not bitwise reproducible, e.g. CUDA's index_add, do not count)
    f64 = all(v.dtype == torch.float64 for v in full.values())
    tol = 1e-12 if f64 else 1e-6
    deterministic = _agree(full, other, tol)
    alone = torch.zeros(B, dtype=torch.float64)
    removed = torch.zeros(B, dtype=torch.float64)
    for i in range(B):
        m = torch.zeros(B, dtype=torch.bool, device=dev)
        m[i] = True
        alone[i] = _distance(sums(batch, m))
        removed[i] = _distance(full, sums(batch, ~m))
    sliced, sliced_mode = None, None
    if deterministic:
        sliced, sliced_mode = _removed_one(sums, full, batch, B), "as trained"
    else:
        # (round 44) the forward's only draws may be torch's dropouts: at rate 0 (``DropoutOff``, as
        # book-keeping's example-order check runs such a model) the step may be deterministic in training
        # mode, and removal from the batch is compared there (a batch statistic used in training shows)
        from .batch_order import DropoutOff

        with DropoutOff():
            base = sums(batch)
            if _agree(base, sums(batch, s=seed + 1), tol):
                sliced, sliced_mode = _removed_one(sums, base, batch, B), "dropout at rate 0"
    swapped = None
    if sliced is None and B > 1 and _agree(full, part(batch, drawn_to=drawn).sums, tol):
        # (round 45) draws other than torch's dropouts (a drop path's, LayerDrop's) differ on a batch of another
        # shape, but a batch of the same shape on the same seed draws the same numbers: each example replaced by a
        # copy of the next moves the sum by ≤ 2C there, which a batch statistic used in training breaks. Not
        # measured where a replaced batch leaves the seeded streams elsewhere (the number of draws follows the
        # data: rejection sampling, a batch trimmed to its longest row; the draws were not lined up; review)
        swapped = torch.zeros(B, dtype=torch.float64)
        for i in range(B):
            swapped[i] = _distance(full, part(_copied_over(batch, i, B), drawn_to=drawn).sums)
        if not all(_same_state(drawn[0], d) for d in drawn[1:]):
            swapped = None
    replace, differing = None, ()
    if neighbour is not None:
        differing = _differing(batch, neighbour, B)
        replace = _distance(full, sums(neighbour))
    lim = C * (1 + rtol)

    def over(x: float, bound: float) -> bool:
        return not (x <= bound)  # (nan: over)

    bad = []
    for label, d in (("'s clipped contribution alone has norm", alone),
                     (" masked out moves the clipped sum by", removed),
                     (" removed from the batch" + (" (torch's dropouts at rate 0)" if sliced_mode == "dropout at rate 0"
                                                   else "") + " moves the clipped sum by", sliced)):
        if d is not None:
            bad += [f"example {i}{label} {float(d[i]):.6g} > C = {C:.6g}" for i in range(B) if over(float(d[i]), lim)]
    if swapped is not None:
        bad += [f"example {i} replaced by a copy of example {(i + 1) % B} (on the same random draws) moves the clipped "
                f"sum by {float(swapped[i]):.6g} > 2C = {2 * C:.6g}" for i in range(B) if over(float(swapped[i]), 2 * lim)]
    ratios = [float(d.max()) / C for d in (alone, removed, sliced) if d is not None and B]
    if swapped is not None:
        ratios.append(float(swapped.max()) / (2 * C))
    if replace is not None:
        k = len(differing)
        ratios.append(replace / (2 * C * k) if k else (0.0 if replace == 0 else math.inf))
        if over(replace, 2 * k * lim):
            bad.append(f"replacing example(s) {list(differing)} moves the clipped sum by {replace:.6g} > "
                       f"2C·{k} = {2 * C * k:.6g}")
    ratio = max(ratios) if ratios else 0.0
    if any(math.isnan(r) for r in ratios):
        ratio = math.nan
    report = SensitivityReport(C, alone, removed, sliced, replace, differing, deterministic, ratio, dropped, sliced_mode,
                               swapped)
    if bad:
        raise AssertionError("the step's clipped sum exceeds its sensitivity bound: " + "; ".join(bad[:5]))
    return report


def token_batches(
    *,
    vocab_size: int,
    max_batch: int = 6,
    max_len: int = 12,
    num_labels: Optional[int] = None,
    padding: bool = True,
):
    """A hypothesis strategy of token batches: dict(input_ids, attention_mask[, labels]).

    Draws B in [1, max_batch], T in [1, max_len], token ids, right-padding lengths (each example
    keeps ≥ 1 real token) and, with ``num_labels``, a class label per example (else labels are the
    ids, for causal LM losses). Needs ``hypothesis`` (a test extra).
    """
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        B = d(st.integers(1, max_batch))
        T = d(st.integers(1, max_len))
        seed = d(st.integers(0, 2**31 - 1))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (B, T), generator=g)
        if padding:
            lengths = torch.randint(1, T + 1, (B,), generator=g)
        else:
            lengths = torch.full((B,), T)
        am = (torch.arange(T)[None, :] < lengths[:, None]).long()
        out = {"input_ids": ids, "attention_mask": am}
        if num_labels is not None:
            out["labels"] = torch.randint(0, num_labels, (B,), generator=g)
        else:
            out["labels"] = ids.masked_fill(am == 0, -100)
        return out

    return draw()
