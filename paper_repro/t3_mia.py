"""T3 (Dupuy et al. 2021): membership inference vs ε — loss threshold (Yeom et al.) and LiRA.

K models per (model, ε) are trained on independent random halves of a pool of examples. Each model
in turn is the target and the other K − 1 are its shadow models (online LiRA, global variance,
on the logit-scaled confidence). Scores of all K targets are pooled; AUC, advantage and TPR at
FPR = 1 % and 0.1 % are reported beside what (ε, δ)-DP allows.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch

from common import (DPConfig, bilstm_task, bk_available, evaluate, md_table, minilm_task, parse_mode, plt,
                    take, train, write_results)
from pdpsgd.accounting import PRVAccountant, calibrate_noise
from pdpsgd.audit import (dp_advantage_bound, dp_auc_bound, dp_tpr_bound, lira_scores, logit_confidence,
                          mia_metrics)

DELTA = 1e-5
FPRS = (0.01, 0.001)
SETTINGS = {
    "smoke": dict(eps=[1.0, math.inf], combos=[
        ("bilstm", "tweets", dict(n_train=120, n_test=10, seq_len=16, hidden=16), dict(epochs=2, batch_size=30, lr=3e-3), 3),
    ]),
    "quick": dict(eps=[1.0, 8.0, math.inf], combos=[
        ("bilstm", "tweets", dict(n_train=600, n_test=10, seq_len=32, hidden=32), dict(epochs=8, batch_size=30, lr=5e-3), 8),
        ("minilm", "bbc", dict(n_train=300, n_test=10, seq_len=64, k=1), dict(epochs=3, batch_size=25, lr=1e-3), 4),
    ]),
    "full": dict(eps=[0.5, 1.0, 3.0, 8.0, math.inf], combos=[
        ("bilstm", "tweets", dict(n_train=1000, n_test=10, seq_len=32, hidden=64), dict(epochs=15, batch_size=25, lr=5e-3), 16),
        ("minilm", "bbc", dict(n_train=500, n_test=10, seq_len=128, k=1), dict(epochs=5, batch_size=25, lr=1e-3), 8),
    ]),
}


def main(argv=None):
    a = parse_mode(__doc__.splitlines()[0], argv)
    cfg = SETTINGS[a.mode]
    t0 = time.time()
    method = "auto" if bk_available() else "vmap"
    rows, meta = [], {}
    curves = {}
    for model, dataset, tkw, trkw, K in cfg["combos"]:
        # (the BiLSTM's vocabulary from the candidate pool: membership in it, not its texts, is the secret)
        task = (bilstm_task(dataset, seed=a.seed, vocab_from_train=True, **tkw) if model == "bilstm"
                else minilm_task(dataset, seed=a.seed, **tkw))
        pool = task.train  # the candidate examples
        N = task.info["n_train"]
        rng = np.random.default_rng(a.seed + 5)
        IN = rng.random((K, N)) < 0.5
        meta[task.name] = {**task.info, **trkw, "shadow_models": K, "pool": N}
        for eps in cfg["eps"]:
            losses = np.zeros((K, N))
            eps_acc, accs = [], []
            for k in range(K):
                idx = torch.from_numpy(np.nonzero(IN[k])[0])
                data = take(pool, idx)
                # q, the steps and σ from the public size N/2, not this model's random half (whose size
                # depends on who is in: neighbours would see different numbers of steps; review, round 38)
                n = N // 2
                steps = max(1, round(n / trkw["batch_size"]))
                q = trkw["batch_size"] / n
                dp = None
                if not math.isinf(eps):
                    sigma = calibrate_noise(target_epsilon=eps, delta=DELTA, sample_rate=q, steps=steps * trkw["epochs"])
                    acc = PRVAccountant()
                    acc.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps * trkw["epochs"])
                    eps_acc.append(float(acc.epsilon(DELTA).upper))
                    dp = DPConfig([sigma] * trkw["epochs"], max_grad_norm=1.0, method=method)
                m = task.make_model(a.seed * 100 + k)
                train(m, task.loss_fn, data, seed=a.seed * 100 + k, dp=dp, public_n=n, **trkw)
                ev = evaluate(m, task.loss_fn, pool)
                losses[k] = ev["losses"]
                accs.append(ev["accuracy"])
            stat = np.stack([logit_confidence(l) for l in losses])
            loss_s, lira_s, labels = [], [], []
            for k in range(K):
                others = [j for j in range(K) if j != k]
                loss_s.append(-losses[k])
                lira_s.append(lira_scores(stat[k], stat[others], IN[others], online=True, fix_variance=True))
                labels.append(IN[k])
            labels = np.concatenate(labels)
            eps_r = max(eps_acc) if eps_acc else math.inf
            for attack, sc in (("loss threshold", np.concatenate(loss_s)), (f"LiRA (online, {K - 1} shadows)", np.concatenate(lira_s))):
                r = mia_metrics(sc, labels, FPRS)
                rows.append({
                    "model": task.name, "target_eps": eps, "epsilon": eps_r, "attack": attack, "auc": r.auc,
                    "advantage": r.advantage, "tpr_1": r.tpr_at_fpr[0.01], "tpr_01": r.tpr_at_fpr[0.001],
                    "bound_auc": dp_auc_bound(eps_r, DELTA), "bound_adv": dp_advantage_bound(eps_r, DELTA),
                    "bound_tpr_1": dp_tpr_bound(0.01, eps_r, DELTA), "bound_tpr_01": dp_tpr_bound(0.001, eps_r, DELTA),
                    "pool_accuracy": float(np.mean(accs)), "targets": K, "scores": int(labels.size),
                })
                print({k: v for k, v in rows[-1].items()}, flush=True)
                if attack.startswith("LiRA"):
                    from pdpsgd.audit import roc_curve

                    fpr, tpr, _ = roc_curve(sc, labels)
                    curves[(task.name, eps)] = (fpr, tpr)
    cols = [("model", "model/data"), ("target_eps", "ε"), ("attack", "attack"), ("auc", "AUC"),
            ("bound_auc", "AUC bound"), ("advantage", "advantage"), ("bound_adv", "adv. bound"),
            ("tpr_1", "TPR@1%"), ("bound_tpr_1", "bound@1%"), ("tpr_01", "TPR@0.1%"), ("bound_tpr_01", "bound@0.1%"),
            ("pool_accuracy", "train-pool acc.")]
    table = md_table(rows, cols)
    P = plt()
    names = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = P.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for eps in cfg["eps"]:
            if (name, eps) in curves:
                fpr, tpr = curves[(name, eps)]
                lab = "∞" if math.isinf(eps) else f"{eps:g}"
                line, = ax.plot(np.maximum(fpr, 1e-5), np.maximum(tpr, 1e-5), label=f"LiRA, ε={lab}")
                if not math.isinf(eps):
                    f = np.logspace(-5, 0, 200)
                    ax.plot(f, dp_tpr_bound(f, eps, DELTA), ls=":", color=line.get_color(), label=f"DP bound ε={lab}")
        ax.plot([1e-5, 1], [1e-5, 1], color="gray", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("FPR")
        ax.set_ylabel("TPR")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "t3_mia.png", dpi=110)
    notes = [
        f"Each model trains on a random half of its pool (independent per model); every model is a target once; scores "
        f"of all targets pooled. δ = {DELTA:g}; bounds use the accounted ε (PRV upper) of the DP runs.",
        "Bounds: TPR ≤ min(e^ε·FPR + δ, 1 − e^−ε(1 − δ − FPR)); advantage ≤ (e^ε − 1 + 2δ)/(e^ε + 1); AUC ≤ area under the TPR bound.",
        "TPR at FPR 0.1 % is only resolved when there are ≳ 1,000 non-member scores (see 'scores' in the JSON).",
        f"DP training: Poisson sampling, Adam, C = 1, method = '{method}'. Non-private (ε = ∞): same hyper-parameters.",
    ]
    write_results(a.out, "t3_mia", title="T3: membership inference vs ε (Dupuy et al. 2021, scaled down)", mode=a.mode,
                  sections=[("", table)], data={"delta": DELTA, "settings": meta, "rows": rows}, started=t0, notes=notes)
    print(table)
    return rows


if __name__ == "__main__":
    main()
