"""The vmap step is exact on the model families users bring: RNNs, HF GPT-2 and BERT."""
import torch
from hypothesis import given, settings, strategies as st

import pdpsgd
from pdpsgd.testing import assert_exact, token_batches
from models import RNNClassifier, cls_loss, hf_cls_loss, hf_lm_loss, tiny_bert, tiny_gpt2


@given(kind=st.sampled_from(["lstm", "gru"]), bidirectional=st.booleans(), layers=st.integers(1, 2),
       seed=st.integers(0, 1000), B=st.integers(1, 4), T=st.integers(1, 6), chunk=st.integers(1, 4))
@settings(max_examples=8)
def test_rnn_classifiers_exact(kind, bidirectional, layers, seed, B, T, chunk):
    torch.manual_seed(seed)
    m = RNNClassifier(kind, bidirectional=bidirectional, layers=layers)
    g = torch.Generator().manual_seed(seed)
    b = {"input_ids": torch.randint(0, 30, (B, T), generator=g), "labels": torch.randint(0, 3, (B,), generator=g)}
    assert_exact(m, cls_loss, b, chunk_size=chunk, max_grad_norm=0.05)


def test_lstm_train_mode_with_dropout_runs():
    torch.manual_seed(0)
    m = RNNClassifier("lstm", layers=2)
    m.rnn.dropout = 0.3
    m.train()
    b = {"input_ids": torch.randint(0, 30, (4, 5)), "labels": torch.randint(0, 3, (4,))}
    out = pdpsgd.make_dp_step(m, cls_loss, max_grad_norm=1.0, noise_multiplier=0.5)(pdpsgd.trainable_params(m), b)
    assert all(torch.isfinite(g).all() for g in out.grads.values())


@given(batch=token_batches(vocab_size=40, max_batch=4, max_len=8), C=st.floats(0.01, 10.0), chunk=st.integers(1, 4))
@settings(max_examples=5)
def test_gpt2_lm_head_exact_with_padding(batch, C, chunk):
    m = tiny_gpt2()
    assert m.lm_head.weight is m.transformer.wte.weight  # tied
    rep = assert_exact(m, hf_lm_loss, batch, max_grad_norm=C, chunk_size=chunk)
    assert "lm_head.weight" not in rep.per_param  # one tied parameter, summed gradient


@given(batch=token_batches(vocab_size=40, max_batch=4, max_len=8, num_labels=3), C=st.floats(0.01, 10.0))
@settings(max_examples=5)
def test_bert_classifier_exact_with_attention_mask(batch, C):
    assert_exact(tiny_bert(), hf_cls_loss, batch, max_grad_norm=C, chunk_size=3)


def test_bert_train_mode_dropout_and_frozen_encoder():
    m = tiny_bert()
    m.config.hidden_dropout_prob = 0.1
    m.train()
    b = {"input_ids": torch.randint(0, 40, (3, 6)), "attention_mask": torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4]),
         "labels": torch.tensor([0, 1, 2])}
    params = {n: p for n, p in m.named_parameters() if n.startswith("classifier") or ".layer.1." in n}
    out = pdpsgd.make_dp_step(m, hf_cls_loss, max_grad_norm=1.0, noise_multiplier=1.0)(params, b)
    assert set(out.grads) == set(params)
    m.eval()
    assert_exact(m, hf_cls_loss, b, params=params)


def test_user_module_and_transformers_left_untouched():
    import transformers.masking_utils as mu

    before = mu.is_tracing
    m = tiny_gpt2()
    b = {"input_ids": torch.randint(0, 40, (2, 5)), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    b["labels"] = b["input_ids"]
    pdpsgd.make_dp_step(m, hf_lm_loss, max_grad_norm=1.0, noise_multiplier=0.0)(pdpsgd.trainable_params(m), b)
    assert mu.is_tracing is before
    assert not mu.is_tracing(torch.ones(1))
