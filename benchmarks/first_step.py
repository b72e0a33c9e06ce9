"""CPU time of the first bk step of a batch shape (it runs the memoised checks: batch-dimension
probe, example order, broadcast positions) against the later steps of the same shape.

    python benchmarks/first_step.py --configs gpt2-128,bert-128,opt-128
    python benchmarks/first_step.py --configs gpt2-32 --batch 64   # another batch size (past 32: the grid passes)
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gpt2-128,bert-128,opt-128")
    ap.add_argument("--method", default="bk", choices=("bk", "auto"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=None, help="batch size instead of the config's")
    a = ap.parse_args()
    if a.batch is not None:
        for k, v in bench.CONFIGS.items():
            bench.CONFIGS[k] = v[:-1] + (a.batch,)
    torch.set_num_threads(1)
    for cfg in a.configs.split(","):
        step = bench.make_step(a.method, cfg, torch.device("cpu"))[0]
        ts = []
        for _ in range(a.steps):
            t = time.process_time()
            step()
            ts.append(time.process_time() - t)
        later = min(ts[1:])
        print(f"{cfg}: first step {ts[0] * 1e3:.0f} ms, later {later * 1e3:.0f} ms (×{ts[0] / later:.1f})")


if __name__ == "__main__":
    main()
