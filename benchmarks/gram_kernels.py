"""Self-Gram kernels at bench.py's shapes (B = 8), one thread: torch's bmm against per-example mm,
einsum and matmul, and the ghost norm ⟨L Lᵀ, R Rᵀ⟩ from full Grams against the lower block
triangle only (2 or 4 row blocks: ¾ or ⅝ of the products), and the engine's own block Grams
(``bookkeeping._SymGram``: one bmm per halving level over strided views, 1–3 halvings) against the
full bmm at T = 64–512 (round 14).

    python benchmarks/gram_kernels.py
"""
import time

import torch

from pdpsgd.bookkeeping import _SymGram


def median_ms(f, n=25):
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t = time.process_time()
        f()
        ts.append(time.process_time() - t)
    return sorted(ts)[n // 2] * 1e3


def ghost_blocks(L, R, k):
    """Σ_{t,s} (L Lᵀ)[t,s] (R Rᵀ)[t,s] (B,) from the k(k+1)/2 blocks of the lower triangle."""
    h = L.shape[1] // k
    Ls = [L[:, i * h:(i + 1) * h] for i in range(k)]
    Rs = [R[:, i * h:(i + 1) * h] for i in range(k)]
    out = 0
    for i in range(k):
        for j in range(i + 1):
            a = torch.bmm(Ls[i], Ls[j].transpose(1, 2))
            b = torch.bmm(Rs[i], Rs[j].transpose(1, 2))
            out = out + (a * b).sum((1, 2)) * (1 if i == j else 2)
    return out


def main():
    torch.set_num_threads(1)
    print("self-Gram X Xᵀ, X (8, T, k): ms and G multiply-adds/s")
    for T, k in ((32, 256), (32, 8192), (128, 256), (128, 1024), (128, 8192)):
        X = torch.randn(8, T, k)
        macs = 8 * T * T * k
        row = {
            "bmm": median_ms(lambda: torch.bmm(X, X.transpose(1, 2))),
            "per-example mm": median_ms(lambda: [X[i] @ X[i].T for i in range(8)]),
            "einsum": median_ms(lambda: torch.einsum("btk,bsk->bts", X, X)),
            "matmul": median_ms(lambda: torch.matmul(X, X.transpose(1, 2))),
        }
        print(f"  T={T:4d} k={k:5d}  " + "  ".join(f"{n} {ms:.2f} ({macs / ms / 1e6:.0f})" for n, ms in row.items()))
    print("ghost norm of one layer, L (8, 128, d), R (8, 128, p): ms")
    for d, p in ((256, 256), (256, 1024), (1024, 256)):
        L, R = torch.randn(8, 128, d), torch.randn(8, 128, p)
        ref = ghost_blocks(L.double(), R.double(), 1)
        for k in (2, 4):
            assert torch.allclose(ghost_blocks(L, R, k).double(), ref, rtol=1e-3)
        print(f"  d={d:5d} p={p:5d}  " + "  ".join(f"{k} block(s) {median_ms(lambda: ghost_blocks(L, R, k)):.2f}"
                                             for k in (1, 2, 4)))
    print("engine block self-Grams (_SymGram, one bmm per halving level) / full bmm, X (8, T, k): time ratio")
    for T, k in ((64, 256), (64, 8192), (128, 256), (128, 768), (128, 1024), (128, 8192), (256, 256), (512, 256),
                 (512, 1024)):
        X = torch.randn(8, T, k)
        full = min(median_ms(lambda: torch.bmm(X, X.transpose(1, 2))) for _ in range(2))
        lv = [lv for lv in (1, 2, 3) if (T >> lv) >= 16]
        print(f"  T={T:4d} k={k:5d}  bmm {full:.2f} ms  " + "  ".join(
            f"{lv} halving(s) {min(median_ms(lambda: _SymGram(X, lv)) for _ in range(2)) / full:.2f}" for lv in lv))


if __name__ == "__main__":
    main()
