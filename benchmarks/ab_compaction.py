"""Ghost norms over each example's non-zero rows (``bookkeeping._compaction``) on vs off, one process.

    python benchmarks/ab_compaction.py --configs bert-128,gpt2-128 --reps 6
    python benchmarks/ab_compaction.py --configs bert-128 --lengths 8,48   # heavier padding

Times the bk step, the ghost norms (``_inner``) and the check itself (``_compaction``) in CPU time,
alternating on/off step by step (off: ``COMPACT_MIN_T`` above every T), one thread, medians.
``--lengths LO,HI``: BERT examples' lengths drawn from [LO, HI] instead of bench.py's [T/2, T].
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from phases import ACC, _wrap  # noqa: E402  (CPU-time counters around a module's function)

import pdpsgd.bookkeeping as bk  # noqa: E402

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="bert-128,gpt2-128")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--lengths", default=None, help="LO,HI: padded lengths of the BERT examples")
    a = ap.parse_args()
    torch.set_num_threads(1)
    _wrap(bk, "_inner")
    _wrap(bk, "_compaction")
    if a.lengths:
        lo, hi = map(int, a.lengths.split(","))
        build = bench.build

        def padded(*args, **kw):
            fam, model, batch = build(*args, **kw)
            B, T = batch["input_ids"].shape
            n = torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(3))
            batch["attention_mask"] = (torch.arange(T)[None] < n[:, None]).long().to(batch["input_ids"].device)
            return fam, model, batch

        bench.build = padded
    on_t = bk.COMPACT_MIN_T
    print("| config | compaction | step ms | ghost norms ms | check ms |\n|---|---|---|---|---|")
    for cfg in a.configs.split(","):
        step = bench.make_step("bk", cfg, torch.device("cpu"))[0]
        for _ in range(2):
            step()
        res = {True: [], False: []}
        for _ in range(a.reps):
            for on in (True, False):
                bk.COMPACT_MIN_T = on_t if on else 1 << 30
                ACC.clear()
                t = time.process_time()
                step()
                res[on].append(((time.process_time() - t) * 1e3, ACC["_inner"] * 1e3, ACC["_compaction"] * 1e3))
        bk.COMPACT_MIN_T = on_t
        for on in (True, False):
            med = [statistics.median(x[i] for x in res[on]) for i in range(3)]
            print(f"| {cfg}{' ' + a.lengths if a.lengths else ''} | {'on' if on else 'off'} | {med[0]:.1f} | "
                  f"{med[1]:.1f} | {med[2]:.2f} |")


if __name__ == "__main__":
    main()
