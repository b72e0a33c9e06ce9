"""BiLSTM (B=32, T=32, GloVe-sized frozen embedding) per-example cost: non-private vs naive loop vs vmap.

    python benchmarks/bench_lstm.py

The vmap path runs pdpsgd.rnn's pure-PyTorch LSTM (torch's fused kernel has no vmap rule); on CPU it
loses to a naive per-example loop over the fused kernel. A BK rule for LSTM is the fix (open).
"""
import torch, time, sys
sys.path.insert(0, "tests")
import torch.nn as nn, torch.nn.functional as F
import pdpsgd
torch.set_num_threads(1)
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(2000, 50); s.emb.weight.requires_grad_(False)
        s.rnn = nn.LSTM(50, 64, batch_first=True, bidirectional=True); s.out = nn.Linear(128, 3)
    def forward(s, ids):
        h, _ = s.rnn(s.emb(ids)); return s.out(h.mean(1))
m = M()
B, T = 32, 32
b = {"input_ids": torch.randint(0, 2000, (B, T)), "labels": torch.randint(0, 3, (B,))}
lf = lambda mod, bb: F.cross_entropy(mod(bb["input_ids"]), bb["labels"], reduction="none")
params = pdpsgd.trainable_params(m)
step = pdpsgd.make_dp_step(m, lf, max_grad_norm=1.0, noise_multiplier=1.0)
def naive():
    for i in range(B):
        l = lf(m, {k: v[i:i+1] for k, v in b.items()}).sum()
        torch.autograd.grad(l, list(params.values()))
def nonpriv():
    torch.autograd.grad(lf(m, b).sum(), list(params.values()))
for name, f in [("nonpriv", nonpriv), ("naive", naive), ("vmap", lambda: step(params, b))]:
    f(); t = time.perf_counter(); f(); f(); print(name, (time.perf_counter() - t) / 2)
