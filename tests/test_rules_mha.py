"""torch's nn.MultiheadAttention on the rules (``pdpsgd.rules.multihead_attention``), and so
nn.TransformerEncoder / nn.Transformer: against the naive float64 loop, with the routes taken."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pdpsgd
from pdpsgd.testing import assert_exact, check_sensitivity

V = 30


class _Attn(nn.Module):
    """One nn.MultiheadAttention called as self-attention, encoder-decoder (key is value) or with
    three different inputs, batch first or not, with its masks and attention weights used."""

    def __init__(self, d, heads, kind, batch_first, bias, need_weights, causal):
        super().__init__()
        self.kind, self.batch_first, self.need_weights, self.causal = kind, batch_first, need_weights, causal
        self.emb = nn.Embedding(V, d, padding_idx=0)
        self.mha = nn.MultiheadAttention(d, heads, bias=bias, batch_first=batch_first)
        self.head = nn.Linear(d, 3)

    def forward(self, ids, keep):  # (B, T), (B, T) bool
        h = self.emb(ids)
        q, k, v = {"self": (h, h, h), "cross": (h, h[:, :3] * 2, None), "separate": (h, h * 2, torch.tanh(h))}[self.kind]
        v = k if v is None else v
        if not self.batch_first:
            q, k, v = (x.transpose(0, 1) for x in (q, k, v)) if self.kind != "self" else (q.transpose(0, 1),) * 3
            if self.kind == "cross":
                v = k
        kpm = ~keep[:, :k.shape[0 if not self.batch_first else 1]]
        T = q.shape[1 if self.batch_first else 0]
        mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=h.dtype) if self.causal and self.kind == "self" else None
        a, w = self.mha(q, k, v, key_padding_mask=kpm, need_weights=self.need_weights, attn_mask=mask)
        if not self.batch_first:
            a = a.transpose(0, 1)
        out = self.head(a.mean(1))
        return out if w is None else out + w.sum((1, 2))[:, None]


def _batch(B, T, gen):
    ids = torch.randint(1, V, (B, T), generator=gen)
    keep = torch.ones(B, T, dtype=torch.bool)
    for i in range(1, B, 2):
        keep[i, 1 + i % (T - 1):] = False  # padded examples (every key of row 0 is kept)
    return {"ids": ids.masked_fill(~keep, 0), "keep": keep, "y": torch.randint(0, 3, (B,), generator=gen)}


def _loss(m, b):
    return F.cross_entropy(m(b["ids"], b["keep"]), b["y"], reduction="none")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.integers(1, 6), T=st.integers(3, 9), heads=st.sampled_from([1, 2, 4]),
       kind=st.sampled_from(["self", "cross", "separate"]), batch_first=st.booleans(), bias=st.booleans(),
       need_weights=st.booleans(), causal=st.booleans(), train=st.booleans(), C=st.floats(0.05, 5.0),
       seed=st.integers(0, 10**6))
def test_multihead_attention_exact_on_its_rule(B, T, heads, kind, batch_first, bias, need_weights, causal, train, C,
                                               seed):
    torch.manual_seed(seed)
    m = _Attn(8, heads, kind, batch_first, bias, need_weights, causal).train(train)  # (dropout 0: deterministic)
    b = _batch(B, T, torch.Generator().manual_seed(seed))
    for method in ("bk", "auto"):
        r = assert_exact(m, _loss, b, method=method, max_grad_norm=C)
        assert "vmap" not in r.routes.values(), r.routes
        assert r.routes["mha.in_proj_weight"] in ("ghost", "explicit")


@pytest.mark.parametrize("causal", [False, True])
def test_torch_transformer_layers_on_the_rules_and_bounded(causal):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self, d=8):
            super().__init__()
            self.emb = nn.Embedding(V, d, padding_idx=0)
            self.t = nn.Transformer(d, 2, 2, 1, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(d, 3)

        def forward(self, ids, keep):
            h = self.emb(ids)
            T = ids.shape[1]
            mask = nn.Transformer.generate_square_subsequent_mask(T) if causal else None
            return self.head(self.t(h, h[:, :4], src_mask=mask, src_key_padding_mask=~keep, src_is_causal=causal)[:, 0])

    m = Model()
    b = _batch(5, 6, torch.Generator().manual_seed(0))
    for method in ("bk", "auto"):
        r = assert_exact(m, _loss, b, method=method, max_grad_norm=0.5)
        assert "vmap" not in r.routes.values(), r.routes
    step = pdpsgd.make_dp_step(m.double(), _loss, max_grad_norm=0.5, noise_multiplier=0.0, method="bk")
    assert check_sensitivity(step, pdpsgd.trainable_params(m), b).max_ratio <= 1 + 1e-9


def test_a_projection_the_capture_does_not_see_sends_the_layer_to_the_fallback(monkeypatch):
    """The exactness guard: the forward's parameters are fresh leaves, so a use of them other than the
    ``F.linear`` calls the rule sees (here the input projection by a matmul, as another torch could
    compute it) reaches them in the backward, and the rule declines."""
    def packed(q, k, v, w, b=None):
        E = q.size(-1)
        proj = torch.matmul(q, w.t()) + b
        proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        return proj[0], proj[1], proj[2]

    monkeypatch.setattr(F, "_in_projection_packed", packed)
    torch.manual_seed(0)
    m = _Attn(8, 2, "self", True, True, False, False)
    b = _batch(4, 5, torch.Generator().manual_seed(0))
    r = assert_exact(m, _loss, b, method="bk", max_grad_norm=0.5)
    assert r.routes["mha.in_proj_weight"] == "vmap" and r.routes["mha.in_proj_bias"] == "vmap", r.routes
    assert r.routes["mha.out_proj.weight"] != "vmap" and r.routes["emb.weight"] != "vmap", r.routes



@pytest.mark.parametrize("variant", ["extra_use", "bias_offset"])
@pytest.mark.parametrize("check_order", [True, False])
def test_an_input_projection_the_rule_would_misread_is_exact(monkeypatch, variant, check_order):
    """Mutation review, round 41: the guards of the input projection were only reached through the
    example-order check's verdict. All rows through ``F.linear`` plus one more use of the weight
    (the stray-use guard), and q's projection with k's bias rows (the bias-offset check): exact
    also with the order check off, the parameters on the fallback."""
    def packed(q, k, v, w, b=None):
        E = q.size(-1)
        if variant == "extra_use":
            proj = F.linear(q, w, b).unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return proj[0] + 0.1 * w.pow(2).sum(), proj[1], proj[2]
        return F.linear(q, w[:E], b[E:2 * E]), F.linear(k, w[E:2 * E], b[E:2 * E]), F.linear(v, w[2 * E:], b[2 * E:])

    monkeypatch.setattr(F, "_in_projection_packed", packed)
    torch.manual_seed(0)
    m = _Attn(8, 2, "self", True, True, False, False)
    b = _batch(4, 5, torch.Generator().manual_seed(0))
    r = assert_exact(m, _loss, b, method="bk", max_grad_norm=0.5, bk_options={"check_order": check_order})
    moved = "mha.in_proj_weight" if variant == "extra_use" else "mha.in_proj_bias"
    assert r.routes[moved] == "vmap", r.routes

@pytest.mark.parametrize("kw", [dict(kdim=5, vdim=6), dict(add_bias_kv=True)])
def test_configurations_the_rule_does_not_take_fall_back_exactly(kw):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True, **kw)
            self.head = nn.Linear(8, 3)

        def forward(self, x, y):
            k = x[..., :kw.get("kdim", 8)]
            v = x[..., :kw.get("vdim", 8)]
            return self.head(self.mha(x, k, v, need_weights=False)[0].mean(1))

    b = {"x": torch.randn(4, 5, 8), "y": torch.randint(0, 3, (4,))}
    loss = lambda mm, bb: F.cross_entropy(mm(bb["x"], None), bb["y"], reduction="none")  # noqa: E731
    r = assert_exact(Model(), loss, b, method="bk", max_grad_norm=0.5)
    assert r.routes["head.weight"] != "vmap" and "vmap" in r.routes.values(), r.routes


def test_linear_is_restored_after_the_step():
    m = _Attn(8, 2, "self", True, True, True, False)
    b = _batch(3, 4, torch.Generator().manual_seed(0))
    orig = F.linear
    pdpsgd.make_dp_step(m, _loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")(pdpsgd.trainable_params(m), b)
    assert F.linear is orig and torch.backends.mha.get_fastpath_enabled()


def test_two_threads_capturing_at_once_are_both_exact():
    """F.linear is replaced by one dispatcher while any thread is inside an attention's forward; each
    thread's calls go to its own capture, and the original is back when the last one leaves."""
    import threading

    orig, errors = F.linear, []

    def work(seed):
        try:
            torch.manual_seed(seed)
            m = _Attn(8, 2, "self" if seed % 2 else "separate", bool(seed % 2), True, True, False)
            for _ in range(3):
                r = assert_exact(m, _loss, _batch(4, 5, torch.Generator().manual_seed(seed)), method="bk",
                                 max_grad_norm=0.5)
                assert "vmap" not in r.routes.values(), r.routes
        except BaseException as err:  # (reported by the main thread)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert F.linear is orig


def test_a_parametrized_input_projection_falls_back_exactly():
    """(Found by review.) A parametrization (or the old weight_norm) removes ``in_proj_weight`` from
    the module's parameters: the rule declines (it raised a KeyError)."""
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    m = _Attn(8, 2, "self", True, True, False, False)
    parametrize.register_parametrization(m.mha, "in_proj_weight", Scale())
    b = _batch(4, 5, torch.Generator().manual_seed(0))
    r = assert_exact(m, _loss, b, method="bk", max_grad_norm=0.5)
    assert r.routes["mha.parametrizations.in_proj_weight.original"] == "vmap", r.routes
    assert r.routes["head.weight"] != "vmap", r.routes


def test_the_dispatcher_stays_callable_and_the_fast_path_flag_is_restored_across_threads():
    """(Found by review.) A reference to F.linear taken by another thread while a capture had the
    dispatcher installed must work after it left; threads entering and leaving the fast-path-off
    blocks in any order put the flag back as it was."""
    import threading

    from pdpsgd._compat import mha_fastpath_off

    seen = []
    m = _Attn(8, 2, "self", True, True, False, False)
    b = _batch(3, 4, torch.Generator().manual_seed(0))
    step = pdpsgd.make_dp_step(m, _loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    orig_forward = nn.Linear.forward

    def grab(self, x):
        seen.append(F.linear)  # (the dispatcher, while the attention's capture is on)
        return orig_forward(self, x)

    nn.Linear.forward = grab
    try:
        step(pdpsgd.trainable_params(m), b)
    finally:
        nn.Linear.forward = orig_forward
    assert any(f is not F.linear for f in seen)  # the dispatcher was seen
    for f in seen:
        f(torch.randn(2, 3), torch.randn(4, 3))  # still callable
    was = torch.backends.mha.get_fastpath_enabled()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with mha_fastpath_off():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def second():
        a_in.wait(5)
        with mha_fastpath_off():
            b_in.set()
            a_out.wait(5)  # leaves after the first thread

    ts = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert torch.backends.mha.get_fastpath_enabled() == was


class _AttentionAcrossExamples(nn.Module):
    """(B, T, d) handed to a MultiheadAttention as its (L, N, E) (or, batch-first, (T, B, d) as its
    (N, L, E)): the attention runs along the examples, each masked to itself, so no example mixes
    with another, but the layer's batch axis holds positions."""

    def __init__(self, batch_first, d=8):
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(d, 2, batch_first=batch_first)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        B = x.shape[0]
        x = x.transpose(0, 1) if self.batch_first else x
        a, _ = self.mha(x, x, x, attn_mask=~torch.eye(B, dtype=torch.bool), need_weights=False)
        a = a.transpose(0, 1) if self.batch_first else a
        return self.head(a.mean(1))


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("BT", [(4, 4), (3, 5), (2, 2)])
def test_a_batch_axis_that_equals_b_by_coincidence_is_probed(batch_first, BT):
    """Review, round 34: with T = B the rule read the positions on its batch axis as examples (the
    batch-dimension probe skipped custom-forward rules): with the order check off, norms 5 % and
    sums 65 % off, and removing one example moved the clipped sum by 1.11 C. The probe now checks
    the axis the rule reads (``Rule.batch_axis``)."""
    B, T = BT
    torch.manual_seed(B * 10 + T)
    model = _AttentionAcrossExamples(batch_first).double()
    b = {"x": torch.randn(B, T, 8, dtype=torch.float64), "y": torch.randint(0, 3, (B,))}

    def loss(m, bb):
        return F.cross_entropy(m(bb["x"]), bb["y"], reduction="none")

    opts = {"check_order": False}
    r = assert_exact(model, loss, b, method="bk", max_grad_norm=0.5, bk_options=opts)
    assert r.routes["mha.in_proj_weight"] == "vmap"
    step = pdpsgd.make_dp_step(model, loss, max_grad_norm=0.5, noise_multiplier=0.0, method="bk", bk_options=opts)
    assert check_sensitivity(step, pdpsgd.trainable_params(model), b).max_ratio <= 1 + 1e-9
