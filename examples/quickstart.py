"""Quickstart: a custom DP-SGD loop on a tiny model, in seconds.

    python examples/quickstart.py [--steps 20] [--epsilon 3]

Poisson sampling -> fixed-shape physical batches -> dp_step (clipped sum per physical batch,
noise once) -> optimizer -> accountant.step (before the update) -> print loss, clip fraction, ε.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import pdpsgd
from pdpsgd.accounting import PRVAccountant, calibrate_noise
from pdpsgd.sampling import PoissonSampler, collate, to_physical_batches


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=None,
                    help="reproducible sampling and noise, for experiments only: anyone who knows the seed "
                         "can recompute the noise (default: fresh OS entropy)")
    args = ap.parse_args(argv)

    def generator(stream):  # sampling (0) and noise (1): seeded apart, or keyed from OS entropy
        if args.seed is None:  # (all of the state: Generator.seed() would keep 32 bits of entropy)
            return pdpsgd.noise.entropy_generator()
        return torch.Generator().manual_seed(2 * args.seed + stream)

    torch.manual_seed(0)  # the synthetic data and the initial weights (public)
    N, d, classes = 512, 10, 3
    w_true = torch.randn(d, classes)
    X = torch.randn(N, d)
    data = {"x": X, "y": (X @ w_true).argmax(1)}  # a synthetic "private" dataset

    model = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, classes))

    def loss_fn(model, batch):  # one loss per example
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")

    batch_size, delta, C = 64, 1e-5, 1.0
    q = batch_size / N
    sigma = calibrate_noise(target_epsilon=args.epsilon, delta=delta, sample_rate=q, steps=args.steps)
    sampler = PoissonSampler(N, q, args.steps, generator=generator(0))
    dp_step = pdpsgd.make_dp_step(model, loss_fn, max_grad_norm=C, noise_multiplier=sigma,
                                  expected_batch_size=q * N, generator=generator(1))  # noise
    params = pdpsgd.trainable_params(model)
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    acct = PRVAccountant()
    print(f"σ={sigma:.3f} for ε={args.epsilon} at δ={delta}, q={q:.3f}, {args.steps} steps")

    for step, idx in enumerate(sampler, 1):  # Poisson sampling: a random-size logical batch
        part = None
        for pb in to_physical_batches(idx, 32):  # fixed shape: 32 slots, padding masked out
            batch, mask = collate(data, pb)
            p = dp_step.clipped_sum(params, batch, mask)
            part = p if part is None else part + p
        out = dp_step.finalize(part, params=params)  # noise added once per logical step
        acct.step(noise_multiplier=sigma, sample_rate=q)  # ledger before the update is released
        for n, p in params.items():
            p.grad = out.grads[n]
        opt.step()
        opt.zero_grad()
        eps = acct.epsilon(delta=delta)
        # (loss and clip fraction are computed from the private batch without noise: for you, not for release)
        print(f"step {step:3d}  loss {float(out.loss):.4f}  clip fraction {float(out.clip_fraction):.2f}  "
              f"ε ≤ {eps.upper:.3f}")

    with torch.no_grad():
        acc = (model(data["x"]).argmax(1) == data["y"]).float().mean()  # on the private data: not private
    eps = acct.epsilon(delta=delta)
    print(f"final ε ≤ {eps.upper:.3f} (estimate {eps.estimate:.3f}) at δ = {delta}; train accuracy {float(acc):.3f}")
    return eps


if __name__ == "__main__":
    main()
