"""DeBERTa v1 (``transformers.models.deberta``) on book-keeping (rules/deberta_v1.py): its own
LayerNorm class and the attention's raw q/v biases on their rules, exact against the naive float64
loop; the relative positions (a raw table projected batch-free) on the exact fallback; and the
exact fallback wherever the model's code is not the code the rules know."""
import torch
from hypothesis import given, settings, strategies as st

import models
import pdpsgd
from pdpsgd.rules import deberta_v1
from pdpsgd.rules.deberta_v1 import is_deberta_layernorm, is_deberta_v1_attention
from pdpsgd.testing import assert_exact

V = models.DEBERTA_VOCAB
REL = ("rel_embeddings", "pos_proj", "pos_q_proj")


def _batch(B, T, seed, padded=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g) if padded else torch.full((B,), T)
    return {"input_ids": torch.randint(1, V, (B, T), generator=g),
            "attention_mask": (torch.arange(T)[None] < lengths[:, None]).long(),
            "labels": torch.randint(0, 3, (B,), generator=g),
            "mlm_labels": torch.randint(0, V, (B, T), generator=g)}


def _vmap(r):
    return sorted(n for n, v in r.routes.items() if v == "vmap")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(B=st.integers(1, 5), T=st.integers(1, 20), seed=st.integers(0, 2**20), C=st.sampled_from([1e-3, 0.3, 1e3]),
       method=st.sampled_from(["bk", "auto"]), relative=st.booleans(),
       att=st.sampled_from([("c2p", "p2c"), ("c2p",), ("p2c",)]), padded=st.booleans())
def test_deberta_v1_exact_on_its_rules(B, T, seed, C, method, relative, att, padded):
    """Absolute or relative positions, either attention type, padded or not: per-example norms and
    clipped sums equal the naive float64 loop's; every DebertaLayerNorm and q/v bias is on its rule,
    and only the relative-position table and projections take the vmap fallback."""
    m = models.tiny_deberta_v1(relative=relative, pos_att_type=att)
    r = assert_exact(m, models.deberta_loss, _batch(B, T, seed, padded), method=method, max_grad_norm=C)
    assert all(any(k in n for k in REL) for n in _vmap(r)), _vmap(r)
    assert relative or not _vmap(r)
    for n in ("deberta.encoder.layer.0.attention.self.q_bias", "deberta.encoder.layer.1.attention.self.v_bias",
              "deberta.embeddings.LayerNorm.weight", "deberta.encoder.layer.1.output.LayerNorm.bias"):
        assert r.routes[n] != "vmap", (n, r.routes[n])


def test_deberta_v1_masked_lm_exact():
    """The masked-LM head (its transform's DebertaLayerNorm, the decoder tied to the word embeddings)."""
    m = models.tiny_deberta_v1(relative=False, kind="DebertaForMaskedLM")
    r = assert_exact(m, models.deberta_mlm_loss, _batch(3, 9, 5), method="bk", max_grad_norm=0.5)
    assert not _vmap(r), _vmap(r)


def test_the_rules_apply_to_the_installed_deberta_v1():
    """The fingerprints match the transformers CI installs: if this fails after raising the pin, the
    rules decline (exact fallback, slower); check the new code and record its fingerprints."""
    m = models.tiny_deberta_v1()
    norms = [x for x in m.modules() if type(x).__name__ == "DebertaLayerNorm"]
    atts = [x for x in m.modules() if type(x).__name__ == "DisentangledSelfAttention"]
    assert norms and all(is_deberta_layernorm(x) for x in norms)
    assert atts and all(is_deberta_v1_attention(x) for x in atts)


def test_unknown_code_takes_the_exact_fallback(monkeypatch):
    """Other code than the rules know (here: other fingerprints): the layers fall back, still exact."""
    m = models.tiny_deberta_v1(relative=False)
    monkeypatch.setitem(deberta_v1._KNOWN, "DisentangledSelfAttention.forward", "0" * 64)
    monkeypatch.setitem(deberta_v1._KNOWN, "DebertaLayerNorm.forward", "0" * 64)
    r = assert_exact(m, models.deberta_loss, _batch(3, 6, 1), method="bk", max_grad_norm=0.3)
    assert r.routes["deberta.encoder.layer.0.attention.self.q_bias"] == "vmap"
    assert r.routes["deberta.embeddings.LayerNorm.weight"] == "vmap"


def test_query_states_calls_are_declined():
    """DeBERTa's enhanced-mask-decoder path calls an attention with ``query_states``, where in_proj is
    not called (the model's own code for it fails on batched input in transformers 5.24): the rule
    declines such a call before running anything (the engine then runs the layer as written and its
    q/v biases take the exact fallback)."""
    m = models.tiny_deberta_v1(relative=False)
    att = m.deberta.encoder.layer[0].attention.self
    hs = torch.randn(2, 5, 16)
    rule = deberta_v1.DebertaV1AttentionBiasRule()
    assert rule.forward(att, (hs, torch.ones(2, 1, 5, 5)), {"query_states": hs}) is None
    out, cap = rule.forward(att, (hs, torch.ones(2, 1, 5, 5)), {})
    assert len(cap.targets) == 1 and cap.targets[0].shape == (2, 5, 48)
    torch.testing.assert_close(out[0], att(hs, torch.ones(2, 1, 5, 5))[0], rtol=0, atol=0)


def test_train_mode_clip_bound_and_values():
    """In training mode (dropout): the step runs the attention's own forward, so the loss it captures
    is the model's for the same generator state, and every example's clipped contribution is ≤ C."""
    m = models.tiny_deberta_v1(relative=True, dropout=0.3).double().train()
    b = _batch(4, 8, 3)
    step = pdpsgd.make_dp_step(m, models.deberta_loss, max_grad_norm=0.05, noise_multiplier=0.0, method="bk")
    params = {n: p.detach() for n, p in m.named_parameters()}
    out = step.clipped_sum(params, b)
    assert out.routes["deberta.encoder.layer.0.attention.self.q_bias"] != "vmap"
    norms = out.norms if hasattr(out, "norms") else None
    if norms is not None:
        assert torch.isfinite(norms).all()
    tot = sum(s.double().pow(2).sum() for s in out.sums.values()).sqrt()
    assert float(tot) <= 4 * 0.05 * (1 + 1e-9)
