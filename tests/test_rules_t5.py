"""T5's relative attention bias on book-keeping (rules/t5_relative_bias.py): looked up per example
while the engine captures, exact against the naive float64 loop, and the exact fallback whenever the
model's compute_bias is not the lookup the adapter knows."""
import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

import models
import pdpsgd
import pdpsgd.bookkeeping as bk
from pdpsgd.rules import CaptureAdapter, default_registry
from pdpsgd.rules.base import Index
from pdpsgd.rules.t5_relative_bias import is_t5_relative_attention
from pdpsgd.testing import assert_exact, check_sensitivity

V = models.T5_VOCAB
BIAS = "relative_attention_bias"


_t5 = models.tiny_t5
seq2seq_loss = models.t5_loss


def encoder_loss(m, b):
    h = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state  # (B, T, d)
    return (h * b["attention_mask"].unsqueeze(-1)).sum((1, 2)).pow(2)


def _batch(B, T, S, seed, padded=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g) if padded else torch.full((B,), T)
    am = (torch.arange(T)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": am, "labels": torch.randint(1, V, (B, S), generator=g)}


def _bias_routes(r):
    return {n: v for n, v in r.routes.items() if BIAS in n}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.integers(1, 5), T=st.integers(1, 12), S=st.integers(1, 9), seed=st.integers(0, 2**20),
       C=st.sampled_from([1e-3, 0.3, 1e3]), method=st.sampled_from(["bk", "auto"]),
       buckets=st.sampled_from([4, 8, 32]), attn=st.sampled_from(["eager", "sdpa"]))
def test_t5_relative_bias_exact_on_its_rule(B, T, S, seed, C, method, buckets, attn):
    """Encoder (bidirectional buckets) and decoder (causal) tables: per-example norms and clipped sums
    equal the naive float64 loop's, and no parameter of the model takes the vmap fallback."""
    m = _t5(buckets=buckets, attn=attn)
    r = assert_exact(m, seq2seq_loss, _batch(B, T, S, seed), method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    assert len(_bias_routes(r)) == 2 and set(_bias_routes(r).values()) <= {"explicit", "ghost"}, r.routes


def test_attention_gradients_that_cancel_upstream_stay_on_their_rules():
    """(Found by the deep sweep.) Example 0 has one unmasked key, example 1 two equal tokens (equal
    keys and values): the gradients of the encoder's q, k and relative bias, and of the cross
    attention's q and k, cancel in the softmax's backward, before their layers, so the order check
    sees their rounding differ between its runs. 0.03-0.3 ulps of the smallest example's norm:
    negligible, they stay on their rules, exactly. The check saw a difference, so the verdict is
    not a pass: on a later batch of the shape in which those gradients are real they take the exact
    fallback, and on a degenerate one again their rules. (Whether the runs differ at all is the
    CPU's: on AMD EPYC hosts they did; on an Intel Xeon host they are bit-identical, the verdict is a
    pass and nothing falls back on the real batch either. Both branches are asserted.)"""
    m = _t5(buckets=4, attn="eager")
    degenerate = _batch(2, 2, 3, 42)
    assert degenerate["attention_mask"].tolist() == [[1, 0], [1, 1]] and degenerate["input_ids"][1].unique().numel() == 1
    r = assert_exact(m, seq2seq_loss, degenerate, method="bk", max_grad_norm=0.3)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    step = pdpsgd.make_dp_step(m, seq2seq_loss, max_grad_norm=0.3, noise_multiplier=0.0, method="bk")
    params = pdpsgd.trainable_params(m)
    seen = []
    real_disagree = bk._order_disagree

    def spy(*a, **k):
        out = real_disagree(*a, **k)
        seen.append(out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bk, "_order_disagree", spy)
        assert "vmap" not in step.clipped_sum(params, degenerate).routes.values()
    q = "encoder.block.0.layer.0.SelfAttention.q.weight"
    rounding = set().union(*(o[2] for o in seen if o is not None))
    real = {"input_ids": torch.tensor([[3, 12], [5, 22]]), "attention_mask": torch.ones(2, 2, dtype=torch.long),
            "labels": degenerate["labels"]}
    fell = {n for n, v in step.clipped_sum(params, real).routes.items() if v == "vmap"}
    if q in rounding:  # the check's runs differed by rounding on the degenerate batch
        assert q in fell and all(
            ("Attention" in n and n.split(".")[-2] in ("q", "k", BIAS)) or "layer.1.layer_norm" in n for n in fell), fell
    else:
        assert fell <= rounding, (fell, rounding)
    assert "vmap" not in step.clipped_sum(params, degenerate).routes.values()


@settings(max_examples=4, deadline=None, derandomize=True)
@given(B=st.integers(2, 4), T=st.integers(2, 40), seed=st.integers(0, 2**20))
def test_t5_encoder_long_sequences_exact(B, T, seed):
    """Long sequences (T² positions over 8 buckets: the per-example tables, not the equal-ids mask),
    two layers sharing the first one's bias, encoder only, untied."""
    m = _t5(layers=2, tie=False, encoder_only=True)
    r = assert_exact(m, encoder_loss, _batch(B, T, 1, seed), method="bk", max_grad_norm=0.5)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes


@settings(max_examples=6, deadline=None, derandomize=True)
@given(B=st.integers(1, 4), T=st.integers(2, 14), S=st.integers(1, 5), seed=st.integers(0, 2**20),
       attention=st.sampled_from(["local", "transient-global"]), radius=st.integers(1, 3),
       method=st.sampled_from(["bk", "auto"]))
def test_longt5_block_local_bias_exact_on_its_rule(B, T, S, seed, attention, radius, method):
    """LongT5's local / transient-global encoder attention: its relative bias table (looked up as
    (1, 1, H, block_len, 3·block_len), broadcast over the blocks) and the transient-global side
    bias (looked up per example) are on their rules, exact (before: the exact fallback, which
    vmap cannot run on LongT5: the step failed)."""
    m = models.tiny_longt5(attention=attention, radius=radius)
    r = assert_exact(m, seq2seq_loss, _batch(B, T, S, seed), method=method, max_grad_norm=0.3)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes


def test_t5_relative_bias_clipped_contribution_bounded():
    """Every example's clipped contribution, the bias tables included, is at most C; and changing one
    example moves the clipped sum by at most 2C (one contribution out, another in)."""
    m = _t5()
    b = _batch(4, 9, 5, seed=3, padded=False)
    params = pdpsgd.trainable_params(m)
    C = 0.01
    step = pdpsgd.make_dp_step(m, seq2seq_loss, max_grad_norm=C, noise_multiplier=0.0, method="bk")
    for i in range(4):
        mask = torch.zeros(4, dtype=torch.bool)
        mask[i] = True
        s = step.clipped_sum(params, b, mask=mask).sums
        assert float(s[f"encoder.block.0.layer.0.SelfAttention.{BIAS}.weight"].abs().sum()) > 0  # it is trained
    b2 = {k: v.clone() for k, v in b.items()}
    b2["input_ids"][2] = torch.randint(1, V, (9,), generator=torch.Generator().manual_seed(9))
    r = check_sensitivity(step, params, b, neighbour=b2)  # alone ≤ C, remove one ≤ C, replace ≤ 2C
    assert r.differing == (2,) and float(r.contributions.min()) > C * (1 - 1e-5)  # (every example clipped)


def test_without_the_adapter_the_bias_falls_back_and_stays_exact():
    """The adapter is what puts the tables on a rule: a registry without it sends them to the exact
    fallback (the previous behaviour), with the reason named."""
    from pdpsgd.rules.registry import RuleRegistry

    reg = default_registry()
    bare = RuleRegistry()
    bare._by_type, bare._predicates = dict(reg._by_type), list(reg._predicates)  # (the same rules, no adapters)
    m = _t5()
    r = assert_exact(m, seq2seq_loss, _batch(3, 6, 4, seed=1), method="bk", bk_options={"registry": bare})
    assert set(_bias_routes(r).values()) == {"vmap"}, r.routes


class _Scaled:
    """compute_bias variants the adapter must not take for the lookup it knows."""

    @staticmethod
    def doubled(self, *a, **k):
        return 2 * type(self).__mro__[1].compute_bias(self, *a, **k)

    @staticmethod
    def detached(self, *a, **k):
        return type(self).__mro__[1].compute_bias(self, *a, **k).detach()

    @staticmethod
    def twice(self, *a, **k):  # two lookups
        x = type(self).__mro__[1].compute_bias(self, *a, **k)
        return 0.5 * (x + type(self).__mro__[1].compute_bias(self, *a, **k))

    @staticmethod
    def gradient_scaled(self, *a, **k):  # the same values, three times the gradient: the adjoint check sees it
        x = type(self).__mro__[1].compute_bias(self, *a, **k)
        return x + (2 * x - 2 * x.detach())

    @staticmethod
    def first_gradient_scaled(self, *a, **k):  # equal values, element [0, 0, 0, 0]'s gradient ×3
        x = type(self).__mro__[1].compute_bias(self, *a, **k)
        m = torch.zeros(x.shape, dtype=x.dtype)
        m[0, 0, 0, 0] = 2.0
        return x + m * (x - x.detach())

    @staticmethod
    def flipped(self, *a, **k):  # the same values' multiset, other places: the values check sees it
        return type(self).__mro__[1].compute_bias(self, *a, **k).flip(-1)

    @staticmethod
    def shifted(self, *a, **k):  # the lookup plus a key-dependent constant: same adjoint, other values
        x = type(self).__mro__[1].compute_bias(self, *a, **k)
        return x + torch.linspace(0, 1, x.shape[-1], dtype=x.dtype)


@pytest.mark.parametrize("variant", ["doubled", "detached", "twice", "gradient_scaled", "first_gradient_scaled",
                                     "flipped", "shifted", "shifted_B1"])
def test_a_compute_bias_other_than_the_lookup_falls_back_exactly(variant):
    """A model whose compute_bias is not the permuted lookup (scaled, cut off the gradient, two
    lookups, the gradient scaled behind equal values, positions moved, values shifted) gets its
    tables by the exact fallback, never a wrong per-example gradient. At B = 1 (no example-order
    check) the adapter's values check alone keeps the model's forward as it is (mutation review,
    round 41: without it the shift was dropped from the forward, 6 % off)."""
    B = 1 if variant.endswith("_B1") else 3
    variant = variant.replace("_B1", "")
    from transformers.models.t5 import modeling_t5 as mt5

    sub = type("PatchedT5Attention", (mt5.T5Attention,), {"compute_bias": getattr(_Scaled, variant)})
    m = _t5()
    for mod in m.modules():
        if isinstance(mod, mt5.T5Attention):
            mod.__class__ = sub
    assert any(is_t5_relative_attention(mod) for mod in m.modules())
    b = _batch(B, 6, 4, seed=2)
    r = assert_exact(m, seq2seq_loss, b, method="bk")
    routes = _bias_routes(r)
    if variant == "detached":  # no gradient reaches the tables at all: their clipped sums are exactly 0
        step = pdpsgd.make_dp_step(m, seq2seq_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
        sums = step.clipped_sum(pdpsgd.trainable_params(m), b).sums
        assert all(not bool(sums[n].any()) for n in routes), routes
    elif B > 1:  # (at B = 1 the lookup inside the original compute_bias may stay on the embedding rule)
        assert set(routes.values()) == {"vmap"}, routes


def test_adapter_is_removed_after_the_step_and_on_error():
    m = _t5()
    b = _batch(2, 5, 3, seed=4)
    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, seq2seq_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    step.clipped_sum(params, b)
    assert not any("compute_bias" in mod.__dict__ for mod in m.modules())

    def bad_loss(mm, bb):
        seq2seq_loss(mm, bb)
        raise KeyError("boom")

    step2 = pdpsgd.make_dp_step(m, bad_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk")
    with pytest.raises(KeyError):
        step2.clipped_sum(params, b)
    assert not any("compute_bias" in mod.__dict__ for mod in m.modules())
    assert not any(BIAS in mod.__dict__ for mod in m.modules())


def test_t5_with_gradient_checkpointing_in_train_mode_exact():
    """Hugging Face activation checkpointing (non-reentrant), in train mode where it checkpoints
    (dropout 0): the recomputed blocks run the adapter again; exact against the naive loop on the
    same model without checkpointing."""
    from pdpsgd.testing import to_float64

    models.assert_checkpointed_exact(to_float64(_t5(layers=2)).train(), seq2seq_loss, to_float64(_batch(3, 7, 4, seed=5)))


def test_registry_refuses_silent_adapter_overwrite():
    reg = default_registry()
    a = reg.adapter_for(_t5().encoder.block[0].layer[0].SelfAttention)
    assert a is not None and a.name == "t5_relative_bias"
    with pytest.raises(ValueError, match="exists"):
        reg.register_adapter("t5_relative_bias", is_t5_relative_attention, a)
    reg.register_adapter("t5_relative_bias", is_t5_relative_attention, a, override=True)
    with pytest.raises(TypeError, match="CaptureAdapter"):
        reg.register_adapter("x", is_t5_relative_attention, object())
    with pytest.raises(ValueError, match="names no method"):
        reg.register_adapter("y", is_t5_relative_attention, CaptureAdapter())
    assert reg.copy().adapter_for(_t5().decoder.block[0].layer[0].SelfAttention) is a


@settings(max_examples=25, deadline=None, derandomize=True)
@given(B=st.integers(1, 4), T=st.integers(1, 30), S=st.integers(1, 30), rows=st.integers(1, 12),
       d=st.integers(1, 5), seed=st.integers(0, 2**20))
def test_index_inner_tables_equal_equal_ids_mask(B, T, S, rows, d, seed):
    """⟨G_u, G_v⟩ of two index uses: the per-example tables (many positions, few rows) and the
    equal-ids mask give the same values, float64."""
    g = torch.Generator().manual_seed(seed)
    u = Index(torch.randint(0, rows, (B, T), generator=g), torch.randn(B, T, d, generator=g, dtype=torch.float64), rows)
    v = Index(torch.randint(0, rows, (B, S), generator=g), torch.randn(B, S, d, generator=g, dtype=torch.float64), rows)
    shape = torch.Size([rows, d])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bk, "INDEX_GHOST_MAX_RATIO", 10**9)
        mask_uv, mask_uu = bk._inner(u, v, shape, torch.float64), bk._inner(u, u, shape, torch.float64)
        mp.setattr(bk, "INDEX_GHOST_MAX_RATIO", 0)
        tab_uv, tab_uu = bk._inner(u, v, shape, torch.float64), bk._inner(u, u, shape, torch.float64)
    naive_u = torch.zeros(B, rows, d, dtype=torch.float64).scatter_add_(1, u.ids.unsqueeze(-1).expand(B, T, d), u.R)
    naive_v = torch.zeros(B, rows, d, dtype=torch.float64).scatter_add_(1, v.ids.unsqueeze(-1).expand(B, S, d), v.R)
    want_uv, want_uu = (naive_u * naive_v).sum((1, 2)), (naive_u * naive_u).sum((1, 2))
    for got, want in ((mask_uv, want_uv), (tab_uv, want_uv), (mask_uu, want_uu), (tab_uu, want_uu)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_an_instance_level_compute_bias_is_left_alone():
    """A compute_bias the user set on the module itself is not replaced (the adapter knows only the
    class's): that table takes the exact fallback, the other stays on its rule."""
    m = _t5()
    att = m.encoder.block[0].layer[0].SelfAttention
    att.compute_bias = types.MethodType(type(att).compute_bias, att)  # (rebound to the copy by deepcopy)
    r = assert_exact(m, seq2seq_loss, _batch(3, 6, 4, seed=6), method="bk")
    assert _bias_routes(r) == {f"encoder.block.0.layer.0.SelfAttention.{BIAS}.weight": "vmap",
                               f"decoder.block.0.layer.0.SelfAttention.{BIAS}.weight": "explicit"}, r.routes
    assert "compute_bias" in att.__dict__  # (still the user's)


def test_a_model_whose_inner_batch_is_not_b_runs_without_the_adapter():
    """Multiple choice run as (B·C, T) rows, and a per-example loop inside the loss: the adapter's
    (B, H, T, T) bias does not fit their inner batch, so the capture runs again without adapters and
    the table takes the exact fallback (memoised: a second step does not try again)."""
    m = _t5(encoder_only=True)

    def choices_loss(mm, b):  # 2 choices per example
        B, T = b["input_ids"].shape
        ids = torch.stack([b["input_ids"], b["input_ids"].flip(1)], 1).reshape(2 * B, T)
        am = b["attention_mask"].repeat_interleave(2, 0)
        return mm(input_ids=ids, attention_mask=am).last_hidden_state.reshape(B, 2, T, -1).sum((2, 3)).logsumexp(1)

    def loop_loss(mm, b):
        return torch.cat([encoder_loss(mm, {k: v[i:i + 1] for k, v in b.items()}) for i in range(b["input_ids"].shape[0])])

    for fn in (choices_loss, loop_loss):
        r = assert_exact(m, fn, _batch(4, 6, 1, seed=7), method="bk")
        assert set(_bias_routes(r).values()) == {"vmap"}, r.routes
    calls = []
    orig = bk._collect_once

    def counted(*a, **k):
        calls.append(bk._ADAPTERS_OFF.get())
        return orig(*a, **k)

    step = pdpsgd.make_dp_step(m, choices_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk",
                               bk_options={"check_order": False})
    b = _batch(4, 6, 1, seed=8)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bk, "_collect_once", counted)
        step.clipped_sum(pdpsgd.trainable_params(m), b)
        first = list(calls)
        calls.clear()
        step.clipped_sum(pdpsgd.trainable_params(m), b)
    assert first[:2] == [False, True] and calls and all(calls), (first, calls)


def test_index_tables_keep_the_cancellation_guard():
    """Float32, the per-example tables' path (2 rows, T² > 4·rows·d): an example whose own table row
    cancels exactly (+M and -M on one row: norm 0) must not escape its clip through the clipped sum,
    which is taken from the factors (where its ±M wipes out the other examples' rows): with it and
    without it, the clipped sums differ by at most C."""
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(2, 1)
            with torch.no_grad():
                self.emb.weight.fill_(1.0)

        def forward(self, ids, coef):
            return (self.emb(ids)[..., 0] * coef).sum(1)  # loss_i = Σ_t coef[i, t] W[ids[i, t]]

    B, T, C = 64, 8, 1.0
    ids = torch.zeros(B, T, dtype=torch.long)
    coef = torch.zeros(B, T)
    coef[:, 0] = 1.0 / 8
    coef[-1, 0], coef[-1, 1] = 1e12, -1e12
    b = {"ids": ids, "coef": coef}
    m = M()
    loss = lambda mm, bb: mm(bb["ids"], bb["coef"])  # noqa: E731
    p = pdpsgd.trainable_params(m)
    keep = torch.ones(B, dtype=torch.bool)
    keep[-1] = False
    for kw in ({"method": "bk", "bk_options": {"routes": {"emb.weight": "ghost"}}}, {"method": "auto"}):
        step = pdpsgd.make_dp_step(m, loss, max_grad_norm=C, noise_multiplier=0.0, **kw)
        full, without = step.clipped_sum(p, b), step.clipped_sum(p, b, mask=keep)
        assert full.routes["emb.weight"] == "ghost"
        assert float((full.sums["emb.weight"] - without.sums["emb.weight"]).norm()) <= C * (1 + 1e-6)
        # its norm is the guard's bound Σ_t ‖e_id_t‖‖R_t‖ = 2e12 (mutation review, round 40: a bound a
        # quarter of that, or 1e-6 of it, kept the sums within C here but clipped the example too little)
        assert float(full.per_sample_norms[-1]) == pytest.approx(2e12, rel=1e-6)


def test_index_tables_only_where_smaller_than_the_mask():
    """T5's bias buckets (32 rows × 12 heads at T² positions) take the tables; a word embedding
    (32000 × 512 at T = 512, or GPT-2's vocabulary at T = 1024) keeps the (B, T, T) mask."""
    def use(T, rows, d):
        return Index(torch.zeros(1, T, dtype=torch.long), torch.zeros(1, T, d), rows)

    t5 = use(128 * 128, 32, 12)
    assert bk._index_tables(t5, t5)
    for T, rows, d in ((512, 32000, 512), (1024, 50257, 768), (2048, 32000, 4096)):
        u, v = use(T, rows, d), use(T, rows, d)
        assert not bk._index_tables(u, u) and not bk._index_tables(u, v)
