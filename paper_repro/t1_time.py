"""T1 (Dupuy et al. 2021): training time per epoch — non-private vs naive per-example DP-SGD vs pdpsgd.

For the BiLSTM (GloVe) and the MiniLM-L6 transformer: the median process CPU time of a few steps at a
fixed batch size (all methods interleaved), times the steps in one epoch of the T2 training set. "Naive" is the baseline the paper
improves on: one forward/backward per example (micro-batch of 1), clip, sum, add noise.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from common import bilstm_task, bk_available, md_table, minilm_task, parse_mode, plt, take, write_results
from pdpsgd import make_dp_step, trainable_params

SETTINGS = {
    "smoke": dict(reps=1, combos=[
        ("bilstm", "tweets", dict(n_train=64, n_test=8, seq_len=16, hidden=16), 16, 2000),
        ("minilm", "tweets", dict(n_train=16, n_test=8, seq_len=16, k=1), 8, 2000),
    ]),
    "quick": dict(reps=3, combos=[
        ("bilstm", "tweets", dict(n_train=64, n_test=8, seq_len=32, hidden=64), 32, 2000),
        ("minilm", "bbc", dict(n_train=32, n_test=8, seq_len=64, k=2), 16, 1000),
    ]),
    "full": dict(reps=5, combos=[
        ("bilstm", "tweets", dict(n_train=128, n_test=8, seq_len=48, hidden=64), 64, 30000),
        ("minilm", "bbc", dict(n_train=64, n_test=8, seq_len=128, k=6), 32, 1780),
    ]),
}


def naive_step(model, loss_fn, params, batch, C, sigma, gen):
    """Per-example loop: forward/backward one example at a time, clip, sum, add noise."""
    names = list(params)
    ps = [params[n] for n in names]
    total = [torch.zeros_like(p) for p in ps]
    B = int(batch["labels"].shape[0])
    for i in range(B):
        ex = take(batch, slice(i, i + 1))
        g = torch.autograd.grad(loss_fn(model, ex).sum(), ps, allow_unused=True)
        g = [torch.zeros_like(p) if x is None else x for p, x in zip(ps, g)]
        norm = torch.sqrt(sum((x * x).sum() for x in g))
        c = min(1.0, C / (float(norm) + 1e-12))
        for t, x in zip(total, g):
            t.add_(x, alpha=c)
    return {n: (t + sigma * C * torch.randn(t.shape, generator=gen)) / B for n, t in zip(names, total)}


def time_runs(runs, reps):
    """Median process CPU time per step of each run, interleaved: every rep steps each run (order
    rotating), each timed step right after an untimed step of the same run (steady state), so load
    from other jobs on the machine hits all runs alike. A run that raises is reported, not hidden."""
    ts = {label: [] for label, _, _ in runs}
    err = {}
    for label, fn, _ in runs:  # warm-up
        try:
            fn()
        except Exception as e:
            err[label] = f"{type(e).__name__}: {str(e)[:120]}"
    ok = [(label, fn) for label, fn, _ in runs if label not in err]
    for r in range(reps):
        for label, fn in ok[r % len(ok):] + ok[: r % len(ok)]:
            fn()
            t = time.process_time()
            fn()
            ts[label].append(time.process_time() - t)
    return {label: (float(np.median(v)) if v else float("nan")) for label, v in ts.items()}, err


def main(argv=None):
    a = parse_mode(__doc__.splitlines()[0], argv)
    cfg = SETTINGS[a.mode]
    t0 = time.time()
    have_bk = bk_available()
    rows = []
    for model_name, dataset, tkw, B, n_epoch in cfg["combos"]:
        task = (bilstm_task if model_name == "bilstm" else minilm_task)(dataset, seed=a.seed, **tkw)
        model = task.make_model(a.seed)
        model.train()
        params = trainable_params(model)
        batch = take(task.train, slice(0, B))
        steps = math.ceil(n_epoch / B)
        n_params = sum(p.numel() for p in params.values())
        opt = torch.optim.SGD(list(params.values()), lr=1e-3)

        def nonpriv():
            opt.zero_grad(set_to_none=True)
            task.loss_fn(model, batch).mean().backward()
            opt.step()

        def then_step(grads):  # every variant ends with the same optimizer step (review, round 35)
            for n, p in params.items():
                p.grad = grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)

        gen = torch.Generator().manual_seed(0)
        runs = [("non-private", nonpriv, None)]
        runs.append(("naive per-example loop",
                     lambda: then_step(naive_step(model, task.loss_fn, params, batch, 1.0, 1.0, gen)), None))
        methods = ["vmap"] + (["bk", "auto"] if have_bk else [])
        for meth in methods:
            step = make_dp_step(model, task.loss_fn, max_grad_norm=1.0, noise_multiplier=1.0, method=meth,
                                generator=torch.Generator().manual_seed(0))
            routes = step.plan(batch, params) if meth != "vmap" else {}
            runs.append((f"pdpsgd {meth}", (lambda s=step: then_step(s(params, batch).grads)), routes))
        times, errors = time_runs(runs, cfg["reps"])
        base = times["non-private"]
        for label, fn, routes in runs:
            t, err = times[label], errors.get(label)
            rc = {}
            for r in (routes or {}).values():
                rc[r] = rc.get(r, 0) + 1
            rows.append({"model": task.name, "method": label, "batch": B, "step_s": t, "epoch_s": t * steps,
                         "slowdown": t / base, "epoch_examples": n_epoch, "trained_params": n_params,
                         "routes": ", ".join(f"{k}×{v}" for k, v in sorted(rc.items())) or ("—" if routes is None else "vmap (all)"),
                         "error": err})
            print(rows[-1], flush=True)
    if not have_bk:
        rows.append({"model": "—", "method": "pdpsgd bk: NOT RUN (pdpsgd.bookkeeping not importable)"})
    cols = [("model", "model"), ("method", "method"), ("batch", "B"), ("step_s", "s/step"),
            ("epoch_s", "s/epoch (est.)"), ("slowdown", "× non-private"), ("routes", "BK routes (params)")]
    table = md_table(rows, cols)
    P = plt()
    names = list(dict.fromkeys(r["model"] for r in rows if r.get("step_s") is not None))
    fig, axes = P.subplots(1, len(names), figsize=(5.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        rs = [r for r in rows if r["model"] == name]
        ax.barh([r["method"] for r in rs], [r["epoch_s"] for r in rs], color=["#888"] + ["#c44"] + ["#48c"] * (len(rs) - 2))
        for i, r in enumerate(rs):
            ax.text(r["epoch_s"], i, f" {r['slowdown']:.1f}×", va="center", fontsize=8)
        ax.set_xlim(0, 1.15 * max(r["epoch_s"] for r in rs if r["epoch_s"] == r["epoch_s"]))
        ax.set_xlabel(f"seconds per epoch ({rs[0]['epoch_examples']} examples, B={rs[0]['batch']})")
        ax.set_title(name, fontsize=10)
        ax.invert_yaxis()
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "t1_time.png", dpi=110)
    notes = [
        "s/epoch = median process CPU time per step × ceil(examples per epoch / B); one process, methods interleaved (each timed step right after an untimed step of the same method, order rotating per rep), so other load on the machine hits all methods alike.",
        "BiLSTM: frozen GloVe-50d, trainable BiLSTM + head. MiniLM: the top k blocks + head trained on cached lower-block outputs (k in the JSON).",
        "BK routes: how the book-keeping engine computed each trainable parameter's norm (ghost / explicit / vmap fallback; the LSTM weights by the recurrent-layer rule, pdpsgd/rules/rnn.py).",
        "All DP variants clip at C = 1 and add σ = 1 noise; the naive loop is a plain Python loop of torch.autograd.grad over single examples.",
    ]
    write_results(a.out, "t1_time", title="T1: training time per epoch (Dupuy et al. 2021, scaled down)", mode=a.mode,
                  sections=[("", table)], data={"rows": rows, "settings": {k: str(v) for k, v in cfg.items()}},
                  started=t0, notes=notes)
    print(table)
    return rows


if __name__ == "__main__":
    main()
