"""Where a `bk` step's time goes: CPU time of the engine's phases against the non-private step.

    python benchmarks/phases.py --configs gpt2-32,gpt2-128,bert-128 --steps 5

Wraps (for this process only) `bookkeeping._collect` (forward + activations-only backward),
`_weighted_use_sum` (clipped sums from the factors), `_inner` (ghost norms) and the step's
`noise_and_scale` with CPU-time counters (none of them calls another), runs `--steps` steps of each variant (models and batches of
`bench.py`, one thread unless `--threads`) and prints the mean per step.
"""
import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

import pdpsgd.bookkeeping as bk  # noqa: E402
import pdpsgd.step as stp  # noqa: E402

ACC = collections.defaultdict(float)
CLOCK = [time.process_time]  # --clock wall: time.perf_counter (with several threads, CPU time counts their spinning)
PHASES = {"_collect": "capture (forward + activations-only backward)", "_weighted_use_sum": "clipped sums",
          "_inner": "ghost norms", "noise_and_scale": "noise + scale"}


def _wrap(mod, name):
    f = getattr(mod, name)

    def g(*a, **k):
        t = CLOCK[0]()
        try:
            return f(*a, **k)
        finally:
            ACC[name] += CLOCK[0]() - t

    setattr(mod, name, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gpt2-32,gpt2-128,bert-128")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variant", default="bk", choices=("bk", "auto", "bk:native", "auto:native", "bk:torch", "auto:torch"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                    help="cpu: process CPU time (default); wall: elapsed time (use with --threads > 1)")
    ap.add_argument("--malloc", default="default", choices=("default", "tuned"),
                    help="tuned: pdpsgd.malloc.tune_cpu_malloc() first, as bench.py --malloc tuned")
    a = ap.parse_args()
    if a.malloc == "tuned":
        from pdpsgd.malloc import tune_cpu_malloc
        print(f"malloc: {tune_cpu_malloc().reason}")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.clock == "wall":
        CLOCK[0] = time.perf_counter
    for n in ("_collect", "_weighted_use_sum", "_inner"):
        _wrap(bk, n)
    _wrap(stp, "noise_and_scale")
    for cfg in a.configs.split(","):
        steps = {v: bench.make_step(v, cfg, torch.device("cpu"))[0] for v in ("nonprivate", a.variant)}
        for _ in range(2):
            for s in steps.values():
                s()
        ACC.clear()
        tot = {}
        for v, s in steps.items():
            t = CLOCK[0]()
            for _ in range(a.steps):
                s()
            tot[v] = (CLOCK[0]() - t) / a.steps * 1e3
        v = a.variant
        print(f"\n{cfg}: non-private {tot['nonprivate']:.0f} ms, {v} {tot[v]:.0f} ms "
              f"({tot[v] / tot['nonprivate']:.2f}x); {v} phases, ms per step:")
        named = 0.0
        for n, label in PHASES.items():
            ms = ACC[n] / a.steps * 1e3
            named += ms
            print(f"  {label:48s} {ms:7.1f}")
        print(f"  {'rest (Adam, explicit norms and sums, clip factors)':48s} {tot[v] - named:7.1f}")


if __name__ == "__main__":
    main()
