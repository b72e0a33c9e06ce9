"""``pdpsgd check FILE``: run the naive-oracle exactness check (``pdpsgd.testing.assert_exact``) on
a user's model.

FILE is a Python file defining

* ``model`` (an ``nn.Module``) or ``make_model()`` returning one,
* ``loss_fn(model, batch) -> Tensor[B]`` (per-example losses), and
* ``batch`` or ``make_batch()`` (a pytree of tensors with leading dim B);

optionally ``params`` (name -> tensor; default: the trainable parameters) and ``mask``.
For each requested method the per-example norms and the clipped sum are compared with a loop over
single examples in float64, and then the sensitivity bound is checked on the step's own clipped sums
(each example's contribution alone ≤ C; removing one moves the sum by ≤ C); a readable report is
printed and the exit status is 1 on a mismatch or an exceeded bound.
"""
from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterable, List, Optional, TextIO

__all__ = ["load_user_file", "check_file", "run_check", "CheckResult"]


class CheckResult:
    def __init__(self, method: str, ok: bool, report: Any = None, error: Optional[str] = None):
        self.method, self.ok, self.report, self.error = method, ok, report, error

    def __repr__(self) -> str:
        return f"CheckResult({self.method!r}, ok={self.ok})"


def load_user_file(path: str) -> Dict[str, Any]:
    """Execute FILE as a module and return ``{"model", "loss_fn", "batch", "params", "mask"}``.

    Raises ``UserError`` (from ``pdpsgd.cli``) for a missing file or missing names.
    """
    from .cli import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"file not found: {path}")
    if p.suffix != ".py":
        raise UserError(f"{path}: expected a Python file (.py) defining model, loss_fn and batch")
    spec = importlib.util.spec_from_file_location(f"_pdpsgd_check_{abs(hash(str(p.resolve())))}", str(p))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    folder = str(p.parent.resolve())
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if f.filename == str(p)), str(p))
        raise UserError(f"{where}: running the file failed: {type(e).__name__}: {e}") from None
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return {
        "model": _get(mod, "model", "make_model", path),
        "loss_fn": _need(mod, "loss_fn", path),
        "batch": _get(mod, "batch", "make_batch", path),
        "params": getattr(mod, "params", None),
        "mask": getattr(mod, "mask", None),
    }


def _need(mod: ModuleType, name: str, path: str) -> Any:
    from .cli import UserError

    if not hasattr(mod, name):
        raise UserError(f"{path} does not define {name!r}")
    v = getattr(mod, name)
    if name == "loss_fn" and not callable(v):
        raise UserError(f"{path}: loss_fn must be a function loss_fn(model, batch) -> Tensor[B]")
    return v


def _get(mod: ModuleType, value: str, factory: str, path: str) -> Any:
    from .cli import UserError

    if hasattr(mod, value):
        return getattr(mod, value)
    if hasattr(mod, factory):
        try:
            return getattr(mod, factory)()
        except Exception as e:
            raise UserError(f"{path}: {factory}() failed: {type(e).__name__}: {e}") from None
    raise UserError(f"{path} defines neither {value!r} nor {factory}()")


def check_file(path: str, methods: Iterable[str] = ("vmap", "bk", "auto"), *, rtol: Optional[float] = None,
               max_grad_norm: float = 1.0, float64: bool = True, sensitivity: bool = True,
               out: Optional[TextIO] = None) -> List[CheckResult]:
    """Run ``assert_exact`` on FILE's model for each method, then (``sensitivity``) the privacy bound
    on the step's own clipped sums (``testing.check_sensitivity``: each example alone ≤ C, removing
    one moves the sum by ≤ C, in the model's own mode); print a report per method."""
    import torch
    import torch.nn as nn

    from .cli import UserError
    from .functional import check_no_batch_mixing
    from .testing import assert_exact
    from .train import resolve_method

    out = sys.stdout if out is None else out  # (read at call time: the stream may have been replaced)
    u = load_user_file(path)
    if not isinstance(u["model"], nn.Module):
        raise UserError(f"{path}: model must be a torch.nn.Module, got {type(u['model']).__name__}")
    if rtol is None:  # (review of round 40: --no-float64 kept 1e-9 and failed every float32 model)
        rtol = 1e-9 if float64 else _precision_rtol(u["model"])
    results = []
    compared: List[str] = []
    mixing = _mixing(u, float64, rtol, compared)
    if mixing:
        results.append(CheckResult("model", False, error=mixing))
        print(f"[model] MIXES EXAMPLES\n{_indent(mixing)}", file=out)
    elif compared:  # (a user sees that the check ran; round 43's walkthrough had to build a mixing model to know)
        print(f"[model] each example's loss in the batch equals its loss alone ({' and '.join(compared)})", file=out)
    else:
        print("[model] batch vs alone not compared (one example, random numbers drawn in every mode, or a forward "
              "that cannot run here: the methods below report why)", file=out)
    for m in methods:
        m = m.strip()
        if not m:
            continue
        if m not in ("vmap", "bk", "auto"):
            raise UserError(f"--method {m!r}: use vmap, bk, auto (comma-separated)")
        if resolve_method(m) != m:
            print(f"[{m}] skipped: pdpsgd.bookkeeping is not available", file=out)
            continue
        try:
            # the step's refusals first (assert_exact compares an eval-mode copy: BatchNorm left in training
            # mode passed as exact; review of round 40)
            check_no_batch_mixing(u["model"])
            rep = assert_exact(u["model"], u["loss_fn"], u["batch"], method=m, params=u["params"], mask=u["mask"],
                               max_grad_norm=max_grad_norm, rtol=rtol, float64=float64)
            print(f"[{m}] OK (rtol={rtol:g})\n{_indent(str(rep))}", file=out)
            if sensitivity:
                try:
                    sens = _sensitivity(u, m, max_grad_norm, float64)
                except AssertionError as e:
                    results.append(CheckResult(m, False, error=str(e)))
                    what = "SENSITIVITY EXCEEDED" if "exceeds its sensitivity" in str(e) else "SENSITIVITY NOT SHOWN"
                    print(f"[{m}] {what}\n{_indent(str(e))}", file=out)
                    continue
                how = {"as trained": "masked out and removed from the batch",
                       "dropout at rate 0": "masked out, and removed from the batch with torch's dropouts at rate 0"}.get(
                    sens.sliced_mode, "masked out" + (
                        ", and replaced by a copy of another on the same random draws (against 2C)"
                        if sens.replace_one_same_draws is not None else "")
                    + " (the model draws random numbers other than torch's dropouts: removal from the batch not "
                      "compared)")
                print(f"[{m}] sensitivity OK: each example's clipped contribution alone, and the move of the "
                      f"clipped sum with it {how}, at most {sens.max_ratio:.6g} × its bound", file=out)
                if u["mask"] is not None:
                    print(f"[{m}] (the sensitivity check ran on the {int(u['mask'].sum())} rows the mask keeps)",
                          file=out)
                top = float(sens.contributions.max()) if sens.contributions.numel() else 0.0
                if sens.contributions.numel() and not bool((sens.contributions >= max_grad_norm * (1 - 1e-6)).any()):
                    fix = (f"run it again with a smaller --clip (below {top:.3g})" if top != 0.0 else
                           "every example's contribution is 0 (no gradient reaches the trained parameters: a "
                           "detached or unused output, a zero loss?), so there is nothing to clip")
                    print(f"[{m}] NOTE: no example's gradient norm reached C = {max_grad_norm:g}, so no example was "
                          f"clipped and the check did not exercise clipping: {fix}", file=out)
                if sens.dropped:
                    rows = list(sens.dropped)
                    if u["mask"] is not None:  # (the check ran on the kept rows: name the file's rows)
                        kept_rows = torch.as_tensor(u["mask"], dtype=torch.bool).nonzero().flatten().tolist()
                        rows = [kept_rows[i] for i in rows]
                    print(f"[{m}] WARNING: the step dropped examples {rows} as non-finite (their "
                          "loss or gradient is nan/inf): they add nothing to the sum, and the bounds above "
                          "hold for the others", file=out)
            results.append(CheckResult(m, True, rep))
        except AssertionError as e:
            results.append(CheckResult(m, False, error=str(e)))
            what = "EXACTNESS NOT SHOWN" if str(e).startswith("nothing to compare") else "MISMATCH"
            print(f"[{m}] {what}\n{_indent(str(e))}", file=out)
        except Exception as e:  # the model cannot run under this method: a readable line, not a traceback
            results.append(CheckResult(m, False, error=f"{type(e).__name__}: {e}"))
            print(f"[{m}] ERROR {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=out)
    return results


def _mixing(u: Dict[str, Any], float64: bool, rtol: float, compared: List[str]) -> Optional[str]:
    """Why the model's batched forward is not each example alone (the first real example whose loss
    in the batch differs from its loss run alone), or None. DP-SGD's per-example gradients are each
    example's loss run alone (``vmap`` and the naive loop; book-keeping sends what its example-order
    check finds mixing to that exact fallback), so on such a model what trains is not the batched
    forward the user evaluates (review, round 42: ``pdpsgd check`` said OK). Compared in eval mode,
    and in the model's own mode too where that is training and, with torch's dropouts at rate 0
    (``DropoutOff``; round 43), its forward draws no random numbers (two batched runs equal, the CPU
    random state unmoved: a batch statistic used in training only; other draws, a drop path's say,
    differ between a batch and one example, so such a forward is compared in eval mode only). In
    float64 unless ``--no-float64``. A model or batch this cannot run (no copy, one example alone
    failing) is left to the methods' own checks. ``compared``: the modes compared are appended."""
    try:
        return _mixing_found(u, float64, rtol, compared)
    except Exception:  # (the methods' checks report why it cannot run, as a readable line)
        return None


def _mixing_found(u: Dict[str, Any], float64: bool, rtol: float, compared: List[str]) -> Optional[str]:
    import contextlib
    import copy

    import torch

    from .batch_order import DropoutOff
    from .per_sample import batch_size, select_examples
    from .testing import to_float64

    batch = u["batch"]
    B = batch_size(batch)
    if B < 2:
        return None
    copy_of = to_float64 if float64 else copy.deepcopy
    batch = to_float64(batch) if float64 else batch
    rows = list(range(B)) if u["mask"] is None else \
        torch.as_tensor(u["mask"], dtype=torch.bool).nonzero().flatten().tolist()
    runs = [("eval mode", copy_of(u["model"]).eval(), contextlib.nullcontext)]
    if any(m.training for m in u["model"].modules()):
        runs.append(("the model's own (training) mode, torch's dropouts at rate 0", copy_of(u["model"]), DropoutOff))
    for mode, model, ctx in runs:
        with torch.no_grad(), ctx():
            state = torch.get_rng_state()
            together = u["loss_fn"](model, batch).detach().double().flatten()
            drew = not torch.equal(state, torch.get_rng_state())
            again = u["loss_fn"](model, batch).detach().double().flatten()
            if drew or not torch.allclose(together, again, rtol=0, atol=0, equal_nan=True) or together.shape != (B,):
                continue  # (random numbers, or not one loss per example: the methods' checks say so)
            alone = torch.cat([u["loss_fn"](model, select_examples(batch, torch.tensor([i]))).detach().double()
                               .flatten() for i in rows])
        together = together[rows]
        fin_t, fin_a = torch.isfinite(together), torch.isfinite(alone)
        both = fin_t & fin_a
        scale = float(torch.maximum(together[both].abs(), alone[both].abs()).max()) if bool(both.any()) else 0.0
        diff = (together - alone).abs().masked_fill(~both, 0)
        bad = (fin_t != fin_a) | (diff > max(rtol, 1e-12) * max(scale, 1e-30))
        compared.append(mode)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            return (f"example {rows[j]}'s loss in the batch is {float(together[j]):.10g}, alone {float(alone[j]):.10g} "
                    f"({mode}): the forward or the loss mixes examples (a batch statistic, in-batch negatives, a "
                    "normalisation over the batch). DP-SGD's per-example gradients are each example's loss run "
                    "alone (what vmap and the naive loop below compute), so what would train is each example "
                    "alone, not this batched forward; and book-keeping, which runs the batch, keeps a layer on "
                    "its rules only where its example-order check finds no mixing (in eval mode where the forward "
                    "draws random numbers other than torch's dropouts). Make the forward and the loss per-example")
    return None


def _sensitivity(u: Dict[str, Any], method: str, max_grad_norm: float, float64: bool):
    import copy

    from .functional import trainable_params
    from .step import make_dp_step
    from .testing import check_sensitivity, to_float64

    batch, params = u["batch"], u["params"]
    if float64:
        model, batch = to_float64(u["model"]), to_float64(batch)  # (a copy)
    else:
        model = copy.deepcopy(u["model"])
    if params is None:
        params = trainable_params(model)
    elif float64:
        params = {n: v.detach().double() for n, v in params.items()}
    if u["mask"] is not None:  # (the rows the file keeps: a masked-out row is padding, not an example)
        import torch

        from .per_sample import select_examples

        batch = select_examples(batch, torch.as_tensor(u["mask"], dtype=torch.bool).nonzero().flatten())
    step = make_dp_step(model, u["loss_fn"], max_grad_norm=max_grad_norm, noise_multiplier=0.0, method=method)
    return check_sensitivity(step, params, batch, rtol=1e-9 if float64 else 1e-5)


def _precision_rtol(model: Any) -> float:
    """The relative tolerance a model's own precision allows against the naive loop (--no-float64)."""
    import torch

    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dts & {torch.bfloat16, torch.float16}:
        return 1e-2
    return 1e-9 if dts and dts <= {torch.float64} else 1e-4


def _indent(s: str) -> str:
    return "\n".join("    " + ln for ln in s.splitlines())


def run_check(path: str, methods: Iterable[str], *, rtol: Optional[float] = None, max_grad_norm: float = 1.0,
              float64: bool = True, sensitivity: bool = True) -> int:
    """CLI entry: 0 if every checked method matches the naive loop (and keeps its sensitivity bound), else 1."""
    results = check_file(path, methods, rtol=rtol, max_grad_norm=max_grad_norm, float64=float64,
                         sensitivity=sensitivity)
    bad = [r.method for r in results if not r.ok]
    if not [r for r in results if r.method != "model"]:  # (review, round 39: all skipped passed as "exact (none)")
        print("FAILED: no method was checked (book-keeping is not available: check --method vmap)", file=sys.stdout)
        return 1
    if bad:
        print(f"FAILED: {', '.join(bad)} (a model that mixes examples, a mismatch with the naive per-example loop, "
              "an exceeded sensitivity bound, or an error: see above)", file=sys.stdout)
        return 1
    what = "exact and within their sensitivity bound" if sensitivity else "exact"
    print(f"all checked methods are {what} ({', '.join(r.method for r in results if r.method != 'model') or 'none'})")
    return 0
