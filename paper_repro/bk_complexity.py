"""Complexity check (Bu et al. 2022): ghost-norm vs explicit per-example-gradient route, per layer.

One linear layer (p = d = width) on input (B, T, p), loss = sum of squares per example; the whole
DP step (forward, backward, norms, clipped sum) is timed with every parameter forced to the ghost
route and to the explicit route. The paper's model: ghost ∝ 2BT²(p+d), explicit ∝ Bpd (memory) and
BTpd (time, shared by both routes' clipped sum), hence ghost iff 2T² < pd. We report where the
measured crossover is on this CPU, and which route pdpsgd's 'bk' (the paper's rule) and 'auto'
(pdpsgd's time cost model) pick.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from torch import nn

from common import bk_available, md_table, parse_mode, plt, write_results
from pdpsgd import make_dp_step, trainable_params

SETTINGS = {
    "smoke": dict(B=4, Ts=[8, 32], widths=[32, 64], reps=1),
    "quick": dict(B=32, Ts=[8, 16, 32, 64, 128, 256, 512], widths=[64, 128, 256, 512, 1024], reps=5),
    "full": dict(B=64, Ts=[8, 16, 32, 64, 128, 256, 512, 1024], widths=[64, 128, 256, 512, 768, 1024, 2048], reps=7),
}


def loss_fn(model, b):
    return (model(b["x"]) ** 2).sum(dim=(1, 2))


def bench(step, params, batch, reps):
    step(params, batch)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        step(params, batch)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    a = parse_mode(__doc__.splitlines()[0], argv)
    cfg = SETTINGS[a.mode]
    t0 = time.time()
    if not bk_available():
        rows = []
        write_results(a.out, "bk_complexity", title="BK complexity check", mode=a.mode,
                      sections=[("", "NOT RUN: pdpsgd.bookkeeping is not importable.")], data={"rows": []},
                      started=t0)
        return rows
    B = cfg["B"]
    rows = []
    for w in cfg["widths"]:
        for T in cfg["Ts"]:
            torch.manual_seed(0)
            model = nn.Linear(w, w, bias=False)
            params = trainable_params(model)
            batch = {"x": torch.randn(B, T, w)}
            res = {}
            for route in ("ghost", "explicit"):
                step = make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0, method="bk",
                                    bk_options={"cost_model": route, "explicit_max_elems": 1 << 40})
                res[route] = bench(step, params, batch, cfg["reps"])
            picks = {}
            for meth in ("bk", "auto"):
                s = make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=0.0, method=meth)
                picks[meth] = s.plan(batch, params)["weight"]
            rows.append({
                "width": w, "T": T, "ghost_s": res["ghost"], "explicit_s": res["explicit"],
                "ratio": res["ghost"] / res["explicit"], "faster": "ghost" if res["ghost"] < res["explicit"] else "explicit",
                # the time model's ghost / explicit, 2T²(p+d) / (T·p·d) = 4T/w here: it crosses 1 at T = w/4, where
                # paper_rule (FastDP's memory rule 2T² < p·d) crosses at T = w/√2 (mutation review, round 45)
                "model_ratio": 2 * T * T * (2 * w) / (T * w * w + 1e-9),
                "paper_rule": "ghost" if 2 * T * T < w * w else "explicit",
                "bk_pick": picks["bk"], "auto_pick": picks["auto"],
            })
            print(rows[-1], flush=True)
    # crossover per width: smallest T where explicit is faster
    cross = []
    for w in cfg["widths"]:
        rs = [r for r in rows if r["width"] == w]
        meas = next((r["T"] for r in rs if r["faster"] == "explicit"), None)
        cross.append({"width": w, "measured": meas, "paper": w / math.sqrt(2),
                      "bk_agrees": sum(r["bk_pick"] == r["faster"] for r in rs), "auto_agrees": sum(r["auto_pick"] == r["faster"] for r in rs),
                      "n": len(rs)})
    cols = [("width", "p = d"), ("T", "T"), ("ghost_s", "ghost s/step"), ("explicit_s", "explicit s/step"),
            ("ratio", "ghost / explicit"), ("faster", "faster (measured)"), ("paper_rule", "2T² < pd ?"),
            ("bk_pick", "'bk' picks"), ("auto_pick", "'auto' picks")]
    ccols = [("width", "p = d"), ("measured", "measured crossover T (first T where explicit wins)"),
             ("paper", "paper rule: T = √(pd/2)"), ("bk_agrees", "'bk' right (of n)"), ("auto_agrees", "'auto' right (of n)"),
             ("n", "n")]
    P = plt()
    fig, ax = P.subplots(figsize=(6.4, 4))
    for w in cfg["widths"]:
        rs = [r for r in rows if r["width"] == w]
        line, = ax.plot([r["T"] for r in rs], [r["ratio"] for r in rs], "-o", label=f"p=d={w}")
        ax.axvline(w / math.sqrt(2), color=line.get_color(), ls=":", lw=0.8)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time ghost / time explicit (whole DP step)")
    ax.set_title(f"Ghost vs explicit per layer, B={B} (dotted: paper's crossover 2T² = pd)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "bk_complexity.png", dpi=110)
    notes = ["Times are of the whole DP step (forward + backward + norms + clipped sum) for one bias-free nn.Linear, median of reps after a warm-up.",
             "'bk' uses the paper's rule (ghost iff 2T² < pd); 'auto' uses pdpsgd's CPU/GPU time cost model (elementwise cost factor calibrated per device)."]
    write_results(a.out, "bk_complexity", title="BK complexity: ghost vs explicit route per layer (Bu et al. 2022)",
                  mode=a.mode, sections=[("Crossover", md_table(cross, ccols, nd=1)), ("All points", md_table(rows, cols))],
                  data={"B": B, "rows": rows, "crossover": cross}, started=t0, notes=notes)
    print(md_table(cross, ccols, nd=1))
    return rows


if __name__ == "__main__":
    main()
