"""ConvBERT's ``SeparableConv1D`` bias (``pdpsgd.rules.separable_conv_bias``): a raw (C_out, 1) Parameter
added in the module's own forward. Exact against the naive float64 loop on its rule; matched only on
transformers' own class with the known forward."""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pdpsgd
from models import hf_cls_loss
from pdpsgd.testing import assert_exact, check_sensitivity, token_batches

V = 40


def _convbert(seed=0):
    import transformers as tf

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.ConvBertConfig(vocab_size=V, hidden_size=16, embedding_size=16, intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, head_ratio=2, conv_kernel_size=3,
                                max_position_embeddings=32, num_labels=3, pad_token_id=0)
        cfg._attn_implementation = "eager"
        m = tf.ConvBertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the biases start at zero: away from it
        for n, p in m.named_parameters():
            if n.endswith("key_conv_attn_layer.bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


BIAS = "key_conv_attn_layer.bias"


@settings(max_examples=5, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=7, num_labels=3), C=st.sampled_from([0.05, 1.0, 100.0]),
       method=st.sampled_from(["bk", "auto"]))
def test_convbert_exact_and_on_its_rules(batch, C, method):
    """ConvBERT (span-based dynamic convolution: a depthwise and a pointwise Conv1d, then the raw bias): every
    parameter on its rules (before round 54 the two biases took the exact fallback), exact, over batch
    sizes, lengths, padding and clip norms."""
    m = _convbert()
    r = assert_exact(m, hf_cls_loss, batch, method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    assert sum(n.endswith(BIAS) for n in r.routes) == 2
    reg = pdpsgd.rules.default_registry()
    assert {reg.lookup(mod).name for mod in m.modules() if type(mod).__name__ == "SeparableConv1D"} \
        == {"separable_conv_bias"}


@pytest.mark.parametrize("which", ["user_class", "other_forward"])
def test_separable_conv_bias_takes_only_the_known_code(which, monkeypatch):
    """A user's class named SeparableConv1D is not matched, and neither is transformers' own class with a forward
    other than the known one (patched: the bias scaled by 2, which the rule's gradient would miss): both
    biases take the exact fallback, still exact."""
    import transformers.models.convbert.modeling_convbert as cm

    orig = cm.SeparableConv1D
    if which == "user_class":
        class SeparableConv1D(orig):  # the same code, a class of the user's own
            pass
        SeparableConv1D.__module__ = __name__
        monkeypatch.setattr(cm, "SeparableConv1D", SeparableConv1D)
    else:
        def forward(self, hidden_states):
            x = self.pointwise(self.depthwise(hidden_states))
            return x + 2 * self.bias
        monkeypatch.setattr(orig, "forward", forward)
    m = _convbert()
    ids = torch.randint(1, V, (3, 5), generator=torch.Generator().manual_seed(2))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2, 1])}
    r = assert_exact(m, hf_cls_loss, b, method="bk", max_grad_norm=0.1)
    fell = {n for n, v in r.routes.items() if v == "vmap"}
    assert fell == {n for n in r.routes if n.endswith(BIAS)} and len(fell) == 2, fell


def test_convbert_sensitivity():
    """Each example's clipped contribution ≤ C and one example replaced moves the sum by ≤ 2C."""
    m = _convbert()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (4, 6), generator=g)
    am = torch.ones_like(ids)
    am[1, 2:] = 0
    b = {"input_ids": ids, "attention_mask": am, "labels": torch.tensor([0, 1, 2, 1])}
    step = pdpsgd.make_dp_step(m.double(), hf_cls_loss, max_grad_norm=0.01, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b)
    assert rep.max_ratio <= 1 + 1e-6, rep
