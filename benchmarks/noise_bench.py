"""The CPU noise step alone: ``noise_and_scale`` on GPT-2 T=32's parameter shapes (bench.py's
gpt2 config, 5.5 M coordinates), each noise source interleaved in one process, one thread
unless ``--threads`` (then wall time: CPU time would count the other threads' work as well).

    python benchmarks/noise_bench.py --reps 8            # torch, native, and mkl where installed
    python benchmarks/noise_bench.py --threads 2         # the native kernel splits its work over 2 threads
"""
import argparse
import time

import torch

from pdpsgd import mkl_rng, native_rng
from pdpsgd.fused import noise_and_scale

LAYER = [(256, 768), (768,), (256, 256), (256,), (256, 1024), (1024,), (1024, 256), (256,), (256,), (256,),
         (256,), (256,)]
SHAPES = [(8192, 256), (1024, 256)] + LAYER * 4  # wte, wpe, 4 blocks (GPT-2 4x256, vocab 8192)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.threads == 1 else time.perf_counter
    torch.manual_seed(0)
    sums = {f"p{i}": torch.randn(s) for i, s in enumerate(SHAPES)}
    dtypes = {k: torch.float32 for k in sums}
    rngs = ["torch"] + (["native"] if native_rng.available() else []) + (["mkl"] if mkl_rng.available() else [])
    g = torch.Generator().manual_seed(0)
    times = {r: [] for r in rngs}
    for _ in range(a.reps + 1):  # the first round warms up
        for r in rngs:
            s = {k: v.clone() for k, v in sums.items()}
            t = clock()
            noise_and_scale(s, 1.0, g, 8.0, dtypes, compile=False, consume=True, rng=r)
            times[r].append((clock() - t) * 1e3)
    what = "CPU" if a.threads == 1 else f"{a.threads} threads, wall"
    print(f"{sum(v.numel() for v in sums.values())} coordinates, {len(sums)} tensors; {what} ms per call")
    for r, v in times.items():
        v = sorted(v[1:])
        print(f"  {r:7s} min {v[0]:6.1f}  median {v[len(v) // 2]:6.1f}")


if __name__ == "__main__":
    main()
