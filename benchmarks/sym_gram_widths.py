"""The block self-Gram (``bookkeeping._SymGram``) against one full bmm, by width and halvings.

    python benchmarks/sym_gram_widths.py 256 32768,8192,4096 7     # T, widths, reps

One thread, B = 8, float32, glibc tuned (``pdpsgd.malloc``); prints the median time of each form
and its ratio to the full Gram, interleaved rep by rep. Round 20 used it to set
``SYM_WIDE_MIN_T`` / ``SYM_WIDE_BLOCK_MIN`` (see benchmarks/README.md).
"""
import sys
import time

import torch

from pdpsgd.bookkeeping import _SymGram
from pdpsgd.malloc import tune_cpu_malloc


def main():
    tune_cpu_malloc()
    torch.set_num_threads(1)
    B, T = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 128
    widths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "8192,4096,2048").split(",")]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    for P in widths:
        X = torch.randn(B, T, P)
        forms = {"full": lambda: torch.bmm(X, X.transpose(1, 2))}
        for lv in (1, 2, 3):
            if (T >> lv) >= 16 and T % (1 << lv) == 0:
                forms[f"sym{lv} (blocks of {T >> lv})"] = (lambda lv=lv: _SymGram(X, lv))
        ts = {k: [] for k in forms}
        for _ in range(reps):
            for k, f in forms.items():
                t = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}
        print(f"T={T} P={P}: " + ", ".join(f"{k} {v:.1f} ms ({v / med['full']:.2f})" for k, v in med.items()))


if __name__ == "__main__":
    main()
