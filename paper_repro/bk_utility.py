"""Utility (Bu et al. 2022): DP fine-tuning of a GPT-2-shaped LM at ε = 3 vs non-private — every
clipping mode gives the same model, since book-keeping is exact.

A GPT-2 from config is first trained non-privately on half of the BBC News articles ("pre-training",
shared by all runs), then fine-tuned on the other half's training split: non-privately, and with
DP-SGD (ε = 3, δ = 1e-5) through each per-example engine — vmap, bk with every layer forced to the
ghost route, forced to the explicit route, 'bk' (the paper's mixed rule) and 'auto' — with the same
seed, so the same Poisson batches and the same noise. Test perplexity and next-token accuracy.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.nn.functional as F

from common import (DPConfig, bk_available, calibrate_schedule, epsilon_of, load_bbc, md_table, n_of, parse_mode,
                    plt, simple_tokenize, train, write_results)

DELTA = 1e-5
EPS = 3.0
SETTINGS = {
    "smoke": dict(size=(1, 32, 2), vocab=300, T=16, n_pre=60, n_ft=60, n_test=30, pre_epochs=1, epochs=1, B=20, lr=1e-3),
    "quick": dict(size=(2, 128, 2), vocab=4000, T=32, n_pre=3000, n_ft=1000, n_test=400, pre_epochs=2, epochs=2, B=50, lr=5e-4),
    "full": dict(size=(4, 256, 4), vocab=8000, T=64, n_pre=8000, n_ft=3000, n_test=1000, pre_epochs=3, epochs=4, B=100, lr=5e-4),
}


def chunks(texts, stoi, T, n):
    """Up to n windows of T tokens from the articles in order, and how many articles they read."""
    ids, used = [], 0
    for t in texts:
        if len(ids) >= n * T:
            break
        ids.extend(stoi.get(w, 1) for w in simple_tokenize(t))
        used += 1
    return torch.tensor(ids[: (len(ids) // T) * T]).view(-1, T)[:n], used


def split_windows(texts, stoi, T, n_train, n_test):
    """n_train training windows from the first articles and n_test held-out windows from the articles
    after them: no article has tokens on both sides (a window may straddle two articles of one side)."""
    train, used = chunks(texts, stoi, T, n_train)
    test, _ = chunks(texts[used:], stoi, T, n_test)
    if len(train) < n_train or len(test) < n_test:
        raise ValueError(f"{len(texts)} articles give {len(train)} training and {len(test)} held-out windows of "
                         f"{T} tokens, fewer than the {n_train} + {n_test} asked for: use more articles or a smaller n")
    return train, test


def lm_loss(model, b):
    ids = b["ids"]
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1).mean(1)


@torch.no_grad()
def lm_eval(model, data):
    model.eval()
    tot, correct, count = 0.0, 0, 0
    for i in range(0, n_of(data), 100):
        ids = data["ids"][i : i + 100]
        logits = model(input_ids=ids).logits[:, :-1]
        tgt = ids[:, 1:]
        tot += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == tgt).sum())
        count += tgt.numel()
    return math.exp(tot / count), correct / count


def main(argv=None):
    a = parse_mode(__doc__.splitlines()[0], argv)
    cfg = SETTINGS[a.mode]
    t0 = time.time()
    from transformers import GPT2Config, GPT2LMHeadModel

    data = load_bbc()
    rng = np.random.default_rng(a.seed)
    perm = rng.permutation(len(data))
    half = len(perm) // 2
    pre_texts = [data.texts[i] for i in perm[:half]]
    ft_texts = [data.texts[i] for i in perm[half:]]
    counts = {}
    for t in pre_texts:
        for w in simple_tokenize(t):
            counts[w] = counts.get(w, 0) + 1
    itos = ["<pad>", "<unk>"] + sorted(counts, key=lambda w: -counts[w])[: cfg["vocab"] - 2]
    stoi = {w: i for i, w in enumerate(itos)}
    pre = {"ids": chunks(pre_texts, stoi, cfg["T"], cfg["n_pre"])[0]}
    ft_ids, test_ids = split_windows(ft_texts, stoi, cfg["T"], cfg["n_ft"], cfg["n_test"])
    ft, test = {"ids": ft_ids}, {"ids": test_ids}
    L, d, h = cfg["size"]
    gcfg = GPT2Config(vocab_size=len(itos), n_positions=cfg["T"], n_embd=d, n_layer=L, n_head=h, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(a.seed)
    base = GPT2LMHeadModel(gcfg)
    tp = time.perf_counter()
    train(base, lm_loss, pre, epochs=cfg["pre_epochs"], batch_size=cfg["B"], lr=1e-3, seed=a.seed)
    pre_time = time.perf_counter() - tp
    ppl0, acc0 = lm_eval(base, test)
    n = n_of(ft)
    steps = max(1, round(n / cfg["B"]))
    q = cfg["B"] / n
    sched = calibrate_schedule(EPS, DELTA, q, steps, cfg["epochs"])
    eps_acc = epsilon_of(sched, q, steps, DELTA)
    variants = [("non-private", None)]
    variants.append(("vmap", DPConfig(sched, 1.0, method="vmap")))
    if bk_available():
        variants += [
            ("bk, all ghost", DPConfig(sched, 1.0, method="bk", bk_options={"cost_model": "ghost", "explicit_max_elems": 1 << 40})),
            ("bk, all explicit", DPConfig(sched, 1.0, method="bk", bk_options={"cost_model": "explicit", "explicit_max_elems": 1 << 40})),
            ("bk (mixed: 2T² < pd)", DPConfig(sched, 1.0, method="bk")),
            ("auto (time model)", DPConfig(sched, 1.0, method="auto")),
        ]
    rows = [{"variant": "before fine-tuning", "epsilon": None, "ppl": ppl0, "acc": acc0}]
    ref_params = None
    curves = {}
    for name, dp in variants:
        model = copy.deepcopy(base)
        losses = []
        info = train(model, lm_loss, ft, epochs=cfg["epochs"], batch_size=cfg["B"], lr=cfg["lr"], seed=a.seed, dp=dp,
                     on_step=lambda s, out: losses.append(float(out.loss) if out is not None else float("nan")))
        ppl, acc = lm_eval(model, test)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        diff = None
        if dp is not None:
            if ref_params is None:
                ref_params = flat
            diff = float((flat - ref_params).abs().max())
        rows.append({"variant": name, "epsilon": math.inf if dp is None else eps_acc, "ppl": ppl, "acc": acc,
                     "max_param_diff_vs_vmap": diff, "time_s": float(sum(info["epoch_times"]))})
        curves[name] = losses
        print(rows[-1], flush=True)
    cols = [("variant", "fine-tuning"), ("epsilon", "ε (PRV upper)"), ("ppl", "test perplexity"), ("acc", "next-token acc."),
            ("max_param_diff_vs_vmap", "max |θ − θ_vmap|"), ("time_s", "fine-tune time (s)")]
    table = md_table(rows, cols, nd=4)
    P = plt()
    fig, ax = P.subplots(figsize=(6.4, 4))
    for name, ls in curves.items():
        if name != "non-private" and ls:
            ax.plot(ls, label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss of the Poisson batch (DP runs)")
    ax.set_title(f"DP fine-tuning at ε = {EPS:g}: the engines' curves coincide", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "bk_utility.png", dpi=110)
    notes = [
        f"GPT-2 from config: {L} layers, width {d}, {h} heads, vocab {len(itos)} (word-level, BBC pre-training half), T = {cfg['T']}, tied embeddings.",
        f"Pre-training (non-private, shared): {n_of(pre)} sequences × {cfg['pre_epochs']} epochs ({pre_time:.0f} s). "
        f"Fine-tuning: {n} sequences, {cfg['epochs']} epochs, B = {cfg['B']} (Poisson q = {q:.3f}), Adam lr {cfg['lr']}, C = 1, "
        f"σ = {sched[0]:.3f}; test: {n_of(test)} held-out sequences from articles none of whose tokens are in a training window.",
        "Same seed for every DP run: identical Poisson batches and noise draws, so differences are floating-point only.",
    ]
    write_results(a.out, "bk_utility", title="DP fine-tuning of a GPT-2-shaped LM: every engine gives the same model (Bu et al. 2022)",
                  mode=a.mode, sections=[("", table)], data={"settings": cfg, "rows": rows, "sigma": sched[0]},
                  started=t0, notes=notes)
    print(table)
    return rows


if __name__ == "__main__":
    main()
