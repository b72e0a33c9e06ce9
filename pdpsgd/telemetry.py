"""Per-step telemetry of a DP training run: ε spent so far, clip fraction, per-example gradient
norm quantiles, loss, examples in the logical batch, wall time.

Note: everything except ε is computed from the private data *without* noise. It is for the
person running the training (choosing the clipping bound C, spotting divergence) and must not be
released as if it were private.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["Telemetry", "norm_quantiles", "QUANTILES"]

QUANTILES = (0.1, 0.5, 0.9)


def norm_quantiles(norms: Tensor, qs: Sequence[float] = QUANTILES, mask: Optional[Tensor] = None) -> Dict[str, float]:
    """``{"norm_q10": .., "norm_q50": .., "norm_q90": .., "norm_max": ..}`` over the finite norms of
    the real examples (``mask``); NaN when there are none."""
    x = norms.detach().double().cpu().flatten()
    if mask is not None:
        x = x[mask.detach().cpu().flatten().bool()]
    x = x[torch.isfinite(x)]
    out = {}
    for q in qs:
        out[f"norm_q{int(round(q * 100)):02d}"] = float(torch.quantile(x, q)) if x.numel() else math.nan
    out["norm_max"] = float(x.max()) if x.numel() else math.nan
    return out


class Telemetry:
    """Collects one record per logical step (and evaluation points), optionally appending each as a
    JSON line to ``path``.

    ``record(step, out, epsilon=...)`` takes a ``StepOutput`` (or any object with ``loss``,
    ``clip_fraction``, ``per_sample_norms``, ``num_examples``) and returns the record dict.
    """

    def __init__(self, path: Optional[os.PathLike] = None, *, history: Optional[List[Dict[str, Any]]] = None):
        self.path = path
        self.history: List[Dict[str, Any]] = list(history or [])
        self.evals: List[Dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def record(self, step: int, out: Any = None, *, epsilon: Optional[float] = None, mask: Optional[Tensor] = None,
               **extra: Any) -> Dict[str, Any]:
        rec: Dict[str, Any] = {"step": int(step)}
        if out is not None:
            rec["loss"] = _num(out.loss)
            if getattr(out, "clip_fraction", None) is not None:
                rec["clip_fraction"] = _num(out.clip_fraction)
            if getattr(out, "per_sample_norms", None) is not None and out.per_sample_norms.numel():
                m = mask if mask is not None else getattr(out, "mask", None)
                rec.update(norm_quantiles(out.per_sample_norms, mask=m))
            if getattr(out, "num_examples", None) is not None:
                rec["examples"] = int(_num(out.num_examples))
        if epsilon is not None:
            rec["epsilon"] = float(epsilon)
        rec.update({k: (_num(v) if isinstance(v, Tensor) else v) for k, v in extra.items()})
        rec.setdefault("time", time.perf_counter() - self._t0)
        self.history.append(rec)
        self._write(rec)
        return rec

    def record_eval(self, step: int, **metrics: Any) -> Dict[str, Any]:
        rec = {"step": int(step), **{k: (_num(v) if isinstance(v, Tensor) else v) for k, v in metrics.items()}}
        self.evals.append(rec)
        self._write({"eval": rec})
        return rec

    def _write(self, rec: Dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(_line(rec))

    def state_dict(self) -> Dict[str, Any]:
        return {"history": json.dumps(self.history), "evals": json.dumps(self.evals)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the records; the log at ``path`` is rewritten (atomically) to them, so steps redone
        after a resume are not logged twice."""
        self.history = json.loads(state["history"])
        self.evals = json.loads(state["evals"])
        if self.path is not None:
            from .checkpoint import atomic_write_text

            rows = [(r.get("step", 0), 0, r) for r in self.history]
            rows += [(r.get("step", 0), 1, {"eval": r}) for r in self.evals]  # (after its step's record)
            rows.sort(key=lambda x: x[:2])
            atomic_write_text(self.path, "".join(_line(r) for *_, r in rows))

    def summary(self, last: int = 10) -> Dict[str, float]:
        """Means over the last ``last`` steps of loss and clip fraction (NaN if none)."""
        tail = self.history[-last:]

        def mean(key: str) -> float:
            v = [r[key] for r in tail if key in r and r[key] == r[key]]
            return sum(v) / len(v) if v else math.nan

        return {"loss": mean("loss"), "clip_fraction": mean("clip_fraction")}


def _line(rec: Dict[str, Any]) -> str:
    """One strict JSON line: a non-finite number (an empty batch's loss) as null."""
    from .checkpoint import json_ready

    return json.dumps(json_ready(rec), allow_nan=False) + "\n"


def _num(x: Any) -> float:
    if isinstance(x, Tensor):
        return float(x.detach().float().cpu())
    return float(x)
