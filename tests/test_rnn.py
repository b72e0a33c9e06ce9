"""Tests for pdpsgd.rnn: exact pure-PyTorch replacements of torch's fused RNN kernels."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.modules.rnn as rnn_module
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from pdpsgd import rnn as prnn
from pdpsgd.rnn import exact_rnn_ops, model_has_rnn

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)
DTYPE = torch.float64
KINDS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


# --------------------------------------------------------------------------- helpers


@st.composite
def rnn_configs(draw, kinds=KINDS):
    """A random recurrent-network configuration plus the data sizes to run it on."""
    kind = draw(st.sampled_from(kinds))
    hidden = draw(st.integers(1, 5))
    return dict(
        kind=kind,
        input_size=draw(st.integers(1, 4)),
        hidden_size=hidden,
        num_layers=draw(st.integers(1, 2)),
        bidirectional=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        bias=draw(st.booleans()),
        proj_size=draw(st.integers(0, hidden - 1)) if kind == "lstm" else 0,
        T=draw(st.integers(1, 4)),
        B=draw(st.integers(1, 3)),
        with_hx=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def make_rnn(cfg, dropout: float = 0.0) -> nn.RNNBase:
    torch.manual_seed(cfg["seed"])
    common = dict(
        num_layers=cfg["num_layers"],
        bias=cfg["bias"],
        batch_first=cfg["batch_first"],
        dropout=dropout,
        bidirectional=cfg["bidirectional"],
        dtype=DTYPE,
    )
    kind = cfg["kind"]
    if kind == "lstm":
        return nn.LSTM(cfg["input_size"], cfg["hidden_size"], proj_size=cfg["proj_size"], **common)
    if kind == "gru":
        return nn.GRU(cfg["input_size"], cfg["hidden_size"], **common)
    nonlinearity = "tanh" if kind == "rnn_tanh" else "relu"
    return nn.RNN(cfg["input_size"], cfg["hidden_size"], nonlinearity=nonlinearity, **common)


def make_inputs(cfg, batch_shape=None):
    """Input and (optional) initial state for ``cfg``; ``batch_shape`` () means unbatched.

    Returns ``x`` of shape (*batch_shape, T, F) and ``hx`` (or None) with components of
    shape (*batch_shape, L*D, H_k); i.e. the leading dims are the examples.
    """
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    bshape = (cfg["B"],) if batch_shape is None else tuple(batch_shape)
    x = torch.randn(*bshape, cfg["T"], cfg["input_size"], generator=g, dtype=DTYPE)
    if not cfg["with_hx"]:
        return x, None
    ld = cfg["num_layers"] * (2 if cfg["bidirectional"] else 1)
    h_size = cfg["proj_size"] or cfg["hidden_size"]
    h = torch.randn(*bshape, ld, h_size, generator=g, dtype=DTYPE)
    if cfg["kind"] == "lstm":
        return x, (h, torch.randn(*bshape, ld, cfg["hidden_size"], generator=g, dtype=DTYPE))
    return x, h


def to_module_layout(cfg, x, hx, batched: bool):
    """Example-major (B, T, F) / (B, L*D, H) tensors -> the layout the module expects."""
    if batched:
        x = x if cfg["batch_first"] else x.transpose(0, 1)  # (B, T, F) or (T, B, F)
        hx = _map(lambda h: h.transpose(0, 1), hx)  # (L*D, B, H)
    return x, hx


def _map(fn, hx):
    if hx is None:
        return None
    return tuple(fn(h) for h in hx) if isinstance(hx, tuple) else fn(hx)


def _leaves(hx):
    return [] if hx is None else (list(hx) if isinstance(hx, tuple) else [hx])


def flat_outputs(result):
    """``(output, h_n)`` or ``(output, (h_n, c_n))`` -> list of tensors."""
    out, hidden = result
    if isinstance(out, PackedSequence):
        out = out.data
    return [out] + (list(hidden) if isinstance(hidden, tuple) else [hidden])


def assert_rel_close(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(expected.abs().max().item(), actual.abs().max().item(), 1e-12) if expected.numel() else 1.0
    err = (actual - expected).abs().max().item() / scale if expected.numel() else 0.0
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def weighted_sum(tensors, seed):
    """A scalar loss that depends on every element of every tensor with a generic weight."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in tensors)


class Net(nn.Module):
    """An RNN followed by a linear head; returns one scalar loss for one example."""

    def __init__(self, rnn: nn.RNNBase):
        super().__init__()
        self.rnn = rnn
        out_features = (rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(out_features, 2, dtype=DTYPE)

    def forward(self, x, hx=None):
        out, hidden = self.rnn(x, hx)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.head(out).pow(2).sum() + h_n.sin().sum()


# --------------------------------------------------------------------------- exactness


@SETTINGS
@given(cfg=rnn_configs(), unbatched=st.booleans())
def test_forward_and_autograd_match_native(cfg, unbatched):
    """Outputs, final states, and grads w.r.t. params/input/hx equal the fused kernels."""
    rnn = make_rnn(cfg)
    if unbatched:
        x, hx = make_inputs(cfg, batch_shape=())  # (T, F), (L*D, H)
    else:
        x, hx = to_module_layout(cfg, *make_inputs(cfg), batched=True)
    inputs = [x] + _leaves(hx)
    params = list(rnn.parameters())

    results = []
    for exact in (False, True):
        xs = [t.clone().requires_grad_() for t in inputs]
        h = None if hx is None else (tuple(xs[1:]) if isinstance(hx, tuple) else xs[1])
        with exact_rnn_ops() if exact else contextlib.nullcontext():
            outs = flat_outputs(rnn(xs[0], h))
        grads = torch.autograd.grad(weighted_sum(outs, cfg["seed"]), params + xs)
        results.append((outs, grads))

    (n_outs, n_grads), (e_outs, e_grads) = results
    for k, (e, n) in enumerate(zip(e_outs, n_outs)):
        assert_rel_close(e, n, 1e-10, f"output {k}")
    for k, (e, n) in enumerate(zip(e_grads, n_grads)):
        assert_rel_close(e, n, 1e-10, f"grad {k}")


@SETTINGS
@given(cfg=rnn_configs(), data=st.data())
def test_packed_sequence_matches_native(cfg, data):
    """The packed-sequence overload (unsorted lengths, hx permutation) equals the fused kernel."""
    rnn = make_rnn(cfg)
    x, hx = to_module_layout(cfg, *make_inputs(cfg), batched=True)
    lengths = data.draw(st.lists(st.integers(1, cfg["T"]), min_size=cfg["B"], max_size=cfg["B"]))
    params = list(rnn.parameters())
    inputs = [x] + _leaves(hx)

    results = []
    for exact in (False, True):
        xs = [t.clone().requires_grad_() for t in inputs]
        h = None if hx is None else (tuple(xs[1:]) if isinstance(hx, tuple) else xs[1])
        packed = pack_padded_sequence(xs[0], lengths, batch_first=cfg["batch_first"], enforce_sorted=False)
        with exact_rnn_ops() if exact else contextlib.nullcontext():
            outs = flat_outputs(rnn(packed, h))
        grads = torch.autograd.grad(weighted_sum(outs, cfg["seed"]), params + xs)
        results.append((outs, grads))

    (n_outs, n_grads), (e_outs, e_grads) = results
    for k, (e, n) in enumerate(zip(e_outs, n_outs)):
        assert_rel_close(e, n, 1e-10, f"output {k}")
    for k, (e, n) in enumerate(zip(e_grads, n_grads)):
        assert_rel_close(e, n, 1e-10, f"grad {k}")


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
def test_cells_match_native_and_vmap(kind):
    """``nn.*Cell`` modules also go through the replacement and give exact per-example grads."""
    torch.manual_seed(0)
    if kind == "lstm":
        cell = nn.LSTMCell(3, 4, dtype=DTYPE)
    elif kind == "gru":
        cell = nn.GRUCell(3, 4, dtype=DTYPE)
    else:
        cell = nn.RNNCell(3, 4, nonlinearity=kind[4:], dtype=DTYPE)
    x = torch.randn(5, 3, dtype=DTYPE)

    def loss(params, xi):
        out = functional_call(cell, params, (xi,))  # unbatched (F,) -> (H,)
        out = out[0] + out[1] if isinstance(out, tuple) else out
        return out.pow(2).sum()

    native = flat_outputs((cell(x), torch.zeros(0))) if kind != "lstm" else list(cell(x))
    with exact_rnn_ops():
        exact = flat_outputs((cell(x), torch.zeros(0))) if kind != "lstm" else list(cell(x))
        params = {k: v.detach() for k, v in cell.named_parameters()}
        per_ex = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for e, n in zip(exact, native):
        assert_rel_close(e, n, 1e-10, "cell output")
    for i in range(x.shape[0]):
        ref = torch.autograd.grad(loss(dict(cell.named_parameters()), x[i]), list(cell.parameters()))
        for (name, _), r in zip(cell.named_parameters(), ref):
            assert_rel_close(per_ex[name][i], r, 1e-9, name)


# --------------------------------------------------------------------------- per-example grads


@SETTINGS
@given(cfg=rnn_configs(), unbatched=st.booleans())
def test_vmap_per_example_grads_match_naive_loop(cfg, unbatched):
    """vmap(grad) under exact_rnn_ops == a loop of autograd.grad with the native module."""
    net = Net(make_rnn(cfg))
    x, hx = make_inputs(cfg)  # (B, T, F), (B, L*D, H) or None
    batch = (x,) if hx is None else (x, hx)
    batch_dim = 0 if cfg["batch_first"] else 1

    def example_args(xi, hi=None):
        """One example's (T, F) / (L*D, H) tensors -> module call args."""
        if unbatched:
            return (xi, hi)
        return (xi.unsqueeze(batch_dim), _map(lambda h: h.unsqueeze(1), hi))  # batch of one

    def loss(params, example):
        return functional_call(net, params, example_args(*example))

    params = {k: v.detach() for k, v in net.named_parameters()}
    with exact_rnn_ops(net):
        per_ex = vmap(grad(loss), in_dims=(None, 0))(params, batch)

    names = [k for k, _ in net.named_parameters()]
    for i in range(cfg["B"]):
        example = tuple(_map(lambda t: t[i], b) for b in batch)
        ref = torch.autograd.grad(net(*example_args(*example)), list(net.parameters()))
        for name, r in zip(names, ref):
            assert per_ex[name].shape == (cfg["B"], *r.shape)
            assert_rel_close(per_ex[name][i], r, 1e-9, f"example {i} {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_under_vmap_gives_independent_masks(kind):
    """train() + dropout>0 runs under vmap(randomness='different') with per-example masks."""
    cfg = dict(kind=kind, input_size=3, hidden_size=8, num_layers=2, bidirectional=False,
               batch_first=True, bias=True, proj_size=0, T=4, B=3, with_hx=False, seed=7)
    net = Net(make_rnn(cfg, dropout=0.5)).train()
    x0 = make_inputs(cfg)[0][0]  # (T, F)
    x = torch.stack([x0, x0, x0])  # three identical examples, (3, T, F)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, xi):
        return functional_call(net, p, (xi,))

    with exact_rnn_ops(net):
        g_diff = vmap(grad(loss), in_dims=(None, 0), randomness="different")(params, x)
        g_same = vmap(grad(loss), in_dims=(None, 0), randomness="same")(params, x)
        net.eval()
        g_eval = vmap(grad(loss), in_dims=(None, 0))(params, x)

    w = "rnn.weight_ih_l0"  # its gradient flows back through the dropout mask on layer 0's output
    for name, p in params.items():
        for g in (g_diff, g_same, g_eval):
            assert g[name].shape == (3, *p.shape)
            assert torch.isfinite(g[name]).all()
    assert not torch.allclose(g_diff[w][0], g_diff[w][1])
    assert not torch.allclose(g_diff[w][1], g_diff[w][2])
    assert_rel_close(g_same[w][0], g_same[w][1], 1e-12, "randomness='same' shares the mask")
    assert_rel_close(g_eval[w][0], g_eval[w][1], 1e-12, "eval mode is deterministic")


def test_packed_sequence_under_vmap():
    """Packed data with shared (unbatched) batch_sizes works under vmap; batched ones raise."""
    cfg = dict(kind="gru", input_size=3, hidden_size=4, num_layers=2, bidirectional=True,
               batch_first=False, bias=True, proj_size=0, T=3, B=3, with_hx=False, seed=3)
    rnn = make_rnn(cfg)
    batch_sizes = torch.tensor([3, 2, 2, 1])  # per example: 3 sequences of lengths 4, 3, 1
    data = torch.randn(5, int(batch_sizes.sum()), 3, dtype=DTYPE)  # 5 examples, (N, F) each

    def loss(params, d):
        out, h_n = functional_call(rnn, params, (PackedSequence(d, batch_sizes),))
        return out.data.pow(2).sum() + h_n.sin().sum()

    params = {k: v.detach() for k, v in rnn.named_parameters()}
    with exact_rnn_ops():
        per_ex = vmap(grad(loss), in_dims=(None, 0))(params, data)
    for i in range(data.shape[0]):
        ref = torch.autograd.grad(loss(dict(rnn.named_parameters()), data[i]), list(rnn.parameters()))
        for (name, _), r in zip(rnn.named_parameters(), ref):
            assert_rel_close(per_ex[name][i], r, 1e-9, name)

    hx = torch.zeros(4, 3, 4, dtype=DTYPE)

    def direct(d, bs):
        return prnn.gru(d, bs, hx, rnn._flat_weights, True, 2, 0.0, False, True)[0]

    bs_per_example = batch_sizes.expand(5, 4)
    with pytest.raises(RuntimeError, match="packed sequences.*unsupported under torch.func.vmap"):
        vmap(direct)(data, bs_per_example)


# --------------------------------------------------------------------------- the scoped patch


def test_context_manager_patches_restores_and_nests():
    real = rnn_module._VF
    rnn = nn.LSTM(2, 3)
    with exact_rnn_ops():
        proxy = rnn_module._VF
        assert proxy is not real
        assert proxy.lstm is prnn.lstm and proxy.gru is prnn.gru
        assert proxy.rnn_tanh is prnn.rnn_tanh and proxy.rnn_relu is prnn.rnn_relu
        assert proxy.lstm_cell is prnn.lstm_cell
        assert proxy.tensordot is real.tensordot  # everything else delegates
        with exact_rnn_ops(rnn):
            assert rnn_module._VF is proxy  # nested: same proxy
        assert rnn_module._VF is proxy
    assert rnn_module._VF is real


def test_overlapping_uses_leaving_out_of_order_restore_the_real_kernels():
    """Review, round 35: two threads' uses, the first leaving first, left the proxy installed for
    good (each put back what it saw on entry), so every nn.LSTM in the process ran Python kernels."""
    real = rnn_module._VF
    a, b = exact_rnn_ops(), exact_rnn_ops()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert rnn_module._VF is not real  # (b is still inside)
    b.__exit__(None, None, None)
    assert rnn_module._VF is real


@pytest.mark.parametrize("method", ["vmap", "bk"])
def test_a_step_leaves_the_rnn_flat_weights_its_parameters(method):
    """Review, round 35: after a step nn.LSTM._flat_weights held vmap's functorch wrappers (or the
    capture's detached copies): kept alive, and what deepcopy / DataParallel.replicate read."""
    import copy

    import pdpsgd

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0].mean(1))

    net = Net()
    batch = {"x": torch.randn(4, 5, 3), "y": torch.tensor([0, 1, 1, 0])}
    step = pdpsgd.make_dp_step(net, lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"], reduction="none"),
                               max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, method=method)
    step(pdpsgd.trainable_params(net), batch)
    assert all(w is getattr(net.rnn, n) for w, n in zip(net.rnn._flat_weights, net.rnn._flat_weights_names))
    copy.deepcopy(net)


def test_context_manager_restores_after_exception():
    real = rnn_module._VF
    with pytest.raises(ValueError, match="boom"):
        with exact_rnn_ops():
            with exact_rnn_ops():
                raise ValueError("boom")
    assert rnn_module._VF is real
    rnn = nn.GRU(2, 3)
    with pytest.raises(RuntimeError):
        with exact_rnn_ops(rnn):
            rnn(torch.randn(4, 2, 5))  # wrong feature size: the module itself raises
    assert rnn_module._VF is real


def test_no_patch_without_rnn_and_model_has_rnn():
    real = rnn_module._VF
    mlp = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
    assert not model_has_rnn(mlp)
    with exact_rnn_ops(mlp):
        assert rnn_module._VF is real
    for m in (nn.LSTM(2, 3), nn.GRU(2, 3), nn.RNN(2, 3), nn.GRUCell(2, 3),
              nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.RNN(2, 3, nonlinearity="relu")))):
        assert model_has_rnn(m)


def test_flatten_parameters_reading_data_pointers_does_not_break_vmap(monkeypatch):
    """On CUDA, RNNBase.forward calls flatten_parameters once functional_call has swapped the weights
    in, and it reads each weight's data_ptr(), which a torch.func wrapper has none of (review, round
    36; torch issue #105982). Simulated here on the CPU: the step runs, exact, and the method is the
    original again afterwards."""
    import pdpsgd
    from pdpsgd.testing import assert_exact

    orig = nn.RNNBase.flatten_parameters

    def flatten_as_on_cuda(self):  # (the line torch reaches when every weight is a cuDNN-acceptable CUDA tensor)
        {p.data_ptr() for p in self._flat_weights}
        return orig(self)

    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", flatten_as_on_cuda)

    class R(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.h = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.h(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    b = {"x": torch.randn(4, 5, 3), "y": torch.randint(0, 2, (4,))}
    loss = lambda m, bb: torch.nn.functional.cross_entropy(m(bb["x"]), bb["y"], reduction="none")  # noqa: E731
    assert_exact(R(), loss, b, method="vmap", max_grad_norm=0.5)
    assert nn.RNNBase.flatten_parameters is flatten_as_on_cuda
