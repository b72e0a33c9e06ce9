"""Where a `bk` step's time goes on a GPU: phase times, host syncs per step, top kernels.

    python benchmarks/gpu_profile.py --config gpt2small-256 --out /tmp/prof     # on a CUDA machine
    python benchmarks/gpu_profile.py --config tiny --device cpu                  # dry run

1. Interleaved step times (median of --reps) of non-private, bk, and bk with the per-layer
   active-row compaction forced on (``bookkeeping.ACTIVE_ROWS_DEVICES``; off on CUDA by default).
2. Host syncs in one bk step (``torch.cuda.set_sync_debug_mode``), by source line.
3. torch.profiler over --prof-steps bk steps, with the engine's phases as labelled ranges
   (capture, ghost norms, clipped sums, noise + scale, optimizer): totals and the top kernels.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

import pdpsgd.bookkeeping as bk  # noqa: E402
import pdpsgd.step as stp  # noqa: E402

PHASES = {(bk, "_collect"): "pdpsgd:capture", (bk, "_routes"): "pdpsgd:plan", (bk, "_inner"): "pdpsgd:ghost_norms",
          (bk, "_sq_norm"): "pdpsgd:explicit_norms", (bk, "_materialise"): "pdpsgd:materialise",
          (bk, "_weighted_use_sum"): "pdpsgd:clipped_sums", (stp, "noise_and_scale"): "pdpsgd:noise_scale",
          (bk, "_stack_small"): "pdpsgd:stacked_norms", (bk, "_stacked_sums"): "pdpsgd:stacked_sums"}


def _label(mod, name, label):
    f = getattr(mod, name)

    def g(*a, **k):
        with torch.profiler.record_function(label):
            return f(*a, **k)

    setattr(mod, name, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="gpt2small-256")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prof-steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for the full profiler tables")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    steps = {v: bench.make_step(v, a.config, dev)[0] for v in ("nonprivate", "bk")}

    def with_rows():
        old = bk.ACTIVE_ROWS_DEVICES
        bk.ACTIVE_ROWS_DEVICES = ("cpu", "cuda")
        try:
            steps["bk"]()
        finally:
            bk.ACTIVE_ROWS_DEVICES = old

    steps["bk_active_rows"] = with_rows
    for s in steps.values():
        for _ in range(2):
            s()
    times = collections.defaultdict(list)
    order = list(steps)
    for r in range(a.reps):
        for v in order[r % 3:] + order[:r % 3]:
            steps[v]()
            sync()
            t = time.perf_counter()
            steps[v]()
            sync()
            times[v].append(time.perf_counter() - t)
    t0 = statistics.median(times["nonprivate"])
    print(f"== {a.config} on {dev}: step times (median of {a.reps}, interleaved)")
    for v, ts in times.items():
        print(f"  {v:16s} {statistics.median(ts) * 1e3:8.1f} ms  {statistics.median(ts) / t0:5.2f}x")

    if dev.type == "cuda":
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            steps["bk"]()
            torch.cuda.set_sync_debug_mode(0)
        where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in rec
                                    if "synchroniz" in str(w.message))
        print(f"== host syncs in one bk step: {sum(where.values())}")
        for loc, n in where.most_common(12):
            print(f"  {n:5d}  {loc}")

    for (mod, name), label in PHASES.items():
        _label(mod, name, label)
    opt_step = torch.optim.Adam.step

    def labelled_step(self, *args, **kw):
        with torch.profiler.record_function("pdpsgd:optimizer"):
            return opt_step(self, *args, **kw)

    torch.optim.Adam.step = labelled_step
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for v in ("nonprivate", "bk"):
        steps[v]()
        sync()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(a.prof_steps):
                steps[v]()
            sync()
        ka = prof.key_averages()
        dkey = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
        tkey = dkey.replace("self_", "")
        n = a.prof_steps
        print(f"== {v}: labelled phases, per step (CPU ms incl. children | device ms incl. children)")
        for e in sorted(ka, key=lambda e: e.key):
            if e.key.startswith("pdpsgd:"):
                print(f"  {e.key:24s} {e.cpu_time_total / 1e3 / n:8.2f} | {getattr(e, tkey, 0) / 1e3 / n:8.2f}   "
                      f"calls/step {e.count / n:.0f}")
        # GPU busy time: kernels and copies only (operator rows and labelled ranges carry device
        # time too, which would count it twice); against the step's wall time this says whether the
        # step is bound by the GPU or by the host issuing it
        busy = sum(e.duration_time_total if hasattr(e, "duration_time_total") else e.time_range.elapsed_us()
                   for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
                   and not e.name.startswith(("pdpsgd:", "Optimizer."))) / 1e3 / n
        wall = statistics.median(times[v]) * 1e3
        print(f"  GPU busy {busy:.1f} ms per step (kernels and copies) of a {wall:.1f} ms step (wall, unprofiled): "
              f"{'host-bound' if busy < 0.8 * wall else 'GPU-bound'}")
        print(f"== {v}: top ops by self device time (ms/step, calls/step)")
        for e in sorted(ka, key=lambda e: -getattr(e, dkey, 0))[:15]:
            if getattr(e, dkey, 0) <= 0:
                break
            print(f"  {getattr(e, dkey) / 1e3 / n:8.2f}  {e.count / n:6.0f}  {e.key[:90]}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"profile_{v}.txt"), "w") as f:
                f.write(ka.table(sort_by=dkey if dev.type == "cuda" else "self_cpu_time_total", row_limit=60))
                f.write("\n\n")
                f.write(ka.table(sort_by="self_cpu_time_total", row_limit=60))
    torch.optim.Adam.step = opt_step


if __name__ == "__main__":
    main()
