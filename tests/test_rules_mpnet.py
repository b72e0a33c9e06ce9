"""MPNet's relative attention bias (``pdpsgd.rules.mpnet_relative_bias``): an embedding of (T, T) position
buckets shared by the batch, looked up per example while the engine captures; exact against the naive
float64 loop, on the rules, and the adapter declines what it does not know."""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pdpsgd
from models import hf_cls_loss
from pdpsgd.testing import assert_exact, check_sensitivity, token_batches

V = 40
TABLE = "mpnet.encoder.relative_attention_bias.weight"


def _mpnet():
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.MPNetConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=40, relative_attention_num_buckets=32,
                             num_labels=3, pad_token_id=1)
        cfg._attn_implementation = "eager"
        return tf.MPNetForSequenceClassification(cfg).eval()


@settings(max_examples=6, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=9, num_labels=3), C=st.sampled_from([0.05, 100.0]),
       method=st.sampled_from(["bk", "auto"]))
def test_mpnet_relative_bias_exact_and_on_its_rules(batch, C, method):
    """(Round 53.) The bias table took the exact fallback (a second vmapped pass of the whole model per step):
    now every parameter is on its rules, the table by the embedding rule on the buckets expanded to the batch,
    exact, over batch sizes (one too), lengths, padding and clip norms."""
    r = assert_exact(_mpnet(), hf_cls_loss, batch, method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes


def test_mpnet_relative_bias_sensitivity():
    """Each example's clipped contribution ≤ C, one removed or replaced moves the sum by ≤ C (2C)."""
    m = _mpnet().double()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (4, 7), generator=g)
    am = torch.ones_like(ids)
    am[1, 5:] = 0
    b = {"input_ids": ids, "attention_mask": am, "labels": torch.randint(0, 3, (4,), generator=g)}
    step = pdpsgd.make_dp_step(m, hf_cls_loss, max_grad_norm=0.01, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b)
    assert rep.max_ratio <= 1 + 1e-6 and rep.remove_one_sliced is not None, rep


@pytest.mark.parametrize("how", ["scaled", "detached", "user_class"])
def test_mpnet_adapter_declines_what_it_does_not_know(how, monkeypatch):
    """A ``compute_position_bias`` that scales the lookup (other values), one that detaches it (the values
    right, the gradient cut: so must the step's be), or an encoder class of the user's own under MPNet's name:
    the adapter declines: the table takes the exact fallback (detached: it has no gradient at all), exact."""
    import transformers.models.mpnet.modeling_mpnet as mm

    orig = mm.MPNetEncoder.compute_position_bias
    if how == "scaled":
        monkeypatch.setattr(mm.MPNetEncoder, "compute_position_bias", lambda self, x, *a, **k: orig(self, x) * 1.5)
    elif how == "detached":
        monkeypatch.setattr(mm.MPNetEncoder, "compute_position_bias", lambda self, x, *a, **k: orig(self, x).detach())
    m = _mpnet()
    if how == "user_class":
        class MPNetEncoder(mm.MPNetEncoder):  # the same methods, a class of the user's own
            pass
        m.mpnet.encoder.__class__ = MPNetEncoder
    ids = torch.randint(2, V, (3, 6), generator=torch.Generator().manual_seed(4))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 2])}
    r = assert_exact(m, hf_cls_loss, b, method="bk", max_grad_norm=0.1)
    fell = {n for n, v in r.routes.items() if v == "vmap"}
    # (detached: the table's gradient is 0 for every example, which the step knows without the fallback)
    assert fell == (set() if how == "detached" else {TABLE}), r.routes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wrong", [False, True])
def test_mpnet_adjoint_check_in_every_dtype(dtype, wrong):
    """The adapter's adjoint check on a table whose bias is symmetric (bucket +n's row = bucket −n's: the
    values of a q/k-transposed map are right, its gradient goes to the mirrored buckets): the transposed map
    declined, the right one taken, in each dtype and past float16's range (review of round 53: a probe of
    1 … numel overflowed float16 to inf, and inf == inf took the transposed map)."""
    import transformers.models.mpnet.modeling_mpnet as mm
    from torch import nn

    from pdpsgd.rules.mpnet_relative_bias import _batched
    from pdpsgd.rules.t5_relative_bias import _Lookup

    B, H, T = 8, 12, 64  # (B·H·T² = 393216 > 65504)
    emb = nn.Embedding(32, H).to(dtype)
    with torch.no_grad():
        emb.weight[16:] = emb.weight[:16]
    stub = _Lookup(emb)
    ids = mm.MPNetEncoder.relative_position_bucket(torch.arange(T)[None, :] - torch.arange(T)[:, None])
    looked = stub(ids)
    ref = looked.permute(2, 0, 1).unsqueeze(0).expand(B, -1, T, T)
    ref = (ref.transpose(-1, -2) if wrong else ref).contiguous()
    out = _batched(emb, stub, ref, B)
    assert (out is None) == wrong
    if not wrong:
        assert torch.equal(out, ref)
