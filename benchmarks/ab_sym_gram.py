"""A/B of the symmetric block self-Grams (``bookkeeping._SymGram``) inside the `bk` step, one process.

    python benchmarks/ab_sym_gram.py --configs bert-128,gpt2-128 --reps 8

The same `bk` step (bench.py's models and batches, one thread, glibc tuned as ``--malloc tuned``)
alternates between the block Grams (``SYM_MIN_T`` = 128, the default) and the full ones
(``SYM_MIN_T`` out of reach), the order swapped every rep, each timed step right after an untimed
one of the same setting. Prints the medians of the step's CPU time and of the ghost-norm phase
(``bookkeeping._inner``, wrapped with a CPU-time counter).
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

import pdpsgd.bookkeeping as bk  # noqa: E402
from pdpsgd.malloc import tune_cpu_malloc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bert-128,gpt2-128")
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    print("malloc:", tune_cpu_malloc().reason)
    torch.set_num_threads(1)
    spent = [0.0]
    inner = bk._inner

    def timed_inner(*args, **kw):
        t = time.process_time()
        try:
            return inner(*args, **kw)
        finally:
            spent[0] += time.process_time() - t

    bk._inner = timed_inner
    on = bk.SYM_MIN_T
    for cfg in a.configs.split(","):
        step = bench.make_step("bk", cfg, torch.device("cpu"))[0]
        for _ in range(2):
            step()
        res = {"blocks": ([], []), "full": ([], [])}
        for rep in range(a.reps):
            for mode in (("blocks", "full") if rep % 2 == 0 else ("full", "blocks")):
                bk.SYM_MIN_T = on if mode == "blocks" else 1 << 62
                step()  # untimed: steady state for this setting
                spent[0] = 0.0
                t = time.process_time()
                step()
                res[mode][0].append((time.process_time() - t) * 1e3)
                res[mode][1].append(spent[0] * 1e3)
        bk.SYM_MIN_T = on
        for mode, (st, gn) in res.items():
            print(f"{cfg} {mode:6s} step {statistics.median(st):7.1f} ms   ghost norms {statistics.median(gn):6.1f} ms "
                  f"(min {min(gn):.1f})")


if __name__ == "__main__":
    main()
