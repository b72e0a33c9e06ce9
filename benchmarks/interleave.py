"""The timing loop the small benchmarks share: variants stepped interleaved in one process, each
timed step right after an untimed one of the same variant, the order rotating per rep; medians of
CPU time, ratios against the non-private step of the same run."""
import statistics
import time
from typing import Callable, Dict, List

import torch


def padded_ids(B: int, T: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T) token ids in [1, vocab), each row padded with 0 after a random length in [T/2, T]."""
    ids = torch.randint(1, vocab, (B, T), generator=gen)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    ids[torch.arange(T)[None] >= lengths[:, None]] = 0
    return ids


def without_missing_opacus(variants: List[str]) -> List[str]:
    if "opacus" in variants:
        try:
            import opacus  # noqa: F401
        except ImportError:
            return [v for v in variants if v != "opacus"]
    return variants


def interleaved(steps: Dict[str, Callable[[], None]], variants: List[str], reps: int) -> Dict[str, List[float]]:
    """CPU seconds per timed step of each variant; a variant whose warm-up step fails is reported and left out."""
    for v in list(variants):
        try:
            steps[v]()
        except Exception as err:
            print(f"{v}: failed: {type(err).__name__}: {str(err)[:120]}")
            variants.remove(v)
    times: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(reps):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            steps[v]()  # untimed step of the same variant first (steady state)
            t = time.process_time()
            steps[v]()
            times[v].append(time.process_time() - t)
    return times


def print_table(title: str, times: Dict[str, List[float]]) -> None:
    base = statistics.median(times["nonprivate"])
    print(title)
    print("| variant | step ms | × non-private |")
    print("|---|---|---|")
    for v, ts in times.items():
        m = statistics.median(ts)
        print(f"| {v} | {m * 1000:.1f} | {m / base:.2f} |")


def opacus_hooks_step(model: torch.nn.Module, loss_fn, batch, B: int, lr: float) -> Callable[[], None]:
    """One Opacus 1.6 training step (GradSampleModule hooks + DPOptimizer over Adam, σ = 1, C = 1)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, loss_reduction="sum")
    opt = DPOptimizer(torch.optim.Adam([p for p in gsm.parameters() if p.requires_grad], lr=lr),
                      noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B, loss_reduction="sum")

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(gsm, batch).sum().backward()
        opt.step()
    return step


def pdpsgd_step(dp, params: Dict[str, torch.Tensor], opt: torch.optim.Optimizer, batch) -> Callable[[], None]:
    """One pdpsgd training step: the DP step's gradients into the optimizer, dropped after it (as the
    non-private loops' ``zero_grad(set_to_none=True)``)."""
    def step():
        out = dp(params, batch)
        for n, p in params.items():
            p.grad = out.grads[n]
        opt.step()
        for p in params.values():
            p.grad = None
    return step
