"""Can the step's noise be drawn while the model runs? The noise does not depend on the data, so a
background thread could draw it during the forward and backward, on whatever a core leaves idle.

    python benchmarks/noise_overlap.py --configs gpt2-32 --reps 20

Per rep, interleaved, wall ms (medians): the non-private step alone; the noise alone (the native
kernel on the step's threads, into a buffer of all parameters); the step then the noise (what a
DP step does); the step with the noise drawn by a background thread on one core at normal
priority; and the same thread at SCHED_IDLE (Linux: it runs only where no other thread wants the
core). Round 42 (GPT-2 T = 32, 2 threads, quiet host): step 96.5, noise 6.4, in turn 104.0,
background 113.9, SCHED_IDLE 108.6 — both overlaps slower than drawing after the step: torch's
OpenMP workers spin between the step's ops, so the idle core time the forward seems to leave is not
idle, and the third thread slows the matrix products.
"""
import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

from pdpsgd.native_rng import NativeStream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gpt2-32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for cfg in a.configs.split(","):
        step, _ = bench.make_step("nonprivate", cfg, "cpu")
        buf = torch.empty(sum(p.numel() for p in step.model.parameters()))
        stream = NativeStream(torch.Generator().manual_seed(0))

        def noise(threads: int) -> None:
            stream.add_many([buf], 1.0, 0.0, chunk=1 << 16, threads=threads)

        def idle_noise() -> None:
            if hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # (this thread only, on Linux)
            noise(1)

        def overlapped(target) -> None:
            th = threading.Thread(target=target)
            th.start()
            step()
            th.join()

        runs = {"step": step, "noise": lambda: noise(a.threads), "step, then noise": lambda: (step(), noise(a.threads)),
                "noise in a thread": lambda: overlapped(lambda: noise(1)), "noise at SCHED_IDLE": lambda: overlapped(idle_noise)}
        for f in runs.values():
            f()
        times = {k: [] for k in runs}
        for _ in range(a.reps):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        print(f"{cfg}: {buf.numel():,} noise coordinates, {a.threads} threads, wall ms (median of {a.reps})")
        for k, v in times.items():
            print(f"  {k:22s} {1e3 * statistics.median(v):8.2f}")


if __name__ == "__main__":
    main()
