"""BiLSTM text classifier (frozen GloVe-sized embedding, B=32, T=32, hidden 64): one full training
step (loss, gradients, Adam) per variant, interleaved in one process, medians of CPU time.

    python benchmarks/bench_lstm.py [--reps 9] [--threads 1] [--T 32] [--hidden 64] [--packed] [--cell gru]

variants: nonprivate; naive (per-example loop over torch's fused LSTM, clip, sum, noise);
pdpsgd vmap (pure-PyTorch LSTM under torch.func.vmap); pdpsgd bk / auto (the LSTM rule,
pdpsgd/rules/rnn.py); Opacus hooks with its DPLSTM (Opacus cannot hook nn.LSTM; DPLSTM is its
drop-in replacement, when opacus is installed). ``--cell gru``: the same with nn.GRU (Opacus: DPGRU).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import pdpsgd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import (interleaved, opacus_hooks_step, padded_ids, pdpsgd_step, print_table,  # noqa: E402
                        without_missing_opacus)


class BiLSTM(nn.Module):
    def __init__(self, hidden, packed, lstm_cls=nn.LSTM):
        super().__init__()
        self.packed = packed
        self.emb = nn.Embedding(2000, 50, padding_idx=0)
        self.emb.weight.requires_grad_(False)
        self.rnn = lstm_cls(50, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 3)

    def forward(self, ids):
        x = self.emb(ids)
        m = (ids != 0).unsqueeze(-1).to(x.dtype)
        if self.packed:
            lengths = (ids != 0).sum(1).clamp_min(1).cpu()
            h, _ = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            h, _ = pad_packed_sequence(h, batch_first=True, total_length=ids.shape[1])
        else:
            h, _ = self.rnn(x)
        return self.out((h * m).sum(1) / m.sum(1).clamp_min(1))


def loss_fn(model, b):
    return F.cross_entropy(model(b["input_ids"]), b["labels"], reduction="none")


def make(variant, a, batch):
    torch.manual_seed(0)
    B = batch["input_ids"].shape[0]
    if variant == "opacus":
        from opacus.layers import DPGRU, DPLSTM

        return opacus_hooks_step(BiLSTM(a.hidden, a.packed, DPGRU if a.cell == "gru" else DPLSTM), loss_fn, batch, B,
                                 lr=1e-3)
    model = BiLSTM(a.hidden, a.packed, nn.GRU if a.cell == "gru" else nn.LSTM)
    params = pdpsgd.trainable_params(model)
    opt = torch.optim.Adam(params.values(), lr=1e-3)
    if variant == "nonprivate":
        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).mean().backward()
            opt.step()
        return step
    if variant == "naive":
        gen = torch.Generator().manual_seed(0)

        def step():
            acc = {n: torch.zeros_like(p) for n, p in params.items()}
            for i in range(B):
                g = torch.autograd.grad(loss_fn(model, {k: v[i:i + 1] for k, v in batch.items()}).sum(),
                                        list(params.values()))
                c = min(1.0, 1.0 / (float(torch.sqrt(sum((x * x).sum() for x in g))) + 1e-12))
                for (n, _), x in zip(params.items(), g):
                    acc[n].add_(x, alpha=c)
            for n, p in params.items():
                p.grad = (acc[n] + torch.randn(p.shape, generator=gen)) / B
            opt.step()
        return step
    dp = pdpsgd.make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                             method=variant, generator=torch.Generator().manual_seed(0))
    return pdpsgd_step(dp, params, opt, batch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--T", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--packed", action="store_true", help="pack_padded_sequence with random lengths")
    ap.add_argument("--variants", default="nonprivate,naive,vmap,bk,auto,opacus")
    ap.add_argument("--cell", default="lstm", choices=["lstm", "gru"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": padded_ids(a.B, a.T, 2000, g), "labels": torch.randint(0, 3, (a.B,), generator=g)}
    variants = without_missing_opacus(a.variants.split(","))
    if a.packed and "vmap" in variants:
        variants.remove("vmap")  # packed sequences cannot run per example under vmap
    steps = {v: make(v, a, batch) for v in variants}
    times = interleaved(steps, variants, a.reps)
    print_table(f"Bi{a.cell.upper()} B={a.B} T={a.T} hidden={a.hidden} packed={a.packed} threads={a.threads}, CPU time, "
                f"median of {a.reps}", times)


if __name__ == "__main__":
    main()
