"""BK rule for nn.LSTM / nn.GRU / nn.RNN (pdpsgd/rules/rnn.py): exact against the naive float64 oracle."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import pdpsgd
from pdpsgd.testing import assert_exact

KINDS = {
    "lstm": lambda *a, **k: nn.LSTM(*a, **k),
    "gru": lambda *a, **k: nn.GRU(*a, **k),
    "rnn_tanh": lambda *a, **k: nn.RNN(*a, nonlinearity="tanh", **k),
    "rnn_relu": lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k),
}


class Recurrent(nn.Module):
    """Embedding -> recurrent layer (output and final state both used) -> linear heads."""

    def __init__(self, kind="lstm", vocab=20, dim=4, hidden=3, layers=1, bidirectional=True, batch_first=True,
                 bias=True, learn_h0=False, twice=False):
        super().__init__()
        self.kind, self.batch_first, self.twice = kind, batch_first, twice
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = KINDS[kind](dim, hidden, num_layers=layers, bidirectional=bidirectional,
                               batch_first=batch_first, bias=bias)
        D = 2 if bidirectional else 1
        self.h0 = nn.Parameter(0.1 * torch.randn(layers * D, 1, hidden)) if learn_h0 else None
        self.out = nn.Linear(D * hidden, 3)
        self.last = nn.Linear(hidden, 3, bias=False)

    def run(self, x):
        B = x.shape[0]
        if not self.batch_first:
            x = x.transpose(0, 1)
        hx = None
        if self.h0 is not None:
            h0 = self.h0.expand(-1, B, -1).contiguous()
            hx = (h0, torch.tanh(h0)) if self.kind == "lstm" else h0
        h, hn = self.rnn(x, hx)
        if not self.batch_first:
            h = h.transpose(0, 1)
        hn = hn[0] if self.kind == "lstm" else hn  # (L·D, B, H)
        return self.out(h.mean(1)) + self.last(hn[-1])

    def forward(self, ids):
        x = self.emb(ids)
        y = self.run(x)
        return y + self.run(x.flip(1)) if self.twice else y  # twice: the same layer used twice per example


def loss(model, b):
    return nn.functional.cross_entropy(model(b["input_ids"]), b["labels"], reduction="none")


def _batch(B, T, vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (B, T), generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}


def _rnn_routes(r):
    return {n: v for n, v in r.routes.items() if n.startswith("rnn.")}


@settings(max_examples=20, deadline=None, derandomize=True)
@given(kind=st.sampled_from(sorted(KINDS)), B=st.integers(1, 5), T=st.integers(1, 9), hidden=st.integers(1, 5),
       layers=st.integers(1, 2), bidirectional=st.booleans(), batch_first=st.booleans(), bias=st.booleans(),
       learn_h0=st.booleans(), cost_model=st.sampled_from(["fastdp", "time", "ghost", "explicit"]),
       clip=st.sampled_from([1e-3, 0.1, 10.0]), seed=st.integers(0, 3))
def test_hypothesis_rnn_rule_exact(kind, B, T, hidden, layers, bidirectional, batch_first, bias, learn_h0,
                                   cost_model, clip, seed):
    torch.manual_seed(seed)
    m = Recurrent(kind, hidden=hidden, layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                  bias=bias, learn_h0=learn_h0)
    r = assert_exact(m, loss, _batch(B, T, seed=seed), method="bk", max_grad_norm=clip,
                     bk_options={"cost_model": cost_model})
    routes = _rnn_routes(r)
    assert routes and "vmap" not in routes.values()  # every recurrent weight by the rule
    if learn_h0:
        assert r.routes["h0"] == "vmap"  # a raw parameter: exact fallback, never frozen


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layer_used_twice_cross_terms_exact(kind):
    torch.manual_seed(1)
    for method in ("bk", "auto"):
        r = assert_exact(Recurrent(kind, twice=True, layers=2), loss, _batch(4, 6), method=method, max_grad_norm=0.05)
        assert "vmap" not in _rnn_routes(r).values()


class Packed(nn.Module):
    """pack_padded_sequence (unsorted lengths) -> recurrent layer -> masked mean + final state."""

    def __init__(self, kind="lstm", layers=2, bidirectional=True, hidden=3, learn_h0=False):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(20, 4, padding_idx=0)
        self.rnn = KINDS[kind](4, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        D = 2 if bidirectional else 1
        self.h0 = nn.Parameter(0.1 * torch.randn(layers * D, 1, hidden)) if learn_h0 else None
        self.out = nn.Linear(D * hidden, 3)
        self.last = nn.Linear(hidden, 3, bias=False)

    def forward(self, ids):
        lengths = (ids != 0).sum(1).clamp_min(1)
        packed = pack_padded_sequence(self.emb(ids), lengths.cpu(), batch_first=True, enforce_sorted=False)
        hx = None
        if self.h0 is not None:
            h0 = self.h0.expand(-1, ids.shape[0], -1).contiguous()
            hx = (h0, h0 * 0.5) if self.kind == "lstm" else h0
        y, hn = self.rnn(packed, hx)
        h, _ = pad_packed_sequence(y, batch_first=True, total_length=ids.shape[1])
        hn = hn[0] if self.kind == "lstm" else hn
        return self.out(h.sum(1) / lengths.unsqueeze(1)) + self.last(hn[-1])


def _padded_batch(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    ids[torch.arange(T)[None] >= lengths[:, None]] = 0
    return {"input_ids": ids, "labels": torch.randint(0, 3, (B,), generator=g)}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(kind=st.sampled_from(sorted(KINDS)), B=st.integers(1, 5), T=st.integers(1, 7), layers=st.integers(1, 2),
       bidirectional=st.booleans(), cost_model=st.sampled_from(["time", "ghost", "explicit"]), seed=st.integers(0, 5))
def test_hypothesis_packed_sequences_exact(kind, B, T, layers, bidirectional, cost_model, seed):
    """Unsorted lengths: the rule runs length-sorted rows and maps them back to examples."""
    torch.manual_seed(seed)
    m = Packed(kind, layers=layers, bidirectional=bidirectional)
    r = assert_exact(m, loss, _padded_batch(B, T, seed), method="bk", max_grad_norm=0.05,
                     bk_options={"cost_model": cost_model})
    assert "vmap" not in _rnn_routes(r).values()


def test_packed_with_a_fallback_parameter_is_a_clear_error():
    """A parameter without a rule (here h0) needs vmap over the whole model, which cannot run
    per-example packed sequences: the error says so and how to fix it."""
    m = Packed("lstm", learn_h0=True)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    with pytest.raises(RuntimeError, match="packed sequences .* cannot run per example"):
        step(pdpsgd.trainable_params(m), _padded_batch(3, 5, 0))


def test_declined_calls_fall_back_exactly():
    torch.manual_seed(0)
    b = _batch(4, 6)
    m = Recurrent("lstm")
    m.rnn = nn.LSTM(4, 3, batch_first=True, bidirectional=True, proj_size=2)
    m.out, m.last = nn.Linear(4, 3), nn.Linear(2, 3, bias=False)
    r = assert_exact(m, loss, b, method="bk", max_grad_norm=0.1)  # projected LSTM
    assert set(_rnn_routes(r).values()) == {"vmap"}


def test_train_mode_interlayer_dropout_is_left_to_vmap():
    torch.manual_seed(0)
    m = Recurrent("gru", layers=2)
    m.rnn.dropout = 0.5
    m.train()
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    out = step(pdpsgd.trainable_params(m), _batch(3, 5))
    assert set(v for n, v in out.routes.items() if n.startswith("rnn.")) == {"vmap"}
    m.eval()  # no dropout at eval: the rule applies
    out = step(pdpsgd.trainable_params(m), _batch(3, 5))
    assert "vmap" not in {v for n, v in out.routes.items() if n.startswith("rnn.")}


def test_module_is_left_as_it_was():
    m = Recurrent("lstm")
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    step(pdpsgd.trainable_params(m), _batch(3, 5))
    assert "forward" not in m.rnn.__dict__ and not m.rnn._forward_hooks and not m.rnn._forward_pre_hooks
    with torch.no_grad():
        ref = m(_batch(3, 5)["input_ids"])  # the fused kernel runs as before
    assert torch.isfinite(ref).all()


def test_float32_matches_fused_kernel_forward():
    """The rule's own forward gives the same output/state as torch's kernel (what the user trains)."""
    from pdpsgd.rules.rnn import RNNRule

    torch.manual_seed(0)
    for kind in sorted(KINDS):
        for bf in (True, False):
            rnn = KINDS[kind](4, 5, num_layers=2, bidirectional=True, batch_first=bf)
            x = torch.randn(3, 7, 4) if bf else torch.randn(7, 3, 4)
            ref, ref_h = rnn(x)
            lengths = torch.tensor([7, 2, 5])
            packed = pack_padded_sequence(x, lengths, batch_first=bf, enforce_sorted=False)
            for inp in (x, packed):
                ref, ref_h = rnn(inp)
                (y, h), _ = RNNRule().forward(rnn, (inp,), {})
                if inp is packed:
                    assert torch.equal(y.batch_sizes, ref.batch_sizes)
                    y, ref = y.data, ref.data
                torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
                for a, c in zip(h if kind == "lstm" else (h,), ref_h if kind == "lstm" else (ref_h,)):
                    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


class EncoderDecoder(nn.Module):
    """The second layer starts from the first's final state: gradients flow through h0/c0."""

    def __init__(self, kind="lstm"):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(20, 4)
        self.enc = KINDS[kind](4, 3, batch_first=True)
        self.dec = KINDS[kind](4, 3, batch_first=True)
        self.out = nn.Linear(3, 3)

    def forward(self, ids):
        x = self.emb(ids)
        _, state = self.enc(x)
        y, _ = self.dec(x.flip(1), state)
        return self.out(y.mean(1))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_handed_between_layers_exact(kind):
    torch.manual_seed(2)
    for cm in ("ghost", "explicit"):
        r = assert_exact(EncoderDecoder(kind), loss, _batch(4, 6), method="bk", max_grad_norm=0.05,
                         bk_options={"cost_model": cm})
        assert "vmap" not in {v for n, v in r.routes.items() if n.startswith(("enc.", "dec."))}


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_lstm_layer_backward_gradcheck(D, packed):
    """The hand-written backward through time of the LSTM rule, against finite differences."""
    from pdpsgd.rules.rnn import _LSTMLayer

    torch.manual_seed(0)
    B, T, H = 3, 4, 2
    G = torch.randn(D, B, T, 4 * H, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(D, B, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(D, B, H, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(D, 4 * H, H, dtype=torch.float64), torch.randn(D, 4 * H, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor([4, 2, 1])[:, None]) if packed else None
    masks = None if mask is None else torch.stack([mask.flip(1) if d else mask for d in range(D)])

    def f(G, h0, c0):
        y, h, c, _ = _LSTMLayer.apply(G, h0, c0, w, b, masks)
        return y, h, c

    assert torch.autograd.gradcheck(f, (G, h0, c0))


class PackedWithComputedState(nn.Module):
    """Packed input (unsorted lengths) and an initial state computed by a Linear from the data:
    the rule must permute h0/c0 into length order and hand their gradients back."""

    def __init__(self, kind="lstm"):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(20, 4, padding_idx=0)
        self.init = nn.Linear(4, 2 * 3)
        self.rnn = KINDS[kind](4, 3, num_layers=1, bidirectional=True, batch_first=True)
        self.out = nn.Linear(3, 3)

    def forward(self, ids):
        x = self.emb(ids)
        lengths = (ids != 0).sum(1).clamp_min(1)
        h0 = torch.tanh(self.init(x.mean(1))).view(-1, 2, 3).transpose(0, 1).contiguous()  # (2, B, 3)
        hx = (h0, 0.5 * h0) if self.kind == "lstm" else h0
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, hn = self.rnn(packed, hx)
        hn = hn[0] if self.kind == "lstm" else hn
        return self.out(hn[0] + hn[1])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_packed_with_computed_initial_state_exact(kind):
    torch.manual_seed(3)
    r = assert_exact(PackedWithComputedState(kind), loss, _padded_batch(5, 6, 1), method="bk", max_grad_norm=0.05)
    assert "vmap" not in r.routes.values()  # every parameter by a rule, init.* through dh0/dc0


def test_enforce_sorted_packing_says_how_to_fix_the_order_check():
    """pack_padded_sequence(enforce_sorted=True) (torch's default) on a length-sorted batch: the
    example-order check runs the batch in another order, which torch refuses, and every parameter
    then needs the fallback, which cannot run packed input. The error says to pass
    enforce_sorted=False (review, round 37: the reason was buried in torch's text)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.r, self.out = nn.Embedding(20, 3, padding_idx=0), nn.LSTM(3, 3, batch_first=True), nn.Linear(3, 3)

        def forward(self, x):
            _, (h, _) = self.r(pack_padded_sequence(self.emb(x), (x != 0).sum(1), batch_first=True))
            return self.out(h[-1])

    torch.manual_seed(0)
    x = torch.randint(1, 20, (4, 5))
    x[torch.arange(5)[None] >= torch.tensor([5, 4, 2, 1])[:, None]] = 0
    b = {"x": x, "y": torch.tensor([0, 1, 2, 0])}
    m = M()
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]), bb["y"], reduction="none")
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    with pytest.raises(RuntimeError, match="runs the batch in another order.*enforce_sorted=False"):
        step.clipped_sum(pdpsgd.trainable_params(m), b)


@pytest.mark.parametrize("set_in_init", [True, False])
def test_an_rnn_weight_kept_as_a_plain_attribute_is_put_back_after_the_step(set_in_init):
    """AWD-LSTM's WeightDrop keeps a recurrent weight as a plain attribute it sets in each forward:
    after a step the attribute is what it was before, not the step's substitute (review, round 37:
    a functorch wrapper stayed after an eval-mode step, and deepcopy failed)."""
    import copy

    class WeightDrop(nn.Module):
        def __init__(self, module, weights, dropout):
            super().__init__()
            self.module, self.weights, self.dropout = module, weights, dropout
            for n in weights:
                w = getattr(module, n)
                del module._parameters[n]
                module.register_parameter(n + "_raw", nn.Parameter(w.data))
                if set_in_init:  # (the published WeightDrop sets it in its forward only)
                    setattr(module, n, w.data.clone())

        def forward(self, *args):
            for n in self.weights:
                setattr(self.module, n, F.dropout(getattr(self.module, n + "_raw"), p=self.dropout, training=self.training))
            return self.module.forward(*args)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 3)
            self.r = WeightDrop(nn.LSTM(3, 3, batch_first=True), ["weight_hh_l0"], 0.3)
            self.out = nn.Linear(3, 3)

        def forward(self, x):
            return self.out(self.r(self.emb(x))[0].mean(1))

    torch.manual_seed(0)
    b = {"x": torch.randint(0, 20, (3, 4)), "y": torch.tensor([0, 1, 2])}
    m = M().eval()
    before = m.r.module.__dict__.get("weight_hh_l0")
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]), bb["y"], reduction="none")
    for method in ("vmap", "bk"):
        pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method=method).clipped_sum(
            pdpsgd.trainable_params(m), b)
        assert m.r.module.__dict__.get("weight_hh_l0") is before
        copy.deepcopy(m)


def test_a_declined_rnn_call_says_why():
    """The RNN rule's reason for declining a call reaches fallback_reasons (review, round 37: only
    "rnn rule declined a call of r" was said; a packed multi-layer LSTM with dropout in training
    mode cannot run on the rules, nor under the fallback)."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.r, self.out = nn.LSTM(3, 4, num_layers=2, dropout=0.3, batch_first=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.r(x)[0].mean(1))

    m = M().train()
    b = {"x": torch.randn(3, 5, 3), "y": torch.tensor([0, 1, 0])}
    loss = lambda mod, bb: F.cross_entropy(mod(bb["x"]), bb["y"], reduction="none")
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    reasons = step.fallback_reasons(b)
    assert any("inter-layer dropout in training mode" in v for k, v in reasons.items() if k.startswith("r.")), reasons


# -- mutation review, round 41 -----------------------------------------------------------------------

class _EqualWidth(nn.Module):
    """Two layers whose input width equals the next layer's (input_size == D·hidden): a rule that
    captured layer 0's input for layer 1 too would fit the shapes."""

    def __init__(self, kind, D):
        super().__init__()
        H = 4 // D
        self.emb = nn.Embedding(20, 4)
        self.rnn = {"LSTM": nn.LSTM, "GRU": nn.GRU, "RNN": nn.RNN}[kind](4, H, num_layers=2, bidirectional=D == 2,
                                                                        batch_first=True)
        self.out = nn.Linear(D * H, 3)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0].mean(1))


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("D", [1, 2])
def test_each_layer_is_captured_with_its_own_input_when_the_widths_match(kind, D):
    torch.manual_seed(0)
    b = {"x": torch.randint(0, 20, (3, 5)), "y": torch.tensor([0, 1, 2])}
    loss = lambda m, bb: F.cross_entropy(m(bb["x"]), bb["y"], reduction="none")  # noqa: E731
    r = assert_exact(_EqualWidth(kind, D), loss, b, method="bk", max_grad_norm=0.05,
                     bk_options={"check_order": False})
    assert all(v != "vmap" for n, v in r.routes.items() if n.startswith("rnn.")), r.routes


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_exact_kernels_apply_inter_layer_dropout_as_torch_does(cls):
    """The kernels the vmap fallback runs (pdpsgd.rnn) drop between layers only, scaled by
    1/(1-p), as torch's own kernel: dropping the last layer's output too, or not rescaling,
    changed the model's train-mode output unseen (mutation review, round 41)."""
    from pdpsgd.rnn import exact_rnn_ops

    torch.manual_seed(0)
    m = cls(3, 8, num_layers=2, dropout=0.5, batch_first=True).train()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)  # (past tanh's linear range less often: the mean follows the scale)
    x = torch.randn(4, 6, 3)

    def stats(run):
        outs = torch.stack([run() for _ in range(300)])  # (300, 4, 6, 8)
        return float((outs == 0).double().mean()), outs.mean(0)

    with torch.no_grad():
        zeros_native, mean_native = stats(lambda: m(x)[0])
        with exact_rnn_ops(m):
            zeros_ours, mean_ours = stats(lambda: m(x)[0])
    assert zeros_ours <= zeros_native + 0.01
    err = float((mean_ours - mean_native).norm() / mean_native.norm())
    assert err < 0.1, err
