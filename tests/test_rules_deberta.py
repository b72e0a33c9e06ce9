"""DeBERTa-v2/v3's relative position embeddings on book-keeping (rules/deberta_relative.py): made per
example while the engine captures, exact against the naive float64 loop with no fallback, the
model's own values (dropout included), and the exact fallback whenever the model's code is not the
code the adapters know."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import models
import pdpsgd
import pdpsgd.bookkeeping as bk
from pdpsgd.rules import default_registry
from pdpsgd.rules.deberta_relative import is_deberta_attention, is_deberta_rel_encoder
from pdpsgd.testing import assert_exact, check_sensitivity

V = models.DEBERTA_VOCAB
loss = models.deberta_loss
REL = ("rel_embeddings", "encoder.LayerNorm", "query_proj", "key_proj", "pos_key_proj", "pos_query_proj")


def _batch(B, T, seed, padded=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g) if padded else torch.full((B,), T)
    return {"input_ids": torch.randint(1, V, (B, T), generator=g),
            "attention_mask": (torch.arange(T)[None] < lengths[:, None]).long(),
            "labels": torch.randint(0, 3, (B,), generator=g)}


def _rel_routes(r):
    return {n: v for n, v in r.routes.items() if any(k in n for k in REL)}


@settings(max_examples=14, deadline=None, derandomize=True)
@given(B=st.integers(1, 5), T=st.integers(1, 24), seed=st.integers(0, 2**20), C=st.sampled_from([1e-3, 0.3, 1e3]),
       method=st.sampled_from(["bk", "auto"]), share=st.booleans(),
       att=st.sampled_from([("p2c", "c2p"), ("c2p",), ("p2c",)]), buckets=st.sampled_from([-1, 4, 8, 32]),
       norm=st.sampled_from(["layer_norm", "none"]))
def test_deberta_relative_positions_exact_on_their_rules(B, T, seed, C, method, share, att, buckets, norm):
    """Shared or separate position projections, either attention type, bucketed (log buckets where
    T > buckets) or plain positions, with or without the embeddings' layer norm: per-example norms and
    clipped sums equal the naive float64 loop's, and no parameter takes the vmap fallback."""
    m = models.tiny_deberta(share_att_key=share, pos_att_type=att, buckets=buckets, norm_rel_ebd=norm)
    r = assert_exact(m, loss, _batch(B, T, seed), method=method, max_grad_norm=C)
    assert "vmap" not in r.routes.values(), r.routes
    assert "deberta.encoder.rel_embeddings.weight" in _rel_routes(r)


def test_the_adapters_apply_to_the_installed_deberta():
    """The fingerprints match the transformers CI installs: if this fails after raising the pin, the
    adapters decline (exact fallback, slower); check the new code and record its fingerprints."""
    m = models.tiny_deberta()
    assert is_deberta_rel_encoder(m.deberta.encoder)
    assert all(is_deberta_attention(layer.attention.self) for layer in m.deberta.encoder.layer)


def test_train_mode_values_are_the_models_own():
    """With dropout, the adapted forward (position dropout: one mask for every example, from the
    same draws) gives the model's own logits for the same generator state; its per-example prefix
    is (B, 2k, d) only while the engine captures."""
    m = models.tiny_deberta(dropout=0.3).double().train()
    b = _batch(4, 9, seed=3)
    torch.manual_seed(11)
    want = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    with bk._adapted(m, default_registry(), 4):
        assert m.deberta.encoder.get_rel_embedding().shape[0] == 4
        torch.manual_seed(11)
        got = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert m.deberta.encoder.get_rel_embedding().dim() == 2
    assert not any(k in mod.__dict__ for mod in m.modules()
                   for k in ("forward", "get_rel_embedding", "pos_dropout", "disentangled_attention_bias"))


def test_train_mode_step_stays_on_the_rules_and_bounded():
    """Train mode, dropout 0.1: the step takes no fallback (the shared position mask does not depend
    on the example order), and replacing one example moves the clipped sum by at most 2C."""
    m = models.tiny_deberta(dropout=0.1).train()
    C = 0.5
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=C, noise_multiplier=0.0, method="bk")
    params = pdpsgd.trainable_params(m)
    b = _batch(5, 10, seed=4)
    b2 = {k: v.clone() for k, v in b.items()}
    b2["input_ids"][2] = torch.randint(1, V, (10,), generator=torch.Generator().manual_seed(9))
    for bb in (b, b2, b):  # (the first step of a shape runs the engine's probes)
        p1 = step.clipped_sum(params, bb)
        assert "vmap" not in p1.routes.values(), p1.routes
    assert float(p1.per_sample_norms.max()) > C  # (clipping is active)
    r = check_sensitivity(step, params, b, neighbour=b2, seed=5)  # alone ≤ C, remove one ≤ C, replace ≤ 2C
    assert r.differing == (2,)


def test_code_other_than_the_known_falls_back_exactly():
    """A DeBERTa whose disentangled_attention_bias is not the known code (here: the same, doubled)
    is left as it is: the encoder's adapter sees attentions without the other adapter and returns
    the model's own (2k, d) embeddings; the relative-position parameters take the exact fallback."""
    from transformers.models.deberta_v2 import modeling_deberta_v2 as md

    def doubled(self, *a, **k):
        return 2 * md.DisentangledSelfAttention.disentangled_attention_bias(self, *a, **k)

    sub = type("PatchedAttention", (md.DisentangledSelfAttention,), {"disentangled_attention_bias": doubled})
    m = models.tiny_deberta()
    for mod in m.modules():
        if isinstance(mod, md.DisentangledSelfAttention):
            mod.__class__ = sub
    assert not any(is_deberta_attention(mod) for mod in m.modules()) and is_deberta_rel_encoder(m.deberta.encoder)
    r = assert_exact(m, loss, _batch(3, 7, seed=5), method="bk")
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap", r.routes


def test_multiple_choice_runs_without_the_adapters():
    """Multiple choice runs the encoder on (B·C, T) rows: the per-example (B, 2k, d) embeddings do
    not fit its attention's batch, so the capture runs again without adapters: exact, on the fallback."""
    m = models.tiny_deberta(kind="DebertaV2ForMultipleChoice")

    def choices_loss(mm, b):  # 2 choices per example
        ids = torch.stack([b["input_ids"], b["input_ids"].flip(1)], 1)
        am = torch.stack([b["attention_mask"], b["attention_mask"]], 1)
        logits = mm(input_ids=ids, attention_mask=am).logits  # (B, 2)
        return torch.nn.functional.cross_entropy(logits, b["labels"] % 2, reduction="none")

    r = assert_exact(m, choices_loss, _batch(3, 6, seed=6, padded=False), method="bk")
    assert r.routes["deberta.encoder.rel_embeddings.weight"] == "vmap", r.routes


def test_adapters_are_removed_after_the_step_and_on_error():
    m = models.tiny_deberta()
    b = _batch(2, 5, seed=7)
    params = pdpsgd.trainable_params(m)
    names = ("forward", "get_rel_embedding", "pos_dropout", "disentangled_attention_bias")
    pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk").clipped_sum(params, b)
    assert not any(k in mod.__dict__ for mod in m.modules() for k in names)

    def bad_loss(mm, bb):
        loss(mm, bb)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        pdpsgd.make_dp_step(m, bad_loss, max_grad_norm=1.0, noise_multiplier=0.0, method="bk").clipped_sum(params, b)
    assert not any(k in mod.__dict__ for mod in m.modules() for k in names)


def test_deberta_with_gradient_checkpointing_in_train_mode_exact():
    """Hugging Face activation checkpointing (non-reentrant, train mode, dropout 0): the recomputed
    layers run the attention adapter again; exact against the naive loop without checkpointing."""
    from pdpsgd.testing import to_float64

    models.assert_checkpointed_exact(to_float64(models.tiny_deberta()).train(), loss, to_float64(_batch(3, 7, seed=8)))


def test_attention_takes_only_the_encoders_per_example_embeddings():
    """Inside a capture, an attention takes 3-D ``rel_embeddings`` as per-example copies only where
    they are the tensor its encoder's adapter made; any other (here: the same values, cloned) goes
    to the model's own code, which takes (2k, d) only and fails on it."""
    m = models.tiny_deberta().double()
    with bk._adapted(m, default_registry(), 3):
        rel = m.deberta.encoder.get_rel_embedding()  # (B, 2k, d), made by the adapter
        att = m.deberta.encoder.layer[0].attention.self
        h = torch.randn(3, 6, m.config.hidden_size, dtype=torch.float64)
        mask = torch.ones(3, 1, 6, 6, dtype=torch.bool)
        ours = att(h, mask, rel_embeddings=rel)[0]
        with pytest.raises(RuntimeError):
            att(h, mask, rel_embeddings=rel.clone())
    want = att(h, mask, rel_embeddings=m.deberta.encoder.get_rel_embedding())[0]  # the model's own
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("buckets,T,att", [(32, 5, ("p2c", "c2p")), (32, 5, ("c2p",)), (4, 12, ("p2c", "c2p")),
                                           (-1, 6, ("p2c",))])
def test_position_projections_only_on_the_rows_the_gathers_read(buckets, T, att):
    """Round 54: the per-example position projections run on the rows of the 2k-row table that the c2p / p2c gathers
    read (2T − 1 of them where every relative position has its own bucket; all 2k once T passes the buckets'
    reach), not on every row: exact, and the projection's per-example call sees that many rows."""
    m = models.tiny_deberta(buckets=buckets, pos_att_type=att)
    att_mod = m.deberta.encoder.layer[0].attention.self
    k2 = 2 * att_mod.pos_ebd_size
    rows = []

    def spy(mod, args):
        if args[0].dim() == 3 and args[0].shape[0] == 3 and args[0].shape[1] != T:  # the step's (B, n, d) calls
            rows.append(args[0].shape[1])
    att_mod.key_proj.register_forward_pre_hook(spy)
    r = assert_exact(m, loss, _batch(3, T, seed=5), method="bk", max_grad_norm=0.1)
    assert "vmap" not in r.routes.values(), r.routes
    rel = m.deberta.encoder.get_rel_pos(torch.zeros(1, T, 16))  # the model's own relative positions
    span = att_mod.pos_ebd_size
    used = [torch.clamp(rel + span, 0, k2 - 1)] if "c2p" in att else []
    if "p2c" in att:
        used.append(torch.clamp(-rel + span, 0, k2 - 1))
    want = max(int(u.max()) for u in used) - min(int(u.min()) for u in used) + 1
    assert rows and set(rows) == {want} and want < k2, (rows, want, k2)
