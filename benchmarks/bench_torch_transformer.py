"""torch's own nn.TransformerEncoder text classifier (batch first, padding mask; 4 layers, width
256, 4 heads, feed-forward 1024, vocab 8192, T = 128, B = 8, as the issue's BERT-shaped config):
one full training step (loss, gradients, Adam) per variant, interleaved in one process, medians
of CPU time.

    python benchmarks/bench_torch_transformer.py [--reps 7] [--threads 1] [--T 128] [--B 8] [--positions flat]
                                                 [--time-major]

--positions: "batched" (default) looks positions up as (1, T) ids, ``arange(T)[None]``, as Hugging
Face models do; "flat" as (T,) ids, ``arange(T)``, as nanoGPT does (a (T, d) output broadcast by the
add; on the embedding rule since round 24, by the exact fallback before). --time-major: torch's
default layout, batch_first=False: the encoder on (T, B, d), ids and positions (T, B) (its Linear,
LayerNorm and Embedding layers read with the batch in dim 1 since round 24; the exact fallback
before).

variants: nonprivate; bk / auto (nn.MultiheadAttention on its rule, pdpsgd/rules/multihead_attention.py);
bk_no_mha_rule (the registry without that rule: attention's parameters by the exact vmap fallback,
as before round 23); opacus (hooks; Opacus replaces nn.MultiheadAttention by its DPMultiheadAttention,
when opacus is installed: with opacus 1.6 and torch 2.13 its forward fails on the float padding mask
that nn.TransformerEncoderLayer hands it, "masked_fill_ only supports boolean masks", and the
variant is reported as failed).
"""
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import pdpsgd
from pdpsgd.rules import default_registry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from interleave import (interleaved, opacus_hooks_step, padded_ids, pdpsgd_step, print_table,  # noqa: E402
                        without_missing_opacus)


class Encoder(nn.Module):
    def __init__(self, V=8192, d=256, layers=4, heads=4, ff=1024, T=128, positions="batched", time_major=False):
        super().__init__()
        self.flat, self.tm = positions == "flat", time_major
        self.emb, self.pos = nn.Embedding(V, d, padding_idx=0), nn.Embedding(T, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=not time_major),
                                         layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, ids):  # (B, T)
        keep = ids != 0
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device)  # (T,)
        if self.tm:  # (T, B) ids, (T, B, d) activations
            h = self.emb(ids.t()) + self.pos(pos[:, None].expand(T, B))
            h = self.enc(h, src_key_padding_mask=~keep).transpose(0, 1)  # (B, T, d)
        else:
            h = self.emb(ids) + self.pos(pos if self.flat else pos[None])  # (T, d) or (1, T, d), broadcast
            h = self.enc(h, src_key_padding_mask=~keep)
        m = keep.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


def loss_fn(model, b):
    return F.cross_entropy(model(b["input_ids"]), b["labels"], reduction="none")


def _registry_without_mha():
    reg = default_registry()
    reg._by_type.pop(nn.MultiheadAttention)  # (a benchmark's "before": no public way to drop a rule)
    return reg


def make(variant, a, batch):
    torch.manual_seed(0)
    B = batch["input_ids"].shape[0]
    if variant == "opacus":
        from opacus.validators import ModuleValidator

        model = ModuleValidator.fix(Encoder(T=a.T, positions=a.positions, time_major=a.time_major))
        return opacus_hooks_step(model, loss_fn, batch, B, lr=1e-4)
    model = Encoder(T=a.T, positions=a.positions, time_major=a.time_major)
    params = pdpsgd.trainable_params(model)
    opt = torch.optim.Adam(params.values(), lr=1e-4)
    if variant == "nonprivate":
        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch).sum().div(B).backward()
            opt.step()
        return step
    method = "auto" if variant == "auto" else "bk"
    opts = {"registry": _registry_without_mha()} if variant == "bk_no_mha_rule" else None
    dp = pdpsgd.make_dp_step(model, loss_fn, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                             method=method, bk_options=opts, generator=torch.Generator().manual_seed(0))
    return pdpsgd_step(dp, params, opt, batch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--variants", default="nonprivate,bk,auto,bk_no_mha_rule,opacus")
    ap.add_argument("--positions", default="batched", choices=("batched", "flat"))
    ap.add_argument("--time-major", action="store_true", help="batch_first=False: (T, B, d) activations")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": padded_ids(a.B, a.T, 8192, g), "labels": torch.randint(0, 2, (a.B,), generator=g)}
    variants = without_missing_opacus(a.variants.split(","))
    steps = {v: make(v, a, batch) for v in variants}
    times = interleaved(steps, variants, a.reps)  # (a failing variant, Opacus here, is reported and left out)
    print_table(f"nn.TransformerEncoder 4x256, B={a.B} T={a.T} positions={a.positions} "
                f"{'time-major' if a.time_major else 'batch-first'} threads={a.threads}, "
                f"CPU time, median of {a.reps}",
                times)


if __name__ == "__main__":
    main()
