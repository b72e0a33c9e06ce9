"""What the checks around every DP step cost on the benchmark models (not the step itself).

    python benchmarks/guard_cost.py                    # gpt2-32, bert-128
    python benchmarks/guard_cost.py --configs gpt2-128 --reps 500

Per call, in ms (median of ``--reps`` calls after one warm-up step): ``model_structure`` (the
walk that tells whether the model's modules changed since the step's memos were found), and
entering + leaving ``no_writes_to`` and ``no_rope_mixing`` (the write check and the rotary-table
check, without a forward). Also whether two steps leave the structure unchanged (no memo dropped).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

from pdpsgd.functional import model_structure, no_rope_mixing, no_writes_to  # noqa: E402


def per_call_ms(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="gpt2-32,bert-128")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for cfg in args.configs.split(","):
        step, _ = bench.make_step("bk", cfg, torch.device("cpu"))
        m = step.model
        step()
        before = model_structure(m)[0]
        step()
        same = before == model_structure(m)[0]
        trained = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}

        def writes():
            with no_writes_to(m, trained):
                pass

        def rope():
            with no_rope_mixing(m, seen={}):
                pass

        print(f"{cfg}: {sum(1 for _ in m.modules())} modules; structure unchanged by a step: {same}; "
              f"model_structure {per_call_ms(lambda: model_structure(m), args.reps):.3f} ms, "
              f"no_writes_to {per_call_ms(writes, args.reps):.3f} ms, "
              f"no_rope_mixing {per_call_ms(rope, args.reps):.3f} ms per call")


if __name__ == "__main__":
    main()
