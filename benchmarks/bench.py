"""Step time and peak memory: pdpsgd (bk / auto / vmap) vs non-private vs Opacus 1.6.

Timing: all variants of one config live in ONE process and are timed interleaved (round-robin,
median of --reps), so ratios come from the same run. Peak memory: one fresh subprocess per
variant (CPU: peak RSS growth over the step, ru_maxrss; CUDA: max_memory_allocated).

    python benchmarks/bench.py                       # the CPU table of benchmarks/README.md
    python benchmarks/bench.py --configs gpt2-128 --variants nonprivate,bk,auto --reps 5
    python benchmarks/bench.py --device cuda --configs gpt2small-256 --compile   # see gpu.sh

Every variant runs the same model, loss (per-sequence summed token CE / per-example CE), batch
and optimizer (Adam); DP variants use C = 1, σ = 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")

CONFIGS = {
    # name: (family, layers, width, heads, vocab, T, B)
    "gpt2-32": ("gpt2", 4, 256, 4, 8192, 32, 8),
    "gpt2-128": ("gpt2", 4, 256, 4, 8192, 128, 8),
    "gpt2-512": ("gpt2", 4, 256, 4, 8192, 512, 8),
    "bert-128": ("bert", 4, 256, 4, 8192, 128, 8),
    # OPT runs its feed-forward on the batch flattened to (B·T, d) rows (not an issue config)
    "opt-128": ("opt", 4, 256, 4, 8192, 128, 8),
    # BERT-shaped, a Poisson-sampled batch of short texts padded to its longest (128 tokens): lengths
    # 8 + Exp(mean 24), capped at 128, one example 128 long (see SKEWED; not an issue config)
    "bert-skew": ("bert", 4, 256, 4, 8192, 128, 32),
    "gpt2small-256": ("gpt2", 12, 768, 12, 50257, 256, 8),
    "tiny": ("gpt2", 2, 64, 2, 512, 16, 4),
    # GPT-2 small's depth at negligible compute: CPU time ~ host (launch / Python) overhead, the
    # GPU step's bottleneck (benchmarks/README.md, GPU section)
    "launch-proxy": ("gpt2", 12, 64, 2, 512, 16, 2),
    # BERT-shaped at negligible compute, right-padded like bert-128: the engine's fixed cost per step
    "bert-tiny": ("bert", 4, 16, 2, 512, 8, 2),
    # the GPT-2 shape (4 layers: the same 52 parameters, hooks and checks) at negligible
    # compute: the engine's fixed cost per step on the GPT-2 path (round 41)
    "gpt2-tiny": ("gpt2", 4, 16, 2, 64, 4, 2),
    # T5-shaped encoder-decoder (not an issue config): 4 + 4 layers, width 256, 128 source and 32 target
    # tokens; its relative attention bias (one table per stack) is an embedding looked up on (T, T)
    # position buckets and broadcast over the batch
    "t5-128": ("t5", 4, 256, 4, 8192, 128, 8),
    # LLaMA-shaped decoder (not an issue config): RMS norms, rotary positions, SwiGLU (4·d hidden), untied head
    "llama-128": ("llama", 4, 256, 4, 8192, 128, 8),
    # DeBERTa-v3-shaped classifier (not an issue config): relative positions (256 buckets), shared
    # attention keys; its relative-position parameters take the exact vmap fallback (benchmarks/README.md)
    "deberta-128": ("deberta", 4, 256, 4, 8192, 128, 8),
    # DeBERTa-v1-shaped classifier (not an issue config): DebertaLayerNorm, raw q/v biases, relative
    # positions (max_relative_positions = T: a 256-row table), c2p + p2c (rules/deberta_v1.py)
    "deberta1-128": ("deberta1", 4, 256, 4, 8192, 128, 8),
}
FUSED = False
AMP = False  # bf16 torch.autocast around every variant's model call (--amp)
COMPILE = False
NOISE_RNG = "auto"  # pdpsgd variants' noise source (--noise-rng; "bk:torch" etc. name one per variant)
BACK_TO_BACK = True
SKEWED = {"bert-skew"}  # configs whose BERT batch has short, skewed lengths (else uniform in [T/2, T])
VARIANTS = ["nonprivate", "bk", "auto", "vmap", "opacus", "opacus_ghost"]


def build(cfg_name, device, dtype=torch.float32, untied=False):
    fam, L, d, h, V, T, B = CONFIGS[cfg_name]
    torch.manual_seed(0)
    if fam == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=L, n_embd=d, n_head=h, vocab_size=V, n_positions=max(T, 32), resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=not untied,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    elif fam == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, ffn_dim=4 * d, vocab_size=V,
                        max_position_embeddings=max(T, 32), word_embed_proj_dim=d, dropout=0.0,
                        attention_dropout=0.0, tie_word_embeddings=not untied)
        model = OPTForCausalLM(cfg)
    elif fam == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, num_key_value_heads=h,
                          intermediate_size=4 * d, vocab_size=V, max_position_embeddings=max(T, 32),
                          attention_dropout=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM(cfg)
    elif fam == "deberta":
        from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

        cfg = DebertaV2Config(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, intermediate_size=4 * d,
                              vocab_size=V, num_labels=2, max_position_embeddings=max(T, 32), relative_attention=True,
                              position_buckets=256, norm_rel_ebd="layer_norm", share_att_key=True,
                              pos_att_type=["p2c", "c2p"], max_relative_positions=-1, position_biased_input=False,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = DebertaV2ForSequenceClassification(cfg)
    elif fam == "deberta1":
        from transformers import DebertaConfig, DebertaForSequenceClassification

        cfg = DebertaConfig(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, intermediate_size=4 * d,
                            vocab_size=V, num_labels=2, max_position_embeddings=max(T, 32), relative_attention=True,
                            pos_att_type=["c2p", "p2c"], max_relative_positions=-1, position_biased_input=False,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = DebertaForSequenceClassification(cfg)
    elif fam == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        cfg = T5Config(num_layers=L, num_decoder_layers=L, d_model=d, num_heads=h, d_kv=d // h, d_ff=4 * d,
                       vocab_size=V, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                       tie_word_embeddings=not untied)
        model = T5ForConditionalGeneration(cfg)
    else:
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(num_hidden_layers=L, hidden_size=d, num_attention_heads=h, intermediate_size=4 * d,
                         vocab_size=V, num_labels=2, max_position_embeddings=max(T, 32), hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        model = BertForSequenceClassification(cfg)
    model = model.to(device=device, dtype=dtype).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    if fam == "bert" and cfg_name in SKEWED:
        lengths = (8 + torch.empty(B).exponential_(1 / 24, generator=g)).long().clamp_(max=T)
        lengths[0] = T
        am = (torch.arange(T)[None] < lengths[:, None]).long()
    elif fam in ("bert", "deberta", "deberta1"):
        lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        am = (torch.arange(T)[None] < lengths[:, None]).long()
    labels = torch.randint(1, V, (B, T // 4), generator=g) if fam == "t5" else torch.randint(0, 2, (B,), generator=g)
    batch = {"input_ids": ids, "attention_mask": am, "labels": labels,
             "position_ids": torch.arange(T).expand(B, T).contiguous()}
    batch = {k: v.to(device) for k, v in batch.items()}
    return fam, model, batch


def make_loss(fam, explicit_pos=False):
    loss = _make_loss(fam, explicit_pos)
    if not AMP:
        return loss

    def amp_loss(m, b):
        with torch.autocast(b["input_ids"].device.type, dtype=torch.bfloat16):
            return loss(m, b)

    return amp_loss


def _make_loss(fam, explicit_pos=False):
    def gpt2_loss(m, b):
        kw = {"position_ids": b["position_ids"]} if explicit_pos else {}
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], **kw).logits[:, :-1]
        tgt = b["input_ids"][:, 1:]
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="none")
        return tok.view(tgt.shape).sum(1)

    def bert_loss(m, b):
        kw = {"position_ids": b["position_ids"]} if explicit_pos else {}
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], **kw).logits
        return F.cross_entropy(logits.float(), b["labels"], reduction="none")

    def t5_loss(m, b):  # per-sequence summed token CE of the target (teacher forcing)
        dec = torch.cat([torch.zeros_like(b["labels"][:, :1]), b["labels"][:, :-1]], 1)  # decoder start token 0
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], decoder_input_ids=dec).logits
        tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["labels"].reshape(-1), reduction="none")
        return tok.view(b["labels"].shape).sum(1)

    return {"gpt2": gpt2_loss, "opt": gpt2_loss, "llama": gpt2_loss, "t5": t5_loss}.get(fam, bert_loss)


def make_step(variant, cfg_name, device, compile_noise=False):
    """Returns a zero-arg function doing one full training step (``.model``: its model), and a description."""
    fam, model, batch = build(cfg_name, device, untied=(variant == "opacus_ghost"))
    step, note = _make_step(variant, fam, model, batch, device)
    step.model = model
    return step, note


def _make_step(variant, fam, model, batch, device):
    B = batch["input_ids"].shape[0]
    loss_fn = make_loss(fam)
    if variant == "nonprivate":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).sum().div(B).backward()
            opt.step()

        return step, ""
    base, _, rng = variant.partition(":")  # "bk:native": the bk variant with noise_rng="native"
    if base in ("bk", "auto", "vmap"):
        import pdpsgd

        variant, rng = base, (rng or NOISE_RNG)

        params = pdpsgd.trainable_params(model)
        opt = torch.optim.Adam(params.values(), lr=1e-4)
        dp = pdpsgd.make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                                 method=variant, generator=torch.Generator(device=device).manual_seed(0),
                                 noise_rng=rng)
        info = {}
        dtypes = {n: p.dtype for n, p in params.items()}
        gen = torch.Generator(device=device).manual_seed(1)

        def step():
            if FUSED:  # clipped sums, then pdpsgd.fused noise + scale (compiled with --compile)
                from pdpsgd import fused

                part = dp.clipped_sum(params, batch)
                grads = fused.noise_and_scale(part.sums, dp.noise_std, gen, float(B), dtypes, compile=COMPILE,
                                              rng=rng)
                routes = part.routes
            else:
                out = dp(params, batch)
                grads, routes = out.grads, out.routes
            for n, p in params.items():
                p.grad = grads[n]
            opt.step()
            opt.zero_grad(set_to_none=True)  # as DPTrainer: the grads do not live on into the next step
            info["routes"] = routes

        from collections import Counter

        class Note:
            def __str__(self):
                return str(dict(Counter(info.get("routes", {}).values())))

        return step, Note()
    if variant in ("opacus", "opacus_ghost"):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        ploss = make_loss(fam, explicit_pos=True)
        if variant == "opacus":
            gsm = GradSampleModule(model, loss_reduction="sum")
            opt = DPOptimizer(torch.optim.Adam(gsm.parameters(), lr=1e-4), noise_multiplier=1.0, max_grad_norm=1.0,
                              expected_batch_size=B, loss_reduction="sum")

            def step():
                opt.zero_grad(set_to_none=True)
                ploss(gsm, batch).sum().backward()
                opt.step()

            return step, "hooks"
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True,
                                                   loss_reduction="sum")
        opt = DPOptimizerFastGradientClipping(torch.optim.Adam(gsm.parameters(), lr=1e-4), noise_multiplier=1.0,
                                              max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")
        crit = DPLossFastGradientClipping(gsm, opt, nn.CrossEntropyLoss(reduction="sum"), "sum")

        def step():
            opt.zero_grad(set_to_none=True)
            kw = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "position_ids": batch["position_ids"]}
            with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=AMP):
                logits = gsm(**kw).logits
            if fam in ("gpt2", "opt", "llama"):
                lg = logits[:, :-1]
                loss = crit(lg.reshape(-1, lg.shape[-1]), batch["input_ids"][:, 1:].reshape(-1), shape=lg.shape)
            else:
                loss = crit(logits, batch["labels"])
            loss.backward()
            opt.step()

        return step, "ghost, untied copy" if fam in ("gpt2", "opt") else "ghost"
    raise ValueError(variant)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def hwm_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_run(variant, cfg_name, device, steps=2):
    step, _ = make_step(variant, cfg_name, device)
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            step()
        sync(device)
        return {"base": base, "peak": torch.cuda.max_memory_allocated() / 2**20}
    base = rss_mb()
    with open("/proc/self/clear_refs", "w") as f:  # reset the kernel's peak-RSS mark (VmHWM)
        f.write("5")
    for _ in range(steps):
        step()
    return {"base": base, "peak": hwm_mb(), "alloc": alloc_peak_mb(step)}


def alloc_peak_mb(step):
    """Peak of the bytes torch's CPU allocator holds during one step, over what it held before the
    step with no gradients alive (the profiler's allocation/free events): deterministic, unlike RSS,
    which also counts what glibc keeps or returns to the OS (bimodal on bert-128)."""
    from torch.profiler import ProfilerActivity, profile

    for p in step.model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    mem = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    cur = peak = 0
    for _, b in mem:
        cur += b
        peak = max(peak, cur)
    return peak / 2**20


def timing_run(cfg_name, variants, device, reps, warmup=1):
    steps, notes, times, cpu = {}, {}, {v: [] for v in variants}, {v: [] for v in variants}
    for v in variants:
        try:
            steps[v], notes[v] = make_step(v, cfg_name, device)
            for _ in range(warmup):
                steps[v]()
        except Exception as e:  # a competitor that cannot run this model: report, do not hide
            notes[v] = f"error: {type(e).__name__}: {str(e)[:120]}"
            steps.pop(v, None)
    order = list(steps)
    for r in range(reps):
        # rotate the order each rep, and time each variant's step right after an untimed step of the
        # same variant (steady state, as in a training loop): a step that follows a *different*
        # variant pays that variant's freed memory back in page faults / cold caches (measured
        # +20-30 ms on bert-128 for whichever step follows the non-private one)
        for v in order[r % len(order):] + order[: r % len(order)]:
            if BACK_TO_BACK:
                steps[v]()
            sync(device)
            t, c = time.perf_counter(), time.process_time()
            steps[v]()
            sync(device)
            times[v].append(time.perf_counter() - t)
            cpu[v].append(time.process_time() - c)
    med = lambda x: statistics.median(x) if x else float("nan")  # noqa: E731
    timing_run.raw = {v: list(cpu[v]) for v in variants}  # per-rep CPU times (paired_ratios, the JSON)
    return {v: med(times[v]) for v in variants}, {v: med(cpu[v]) for v in variants}, notes


def paired_ratios(raw, ref="nonprivate"):
    """Median over reps of (variant's CPU time / the reference's in the same rep): each rep runs
    every variant within a few seconds, so a slow spell of this shared machine (another tenant)
    that lasts longer than a rep raises both and cancels, where the ratio of two medians keeps it."""
    base = raw.get(ref) or []
    out = {}
    for v, ts in raw.items():
        pairs = [t / b for t, b in zip(ts, base) if b]
        out[v] = statistics.median(pairs) if pairs and len(ts) == len(base) else float("nan")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gpt2-128,gpt2-32,gpt2-512,bert-128")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", nargs=2, metavar=("VARIANT", "CONFIG"))
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--fused", action="store_true", help="DP variants: noise+scale via pdpsgd.fused")
    ap.add_argument("--compile", action="store_true", help="with --fused: torch.compile the fused function")
    ap.add_argument("--amp", action="store_true", help="bf16 torch.autocast around the model call (all variants)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--noise-rng", default="auto", choices=("auto", "torch", "mkl", "native"),
                    help="pdpsgd variants' CPU noise source (mkl: pip install mkl; native: a C compiler)")
    ap.add_argument("--no-back-to-back", action="store_true",
                    help="time each variant right after the previous variant's step (old behaviour)")
    ap.add_argument("--malloc", default="default", choices=("default", "tuned"),
                    help="tuned: pdpsgd.malloc.tune_cpu_malloc() first (glibc: freed memory kept for the next "
                         "step; the process-wide setting applies to every variant alike)")
    a = ap.parse_args()
    if a.malloc == "tuned":
        from pdpsgd.malloc import tune_cpu_malloc

        print(f"malloc: {tune_cpu_malloc().reason}", file=sys.stderr if a.memory_only else sys.stdout, flush=True)
    global FUSED, COMPILE, BACK_TO_BACK, AMP, NOISE_RNG
    FUSED, COMPILE, BACK_TO_BACK, AMP = a.fused, a.compile, not a.no_back_to_back, a.amp
    NOISE_RNG = a.noise_rng
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if a.memory_only:
        print(json.dumps(memory_run(a.memory_only[0], a.memory_only[1], device)))
        return
    variants = a.variants.split(",")
    results = {}
    for cfg in a.configs.split(","):
        t, tc, notes = timing_run(cfg, variants, device, a.reps)
        # printed before the memory runs, so a time limit hit there still leaves the timings
        print(f"timing {cfg}: " + json.dumps({v: round(t[v] * 1e3, 2) for v in variants}) + " ms", flush=True)
        mem = {}
        if not a.no_memory:
            for v in variants:
                if str(notes.get(v, "")).startswith("error"):
                    continue
                extra = (["--fused"] if a.fused else []) + (["--amp"] if a.amp else [])  # no --compile: same memory
                extra += ["--noise-rng", a.noise_rng, "--malloc", a.malloc]
                r = subprocess.run([sys.executable, __file__, "--memory-only", v, cfg, "--device", a.device] + extra,
                                   capture_output=True, text=True)
                try:
                    mem[v] = json.loads(r.stdout.strip().splitlines()[-1])
                except Exception:
                    mem[v] = {"error": r.stderr[-300:]}
        raw = getattr(timing_run, "raw", {})
        results[cfg] = {"time": t, "cpu_time": tc, "notes": {k: str(v) for k, v in notes.items()}, "mem": mem,
                        "cpu_times": raw, "cpu_paired": paired_ratios(raw)}
        print_table(cfg, results[cfg], variants)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


def print_table(cfg, r, variants):
    fam, L, d, h, V, T, B = CONFIGS[cfg]
    t0 = r["time"].get("nonprivate")
    c0 = r["cpu_time"].get("nonprivate")
    m0 = r["mem"].get("nonprivate", {})
    print(f"\n## {cfg}: {fam} {L} layers, width {d}, vocab {V}, T={T}, B={B}")
    print("| variant | step ms (wall) | wall × non-private | CPU-time × non-private | CPU × np, paired | peak step mem MB "
          "| mem × non-private | allocated peak MB | alloc × non-private | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        t = r["time"].get(v, float("nan"))
        m = r["mem"].get(v, {})
        dm = m.get("peak", float("nan")) - m.get("base", float("nan")) if "peak" in m else float("nan")
        dm0 = m0.get("peak", float("nan")) - m0.get("base", float("nan")) if "peak" in m0 else float("nan")
        tm = m.get("peak", float("nan"))
        tm0 = m0.get("peak", float("nan"))
        c = r["cpu_time"].get(v, float("nan"))
        al, al0 = m.get("alloc", float("nan")), m0.get("alloc", float("nan"))
        pr = r.get("cpu_paired", {}).get(v, float("nan"))
        print(f"| {v} | {t * 1e3:.1f} | {t / t0 if t0 else float('nan'):.2f} | {c / c0 if c0 else float('nan'):.2f} | {pr:.2f} | "
              f"{dm:.0f} (total {tm:.0f}) | "
              f"{dm / dm0 if dm0 == dm0 and dm0 else float('nan'):.2f} (total {tm / tm0 if tm0 == tm0 and tm0 else float('nan'):.2f}) | "
              f"{al:.1f} | {al / al0 if al0 == al0 and al0 else float('nan'):.2f} | "
              f"{r['notes'].get(v, '')} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
