"""The clipped sum's matmul Lᵀ R (P0, B·T) x (B·T, P1) as one matmul against row blocks of the
output (``bookkeeping._tmm``), interleaved in one process, one thread, caches flushed between calls.

    python benchmarks/wide_sums.py            # GPT-2-shaped layers at B·T = 256, 1024, 4096

Prints CPU-time medians (ms) per shape for one matmul ("one") and blocks of 256, 512 and 1024 rows,
and the best block's time over one matmul's.
"""
import time

import torch


def run(N, P0, P1, reps, junk):
    L, R = torch.randn(N, P0), torch.randn(N, P1)

    def blocks(b):
        def f():
            out = torch.empty(P0, P1)
            for i in range(0, P0, b):
                torch.mm(L[:, i:i + b].t(), R, out=out[i:i + b])  # (b, N) x (N, P1)
            return out
        return f

    fs = {"one": lambda: torch.mm(L.t(), R), "256": blocks(256), "512": blocks(512), "1024": blocks(1024)}
    ts = {k: [] for k in fs}
    for f in fs.values():
        f()
    for _ in range(reps):
        for k, f in fs.items():
            junk.mul_(1.0001)  # evict the caches (the engine's factors are cold by the time of the sums)
            t = time.process_time()
            f()
            ts[k].append(time.process_time() - t)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}
    best = min(v for k, v in med.items() if k != "one")
    print(f"B·T={N:5d} P0={P0:5d} P1={P1:5d}  " + "  ".join(f"{k} {v:7.2f}" for k, v in med.items())
          + f"  best block / one {best / med['one']:.2f}", flush=True)


def main():
    torch.set_num_threads(1)
    junk = torch.randn(8 << 20)
    for N in (256, 1024, 4096):
        for P0, P1 in ((8192, 256), (1024, 256), (256, 1024), (256, 768), (256, 256), (768, 256)):
            run(N, P0, P1, 11 if N < 4096 else 5, junk)


if __name__ == "__main__":
    main()
