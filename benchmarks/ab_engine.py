"""A/B of the DP step between a git revision of ``pdpsgd`` and the working tree, in ONE process.

    python benchmarks/ab_engine.py --rev HEAD --configs bert-128,gpt2-128 --reps 11 --threads 1

The revision's ``pdpsgd`` package is extracted (``git archive``) into a temporary directory and
imported as ``pdpsgd_old``; old, new and non-private steps (Adam, lr 0) run on the same model and
batch. Each timed step follows an untimed step of the same variant (steady state) and both orders
(old first / new first) are run, because a step that follows a different variant pays for the
memory that variant freed. Prints CPU-time medians and ratios to non-private (``--clock wall``:
elapsed time, for ``--threads`` > 1, where CPU time also counts the other threads' spinning).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--configs", default="gpt2-32,gpt2-128,bert-128")
    ap.add_argument("--method", default="bk")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"))
    a = ap.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True,
                          check=True).stdout.strip()
    arch = subprocess.run(["git", "archive", a.rev, "pdpsgd"], cwd=root, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
    os.rename(os.path.join(tmp, "pdpsgd"), os.path.join(tmp, "pdpsgd_old"))
    sys.path.insert(0, tmp)
    import bench
    import pdpsgd
    import pdpsgd_old

    print("| config | order | old ms | new ms | non-private ms | old × np | new × np |")
    print("|---|---|---|---|---|---|---|")
    for cfg in a.configs.split(","):
        fam, model, batch = bench.build(cfg, torch.device("cpu"))
        loss_fn = bench.make_loss(fam)
        B = batch["input_ids"].shape[0]

        def mk(lib):
            params = lib.trainable_params(model)
            opt = torch.optim.Adam(params.values(), lr=0.0)
            dp = lib.make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                                  method=a.method, generator=torch.Generator().manual_seed(0))

            def step():
                out = dp(params, batch)
                for n, p in params.items():
                    p.grad = out.grads[n]
                opt.step()
            return step

        opt_np = torch.optim.Adam(model.parameters(), lr=0.0)

        def np_step():
            opt_np.zero_grad(set_to_none=True)
            loss_fn(model, batch).sum().div(B).backward()
            opt_np.step()

        for order in (("old", "new", "np"), ("new", "old", "np")):
            steps = {"old": mk(pdpsgd_old), "new": mk(pdpsgd), "np": np_step}
            ts = {k: [] for k in steps}
            for _ in range(a.reps):
                for k in order:
                    steps[k]()  # untimed: steady state
                    t = clock()
                    steps[k]()
                    ts[k].append(clock() - t)
            m = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
            print(f"| {cfg} | {'/'.join(order)} | {m['old']:.1f} | {m['new']:.1f} | {m['np']:.1f} | "
                  f"{m['old'] / m['np']:.2f} | {m['new'] / m['np']:.2f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
