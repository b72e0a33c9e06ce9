"""DeBERTa v1 (``transformers.models.deberta``) on book-keeping (rules/deberta_v1.py): its own
LayerNorm class, the attention's raw q/v biases and the relative positions (made per example while
the engine captures) on their rules, exact against the naive float64 loop with no fallback; the
model's own values in training mode (one position-dropout mask); and the exact fallback wherever the
model's code is not the code the rules know."""
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import models
import pdpsgd
import pdpsgd.bookkeeping as bk
from pdpsgd.rules import deberta_v1, default_registry
from pdpsgd.rules.deberta_v1 import is_deberta_layernorm, is_deberta_v1_attention
from pdpsgd.testing import assert_exact, check_sensitivity

V = models.DEBERTA_VOCAB


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
    clipped sums equal the naive float64 loop's, and no parameter takes the vmap fallback."""
    m = models.tiny_deberta_v1(relative=relative, pos_att_type=att)
    r = assert_exact(m, models.deberta_loss, _batch(B, T, seed, padded), method=method, max_grad_norm=C)
    assert not _vmap(r), _vmap(r)
    assert not relative or "deberta.encoder.rel_embeddings.weight" in r.routes
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
    assert deberta_v1.is_deberta_v1_rel_encoder(m.deberta.encoder)


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


def _run_by_the_rule(m):
    """Each attention's forward as the engine runs it while capturing (its rule's forward)."""
    rule = default_registry().lookup(m.deberta.encoder.layer[0].attention.self)
    assert isinstance(rule, deberta_v1.DebertaV1AttentionBiasRule)
    atts = [x for x in m.modules() if type(x).__name__ == "DisentangledSelfAttention"]
    for a in atts:
        a.__dict__["forward"] = bk._Wrapped(functools.partial(bk._probe_custom_forward, rule, a), a, rule)
    return atts


def test_train_mode_values_are_the_models_own():
    """With dropout, the adapted forward (the per-example table, one position-dropout mask for every
    example from the same draws) gives the model's own logits for the same generator state; the
    table is (B, 2k, d) only while the rule runs every attention."""
    m = models.tiny_deberta_v1(dropout=0.3).double().train()
    b = _batch(4, 9, 3)
    torch.manual_seed(11)
    want = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    with bk._adapted(m, default_registry(), 4):
        assert m.deberta.encoder.get_rel_embedding().dim() == 2  # (the attentions run as written)
        atts = _run_by_the_rule(m)
        try:
            assert m.deberta.encoder.get_rel_embedding().shape[0] == 4
            torch.manual_seed(11)
            got = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        finally:
            for a in atts:
                a.__dict__.pop("forward")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert type(got) is torch.Tensor
    assert not any(k in mod.__dict__ for mod in m.modules()
                   for k in ("forward", "get_rel_embedding", "pos_dropout", "disentangled_att_bias"))


def test_train_mode_step_stays_on_the_rules_and_bounded():
    """Train mode, dropout 0.1: no fallback, and replacing one example moves the clipped sum by at most 2C."""
    m = models.tiny_deberta_v1(dropout=0.1).train()
    C = 0.5
    step = pdpsgd.make_dp_step(m, models.deberta_loss, max_grad_norm=C, noise_multiplier=0.0, method="bk")
    params = pdpsgd.trainable_params(m)
    b = _batch(5, 10, 4)
    b2 = {k: v.clone() for k, v in b.items()}
    b2["input_ids"][2] = torch.randint(1, V, (10,), generator=torch.Generator().manual_seed(9))
    for bb in (b, b2, b):  # (the first step of a shape runs the engine's probes)
        p1 = step.clipped_sum(params, bb)
        assert "vmap" not in p1.routes.values(), p1.routes
    assert float(p1.per_sample_norms.max()) > C  # (clipping is active)
    r = check_sensitivity(step, params, b, neighbour=b2, seed=5)  # alone ≤ C, remove one ≤ C, replace ≤ 2C
    assert r.differing == (2,)


def test_other_disentangled_att_bias_falls_back_exactly():
    """An attention whose disentangled_att_bias is not the known code (the same, doubled) is not the
    rule's: its q/v biases and the relative-position parameters (the encoder's adapter sees an
    attention its rule does not run) take the exact fallback."""
    from transformers.models.deberta import modeling_deberta as md

    def doubled(self, *a, **k):
        return 2 * md.DisentangledSelfAttention.disentangled_att_bias(self, *a, **k)

    sub = type("PatchedAttention", (md.DisentangledSelfAttention,), {"disentangled_att_bias": doubled})
    m = models.tiny_deberta_v1()
    m.deberta.encoder.layer[1].attention.self.__class__ = sub
    r = assert_exact(m, models.deberta_loss, _batch(3, 7, 5), method="bk", max_grad_norm=0.3)
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap", r.routes
    assert r.routes["deberta.encoder.layer.1.attention.self.q_bias"] == "vmap"
    assert r.routes["deberta.encoder.layer.0.attention.self.q_bias"] != "vmap"


def test_frozen_attention_biases_leave_the_table_to_the_model():
    """With q/v biases frozen no rule runs the attentions: the encoder's adapter returns the model's
    own (2k, d) table and the relative-position parameters take the exact fallback."""
    m = models.tiny_deberta_v1()
    for n, p in m.named_parameters():
        if n.endswith(("q_bias", "v_bias")):
            p.requires_grad_(False)
    r = assert_exact(m, models.deberta_loss, _batch(3, 7, 6), method="bk", max_grad_norm=0.3)
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap", r.routes
    assert "deberta.encoder.layer.0.attention.self.q_bias" not in r.routes


def test_per_example_table_refused_where_the_rule_cannot_take_it():
    """Handed the per-example table on a call it does not take (query_states), or for another batch,
    the rule raises instead of letting the model's code read (B, 2k, d) as (2k, d)."""
    m = models.tiny_deberta_v1()
    att = m.deberta.encoder.layer[0].attention.self
    table = torch.randn(2, 80, 16).as_subclass(deberta_v1._PerExampleTable)
    hs, mask = torch.randn(2, 5, 16), torch.ones(2, 1, 5, 5)
    rule = deberta_v1.DebertaV1AttentionBiasRule()
    with pytest.raises(ValueError, match="per-example position table"):
        rule.forward(att, (hs, mask), {"query_states": hs, "rel_embeddings": table})
    with pytest.raises(ValueError, match="attention batch of 3"):
        rule.forward(att, (torch.randn(3, 5, 16), torch.ones(3, 1, 5, 5)), {"rel_embeddings": table})


def test_in_proj_output_used_elsewhere_stays_exact():
    """A user's forward hook on in_proj keeps its output for an auxiliary loss: the biases' gradients
    come from the attention's own use of that output only (found by review: they took the aux term)."""
    m = models.tiny_deberta_v1()
    ip = m.deberta.encoder.layer[0].attention.self.in_proj
    kept = []
    ip.register_forward_hook(lambda mod, inp, out: kept.append(out))
    with torch.no_grad():
        for layer in m.deberta.encoder.layer:
            layer.attention.self.q_bias.normal_()
            layer.attention.self.v_bias.normal_()

    def aux_loss(mm, b):
        kept.clear()
        ce = models.deberta_loss(mm, b)
        return ce + 0.3 * kept[-1].pow(2).sum((1, 2))

    r = assert_exact(m, aux_loss, _batch(3, 7, 1), method="bk", max_grad_norm=0.3)
    assert r.routes["deberta.encoder.layer.0.attention.self.q_bias"] != "vmap"


def test_class_level_patch_of_the_bias_method_falls_back(monkeypatch):
    """A patch of ``DisentangledSelfAttention.disentangled_att_bias`` on transformers' own class (name
    and module unchanged) is not the known code: the attentions are not the rule's, exact fallback
    (found by review: the fingerprint of that method was recorded but not checked)."""
    from transformers.models.deberta import modeling_deberta as md

    orig = md.DisentangledSelfAttention.disentangled_att_bias

    def disentangled_att_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        return 2 * orig(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor)

    monkeypatch.setattr(md.DisentangledSelfAttention, "disentangled_att_bias", disentangled_att_bias)
    m = models.tiny_deberta_v1()
    assert not is_deberta_v1_attention(m.deberta.encoder.layer[0].attention.self)
    r = assert_exact(m, models.deberta_loss, _batch(3, 7, 5), method="bk", max_grad_norm=1e3)
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap"
    assert r.routes["deberta.encoder.layer.0.attention.self.q_bias"] == "vmap"


def test_patched_layer_code_leaves_the_table_to_the_model(monkeypatch):
    """The code between the encoder and the attentions (encoder, layer and attention-block forwards)
    only hands the table on; a patched one might read it as (2k, d): the encoder's adapter is not
    installed, and the relative-position parameters take the exact fallback (review: not checked before)."""
    from transformers.models.deberta import modeling_deberta as md

    orig = md.DebertaLayer.forward

    def forward(self, *a, **k):
        return orig(self, *a, **k)

    monkeypatch.setattr(md.DebertaLayer, "forward", forward)
    m = models.tiny_deberta_v1()
    assert not deberta_v1.is_deberta_v1_rel_encoder(m.deberta.encoder)
    r = assert_exact(m, models.deberta_loss, _batch(3, 7, 8), method="bk", max_grad_norm=0.3)
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap"
    assert r.routes["deberta.encoder.layer.0.attention.self.q_bias"] != "vmap"
