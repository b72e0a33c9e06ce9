"""Throughput and max batch (Bu et al. 2022, Fig. 4 shape) on GPT-2-shaped models that fit a CPU.

Methods: non-private; pdpsgd bk / auto / vmap; Opacus hooks (per-sample gradients) and Opacus
ghost clipping (optional dependency: rows skipped with a note when it is missing or fails).
Throughput: examples/s of one full DP step (gradients + clipping + noise + optimizer step) at a
fixed batch, every method of a model timed in one process, interleaved (round-robin, a rotating
start), so a noisy machine slows them alike. Max batch: each (model, method, B) runs in a fresh
subprocess; its peak RSS is measured at a few batch sizes, and the largest B under the memory cap
follows from the measured points (a linear fit in B). Not for vmap, whose memory is set by its
chunk (512 MiB by default), not by B.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common import bk_available, md_table, parse_mode, plt, write_results

SIZES = {  # GPT-2-shaped: (layers, width, heads)
    "gpt2-xs": (2, 128, 2),
    "gpt2-s": (4, 256, 4),
    "gpt2-m": (6, 384, 6),
}
SETTINGS = {
    "smoke": dict(sizes=["gpt2-xs"], T=16, vocab=1000, B=4, reps=1, probes=[4, 8], cap_gib=2.0,
                  methods=["non-private", "pdpsgd auto", "opacus hooks"]),
    "quick": dict(sizes=["gpt2-xs", "gpt2-s"], T=64, vocab=8192, B=8, reps=5, probes=[8, 32], cap_gib=4.0),
    "full": dict(sizes=["gpt2-xs", "gpt2-s", "gpt2-m"], T=128, vocab=16384, B=16, reps=5, probes=[16, 32, 64], cap_gib=8.0),
}
METHODS = ["non-private", "pdpsgd bk", "pdpsgd auto", "pdpsgd vmap", "opacus hooks", "opacus ghost"]


def gpt2(size: str, vocab: int, T: int, linear: bool = False):
    """GPT-2 from config (no weights); ``linear``: HF Conv1D layers swapped for equal nn.Linear."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    L, d, h = SIZES[size]
    cfg = GPT2Config(vocab_size=vocab, n_positions=max(T, 64), n_embd=d, n_layer=L, n_head=h,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg)
    if linear:
        for mod in list(m.modules()):
            for name, child in list(mod.named_children()):
                if isinstance(child, Conv1D):
                    lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                    with torch.no_grad():
                        lin.weight.copy_(child.weight.t())
                        lin.bias.copy_(child.bias)
                    setattr(mod, name, lin)
    return m


def lm_loss(model, b):
    ids = b["ids"]
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1).mean(1)


def make_runner(method: str, size: str, vocab: int, T: int, B: int):
    """A zero-argument function doing one training step at batch B."""
    from pdpsgd import make_dp_step, trainable_params

    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))
    if method.startswith("opacus"):
        import opacus  # noqa: F401
        from opacus.grad_sample import GradSampleModule

        pos = torch.arange(T).repeat(B, 1)  # per-example position ids (Opacus needs batch-first inputs)
        if method == "opacus hooks":  # the same model as the others: Conv1D and the tied head work with hooks
            model = gpt2(size, vocab, T)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            gsm = GradSampleModule(model, loss_reduction="sum")

            def run():
                opt.zero_grad(set_to_none=True)
                for p in model.parameters():
                    p.grad_sample = None
                logits = gsm(input_ids=ids, position_ids=pos).logits
                F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none").view(
                    B, -1).mean(1).sum().backward()
                gs = [p.grad_sample for p in model.parameters() if p.requires_grad]
                norms = torch.stack([g.reshape(B, -1).norm(dim=1) for g in gs]).norm(dim=0)
                c = (1.0 / (norms + 1e-6)).clamp(max=1.0)
                for p in model.parameters():
                    p.grad = (torch.einsum("b,b...->...", c, p.grad_sample) + torch.randn_like(p)) / B
                opt.step()
            return run
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        model = gpt2(size, vocab, T, linear=True)  # ghost clipping refuses Conv1D and tied weights
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="mean")
        dpo = DPOptimizerFastGradientClipping(opt, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B,
                                              loss_reduction="mean")
        crit = DPLossFastGradientClipping(gsm, dpo, nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean")

        def run():
            dpo.zero_grad(set_to_none=True)
            logits = gsm(input_ids=ids, position_ids=pos).logits[:, :-1]
            loss = crit(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), shape=(B, T - 1))
            loss.backward()
            dpo.step()
        return run
    model = gpt2(size, vocab, T)
    params = trainable_params(model)
    opt = torch.optim.SGD(list(params.values()), lr=1e-3)
    batch = {"ids": ids}
    if method == "non-private":
        def run():
            opt.zero_grad(set_to_none=True)
            lm_loss(model, batch).mean().backward()
            opt.step()
        return run
    step = make_dp_step(model, lm_loss, max_grad_norm=1.0, noise_multiplier=1.0, method=method.split()[-1],
                        generator=torch.Generator().manual_seed(0))

    def run():
        out = step(params, batch)
        for n, p in params.items():
            p.grad = out.grads[n]
        opt.step()
        opt.zero_grad(set_to_none=True)  # the others drop theirs at the step's start: same peak
    return run


def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the peak-RSS high-water mark
        return True
    except OSError:
        return False


def _threads() -> None:
    torch.set_num_threads(int(os.environ.get("REPRO_THREADS", max(1, min(2, os.cpu_count() or 1)))))


def time_methods(methods, size, vocab, T, B, reps, emit=True):
    """Child process: every method's runner built, run once, then timed ``reps`` rounds, one step of
    each method per round (the order rotating); prints one JSON line {method: median s | error}."""
    if emit:
        _threads()
    runs, out = {}, {}
    for m in methods:
        try:
            runs[m] = make_runner(m, size, vocab, T, B)
            runs[m]()
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            runs.pop(m, None)
            out[m] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    ts = {m: [] for m in runs}
    order = list(runs)
    for r in range(reps):
        for m in order[r % len(order):] + order[:r % len(order)]:
            t = time.perf_counter()
            runs[m]()
            ts[m].append(time.perf_counter() - t)
    for m in runs:
        out[m] = {"ok": True, "step_s": float(np.median(ts[m]))}
    if emit:
        print("TIMES " + json.dumps(out), flush=True)
    return out


def probe(method, size, vocab, T, mem_batches, emit=True):
    """Child process: peak RSS of (build + one step) at each of ``mem_batches`` (ascending,
    high-water mark reset before each); prints one JSON line."""
    if emit:
        _threads()
    out = {"ok": True, "peaks": {}}
    try:
        for b in sorted(mem_batches):
            if not _reset_hwm():
                break
            try:
                r = make_runner(method, size, vocab, T, b)
                r()
                out["peaks"][b] = _hwm_bytes()
                del r
            except Exception:  # noqa: BLE001 - out of memory etc.: stop the series
                break
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    if emit:
        print("PROBE " + json.dumps(out), flush=True)
    return out


def _child(flag, args, tag):
    cmd = [sys.executable, __file__, flag, json.dumps(args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    line = next((l for l in p.stdout.splitlines() if l.startswith(tag + " ")), None)
    if line is None:
        return None, f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else ''}"
    return json.loads(line[len(tag) + 1:]), None


def run_probe(method, size, vocab, T, mem_batches, inproc=False):
    if inproc:  # smoke mode: no subprocess (memory figures then meaningless)
        return json.loads(json.dumps(probe(method, size, vocab, T, mem_batches, emit=False)))
    out, err = _child("--probe", [method, size, vocab, T, list(mem_batches)], "PROBE")
    return out if out is not None else {"ok": False, "error": err}


def run_timing(methods, size, vocab, T, B, reps, inproc=False):
    if inproc:
        return time_methods(methods, size, vocab, T, B, reps, emit=False)
    out, err = _child("--time", [methods, size, vocab, T, B, reps], "TIMES")
    return out if out is not None else {m: {"ok": False, "error": err} for m in methods}


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--probe":
        probe(*json.loads(sys.argv[2]))
        return None
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--time":
        time_methods(*json.loads(sys.argv[2]))
        return None
    a = parse_mode(__doc__.splitlines()[0], argv)
    cfg = SETTINGS[a.mode]
    t0 = time.time()
    have_bk = bk_available()
    try:
        import opacus

        opacus_version = opacus.__version__
    except Exception:
        opacus_version = None
    cap = cfg["cap_gib"] * 2 ** 30
    rows = []
    for size in cfg["sizes"]:
        n_params = sum(p.numel() for p in gpt2(size, cfg["vocab"], cfg["T"]).parameters())
        skip = {}
        for method in cfg.get("methods", METHODS):
            if method in ("pdpsgd bk", "pdpsgd auto") and not have_bk:
                skip[method] = "not run: pdpsgd.bookkeeping not importable"
            if method.startswith("opacus") and opacus_version is None:
                skip[method] = "skipped: opacus not installed"
        timed = [m for m in cfg.get("methods", METHODS) if m not in skip]
        times = run_timing(timed, size, cfg["vocab"], cfg["T"], cfg["B"], cfg["reps"], inproc=a.mode == "smoke")
        for method in cfg.get("methods", METHODS):
            row = {"model": size, "params_M": n_params / 1e6, "method": method, "B": cfg["B"]}
            if method in skip or not times[method]["ok"]:
                row["note"] = skip.get(method) or times[method]["error"]
                rows.append(row)
                print(row, flush=True)
                continue
            row["step_s"] = times[method]["step_s"]
            row["throughput"] = cfg["B"] / row["step_s"]
            if method == "pdpsgd vmap":
                row["note"] = "max batch: none (vmap's memory is set by its chunk, not by B)"
                rows.append(row)
                print(row, flush=True)
                continue
            r = run_probe(method, size, cfg["vocab"], cfg["T"], cfg["probes"], inproc=a.mode == "smoke")
            if not r["ok"]:
                row["note"] = r["error"]
                rows.append(row)
                print(row, flush=True)
                continue
            pts = sorted((int(b), v) for b, v in r["peaks"].items())
            if len(pts) >= 2:
                bs, mem = map(np.array, zip(*pts))
                slope, icpt = np.polyfit(bs, mem, 1)
                row["mem_per_example_MiB"] = slope / 2 ** 20
                row["base_MiB"] = icpt / 2 ** 20
                row["max_batch"] = int(max(0, (cap - icpt) // slope)) if slope > 0 else None
                row["peak_MiB_at_largest_probe"] = float(mem[-1]) / 2 ** 20
            rows.append(row)
            print(row, flush=True)
    for size in cfg["sizes"]:  # relative to non-private
        base = next((r for r in rows if r["model"] == size and r["method"] == "non-private"), {})
        for r in rows:
            if r["model"] == size and r.get("throughput") and base.get("throughput"):
                r["rel_throughput"] = r["throughput"] / base["throughput"]
                if r.get("mem_per_example_MiB") and base.get("mem_per_example_MiB"):
                    r["rel_mem_per_example"] = r["mem_per_example_MiB"] / base["mem_per_example_MiB"]
    cols = [("model", "model"), ("params_M", "params (M)"), ("method", "method"), ("throughput", f"examples/s (B={cfg['B']})"),
            ("rel_throughput", "× non-private"), ("mem_per_example_MiB", "MiB / example"),
            ("rel_mem_per_example", "mem/example × non-priv."), ("max_batch", f"max batch @ {cfg['cap_gib']:g} GiB"),
            ("note", "note")]
    table = md_table(rows, cols, nd=2)
    P = plt()
    fig, axes = P.subplots(1, 2, figsize=(11, 4))
    sizes = cfg["sizes"]
    x = np.arange(len(sizes))
    wdt = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        thr = [next((r.get("throughput") or 0 for r in rows if r["model"] == s and r["method"] == m), 0) for s in sizes]
        mb = [next((r.get("max_batch") or 0 for r in rows if r["model"] == s and r["method"] == m), 0) for s in sizes]
        axes[0].bar(x + i * wdt, thr, wdt, label=m)
        axes[1].bar(x + i * wdt, mb, wdt, label=m)
    for ax, t in zip(axes, [f"throughput (examples/s), T={cfg['T']}, B={cfg['B']}", f"max batch under {cfg['cap_gib']:g} GiB (0 = not run/failed)"]):
        ax.set_xticks(x + 0.4 - wdt / 2, sizes)
        ax.set_title(t, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "bk_throughput.png", dpi=110)
    notes = [
        f"GPT-2 from transformers' GPT2Config (random init), vocab {cfg['vocab']}, T = {cfg['T']}, tied wte/lm_head, "
        "sizes (layers, width, heads): " + ", ".join(f"{s} {SIZES[s]}" for s in sizes) + ".",
        f"Throughput = B / median step time, every method of a model in one process, interleaved ({cfg['reps']} rounds, "
        "a rotating order); each memory measurement in a fresh subprocess.",
        f"Max batch: peak RSS (VmHWM, reset before each) of building the model + one step at B ∈ {cfg['probes']}, line fitted, largest B with fitted peak ≤ cap. A model, not a search: "
        "CPU RSS includes the Python/torch runtime (the fit's intercept).",
        "Opacus hooks runs the same model (its functorch fallback handles HF Conv1D; the tied head's grad_sample is the "
        "sum over both uses). Opacus ghost clipping refuses both, so its rows use a copy whose Conv1D layers are equal "
        f"nn.Linear and whose lm_head is untied (more parameters: its work is not the same); opacus {opacus_version or 'not installed'}.",
    ]
    write_results(a.out, "bk_throughput", title="Throughput and max batch on GPT-2-shaped models (Bu et al. 2022, Fig. 4 shape)",
                  mode=a.mode, sections=[("", table)], data={"settings": cfg, "rows": rows}, started=t0, notes=notes)
    print(table)
    return rows


if __name__ == "__main__":
    main()
