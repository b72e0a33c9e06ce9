"""Layer norms that Hugging Face models write out themselves (``pdpsgd.rules.custom_layernorm``:
Cohere's, Nemotron's LayerNorm1P, MobileBERT's NoNorm; ``rules.rmsnorm``: Helium's float32 product)
and ModernBERT (its masked-LM head on the labelled tokens only, ``sparse_prediction``): exact against
the naive float64 loop, on their rules, each call checked as it runs."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import pdpsgd
from models import hf_cls_loss
from pdpsgd.testing import assert_exact, check_sensitivity, token_batches

V = 40


def _perturbed(m, seed=0):
    """Norm weights away from their init (ones): with w = 1 a formula that multiplies in float32 and
    one that multiplies in the model's dtype give the same output, and the check cannot tell them apart."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n.lower():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


def _causal(name, **extra):
    import transformers as tf

    small = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, hidden_size=16,
                 intermediate_size=32, max_position_embeddings=32, pad_token_id=0)
    cfgs = {
        "cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(small, use_qk_norm=True)),  # (H, d_head) q/k norms
        "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(small, sliding_window=4)),
        "nemotron": (tf.NemotronConfig, tf.NemotronForCausalLM, dict(small, partial_rotary_factor=0.5)),
        "helium": (tf.HeliumConfig, tf.HeliumForCausalLM, dict(small, head_dim=4)),
    }
    cc, mc, kw = cfgs[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = cc(**kw, **extra)
        cfg._attn_implementation = "eager"
        m = mc(cfg)
    return _perturbed(m).eval()


def causal_loss(m, b):
    lg = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    lab = b["labels"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(lg.reshape(-1, V), lab.reshape(-1), reduction="none", ignore_index=-100).view(lab.shape).sum(1)


NORM_RULE = {"cohere": "cohere_layernorm", "cohere2": "cohere_layernorm", "nemotron": "layernorm_1p",
             "helium": "rmsnorm_custom"}


@pytest.mark.parametrize("name", sorted(NORM_RULE))
@settings(max_examples=3, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=7), C=st.sampled_from([0.05, 1.0, 100.0]),
       method=st.sampled_from(["bk", "auto"]))
def test_custom_norm_families_exact_and_on_their_rules(name, batch, C, method):
    """Cohere (with its per-head q/k norms, a (H, d_head) weight), Cohere 2, Nemotron and Helium: every
    parameter on its rules (before: the norms took the exact vmap fallback, a second pass per step),
    norms and clipped sums equal to the naive float64 loop, over batch sizes, lengths, padding, clip norms."""
    m = _causal(name)
    r = assert_exact(m, causal_loss, batch, method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    reg = pdpsgd.rules.default_registry()
    norms = {type(mod).__name__: reg.lookup(mod).name for mn, mod in m.named_modules() if "norm" in mn.split(".")[-1]}
    assert set(norms.values()) == {NORM_RULE[name]}, norms


def test_cohere_qk_norm_weight_is_two_dimensional_and_bounded():
    """Cohere's q/k norms carry one weight row per head ((H, d_head), on (B, T, H, d_head)): the rule sums
    each example's g ⊙ x̂ over its tokens only, so each example's clipped contribution (every layer) is at
    most C, and one example removed or replaced moves the sum by at most C (2C)."""
    m = _causal("cohere")
    assert m.model.layers[0].self_attn.q_norm.weight.dim() == 2
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (4, 6), generator=g)
    am = torch.ones_like(ids)
    am[2, 3:] = 0
    b = {"input_ids": ids, "attention_mask": am, "labels": ids}
    step = pdpsgd.make_dp_step(m.double(), causal_loss, max_grad_norm=0.01, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b)
    assert rep.max_ratio <= 1 + 1e-6 and rep.remove_one_sliced is not None, rep  # (check_sensitivity raises past it)


@pytest.mark.parametrize("which", ["user_class", "other_formula"])
def test_custom_norm_rules_check_the_class_and_each_call(which, monkeypatch):
    """A user's class named CohereLayerNorm is not matched (a value check cannot see a forward that stops
    the gradient); transformers' own class whose forward is not the formula the rule knows (patched here:
    the mean not subtracted) fails the check as it runs: both take the exact fallback, still exact."""
    import transformers.models.cohere.modeling_cohere as cm

    orig = cm.CohereLayerNorm
    if which == "user_class":
        class CohereLayerNorm(torch.nn.Module):  # the same forward, a class of the user's own
            def __init__(self, hidden_size=None, eps=1e-5, bias=False):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(hidden_size))
                self.variance_epsilon = eps

            forward = orig.forward
        monkeypatch.setattr(cm, "CohereLayerNorm", CohereLayerNorm)
    else:
        def forward(self, hidden_states):
            h = hidden_states.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight.to(torch.float32) * h).to(hidden_states.dtype)
        monkeypatch.setattr(orig, "forward", forward)
    m = _causal("cohere")
    ids = torch.randint(1, V, (3, 5), generator=torch.Generator().manual_seed(2))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    r = assert_exact(m, causal_loss, b, method="bk", max_grad_norm=0.1)
    fell = {n for n, v in r.routes.items() if v == "vmap"}
    assert fell == {n for n in r.routes if "norm" in n}, fell


def _mobilebert():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MobileBertConfig(vocab_size=V, hidden_size=16, embedding_size=8, intermediate_size=16,
                              intra_bottleneck_size=8, num_hidden_layers=2, num_attention_heads=2,
                              num_feedforward_networks=2, max_position_embeddings=32, num_labels=3)
    cfg._attn_implementation = "eager"
    return _perturbed(tf.MobileBertForSequenceClassification(cfg)).eval()


@settings(max_examples=4, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=6, num_labels=3), C=st.sampled_from([0.05, 100.0]),
       method=st.sampled_from(["bk", "auto"]))
def test_mobilebert_nonorm_exact_and_on_its_rule(batch, C, method):
    """MobileBERT's NoNorm (x ⊙ w + b, 34 of them in two layers): on its rule, exact."""
    m = _mobilebert()
    r = assert_exact(m, hf_cls_loss, batch, method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes


def _modernbert(sparse):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.ModernBertConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                  num_attention_heads=2, max_position_embeddings=32, global_attn_every_n_layers=2,
                                  local_attention=4, pad_token_id=0, cls_token_id=1, sep_token_id=2, mask_token_id=3,
                                  bos_token_id=1, eos_token_id=2, sparse_prediction=sparse)
        return _perturbed(tf.ModernBertForMaskedLM(cfg)).eval()


def mlm_loss(m, b):
    lab = b["mlm_labels"]
    out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=lab)
    if m.sparse_prediction:  # logits of the labelled tokens only, (n, V): each token's loss put back in its place
        sel = lab != -100
        tok = F.cross_entropy(out.logits, lab[sel], reduction="none")
        full = torch.zeros(lab.shape, dtype=tok.dtype)
        full[sel] = tok
        return full.sum(1)
    return F.cross_entropy(out.logits.transpose(1, 2), lab, reduction="none", ignore_index=-100).sum(1)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=7), p=st.floats(0.0, 1.0),
       sparse=st.booleans(), C=st.sampled_from([0.05, 100.0]), method=st.sampled_from(["bk", "auto"]))
def test_modernbert_masked_lm_exact_and_on_its_rules(batch, p, sparse, C, method):
    """ModernBERT (GeGLU, rotary, local and global attention, bias-free layer norms, the decoder tied to the
    token table), its head on every token or, ``sparse_prediction``, on the labelled tokens only (rows
    picked by a mask from the flattened batch: each credited to its example since round 52): every
    parameter on its rules, exact, from no labelled token to all of them."""
    m = _modernbert(sparse)
    ids, am = batch["input_ids"], batch["attention_mask"]
    g = torch.Generator().manual_seed(int(ids.sum()))
    lab = torch.where((torch.rand(ids.shape, generator=g) < p) & (am == 1), ids, -100)
    b = {"input_ids": ids, "attention_mask": am, "mlm_labels": lab}
    r = assert_exact(m, mlm_loss, b, method=method, max_grad_norm=C, allow_empty=True)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes


def test_modernbert_sparse_head_sensitivity():
    """The picked-rows head (``sparse_prediction``) with the decoder tied to the token table: each
    example's clipped contribution ≤ C, one removed or replaced moves the sum by ≤ C (2C)."""
    m = _modernbert(True)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, V, (4, 6), generator=g)
    am = torch.ones_like(ids)
    am[1, 4:] = 0
    lab = torch.where(torch.rand(ids.shape, generator=g) < 0.5, ids, -100).masked_fill(am == 0, -100)
    lab[0, 2] = ids[0, 2]
    b = {"input_ids": ids, "attention_mask": am, "mlm_labels": lab}
    step = pdpsgd.make_dp_step(m.double(), mlm_loss, max_grad_norm=0.01, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b)
    assert rep.max_ratio <= 1 + 1e-6 and rep.remove_one_sliced is not None, rep  # (check_sensitivity raises past it)


def _switch(sparse):
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.SwitchTransformersConfig(vocab_size=V, d_model=16, d_ff=32, d_kv=4, num_layers=2, num_decoder_layers=2,
                                          num_heads=4, num_experts=4, encoder_sparse_step=sparse,
                                          decoder_sparse_step=sparse, relative_attention_num_buckets=8,
                                          decoder_start_token_id=0, pad_token_id=0)
        cfg._attn_implementation = "eager"
        return tf.SwitchTransformersForConditionalGeneration(cfg).eval()


def _s2s_batch(seed=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (3, 6), generator=g)
    am = torch.ones_like(ids)
    am[1, 4:] = 0
    return {"ids": ids, "am": am, "dec": torch.randint(1, V, (3, 4), generator=g)}


def s2s_loss(mm, bb):
    lg = mm(input_ids=bb["ids"], attention_mask=bb["am"], decoder_input_ids=bb["dec"]).logits
    return F.cross_entropy(lg.reshape(-1, V), bb["dec"].reshape(-1), reduction="none").view(bb["dec"].shape).sum(1)


def test_switch_transformers_t5_style_norms_on_the_rules():
    """Switch Transformers' T5-style RMS norms, named ``SwitchTransformersLayerNorm``, took the exact fallback
    (round 53: by name, ``rmsnorm.T5_STYLE_NAMES``, each call checked): on the rules now, exact, with a padded
    example (dense layers only: its routed experts take the fallback, see docs/reference.md)."""
    m = _perturbed(_switch(0))
    for method in ("bk", "auto"):
        r = assert_exact(m, s2s_loss, _s2s_batch(), method=method, max_grad_norm=0.05)
        assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    assert pdpsgd.rules.default_registry().lookup(m.encoder.final_layer_norm).name == "rmsnorm_custom"


def test_switch_transformers_with_routed_experts_frozen():
    """With its routed experts (every layer sparse) frozen, the rest of Switch Transformers is on the rules and
    exact (float32: its router runs in float32 at least), and one example replaced moves the sum by ≤ 2C. Before
    round 53 the example-order check's capture, in which no parameter took a rule, asked torch.autograd.grad of
    no inputs, which raised: every parameter went to the vmap fallback, which crashed in torch on the routing."""
    b = _s2s_batch()
    nb = {**b, "ids": b["ids"].clone()}
    nb["ids"][0] = torch.randint(1, V, (6,), generator=torch.Generator().manual_seed(7))
    m = _switch(1)
    for n, p in m.named_parameters():
        if ".experts." in n:
            p.requires_grad_(False)
    r = assert_exact(m, s2s_loss, b, method="bk", max_grad_norm=0.05, float64=False, rtol=1e-4)
    assert r.routes and {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    step = pdpsgd.make_dp_step(m, s2s_loss, max_grad_norm=0.05, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b, neighbour=nb, rtol=1e-4)
    assert rep.max_ratio <= 1 + 1e-4, rep


def _squeezebert():
    import transformers as tf

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.SqueezeBertConfig(vocab_size=V, hidden_size=16, embedding_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, q_groups=2, k_groups=2, v_groups=2,
                                   post_attention_groups=2, intermediate_groups=2, output_groups=2,
                                   max_position_embeddings=32, num_labels=3, pad_token_id=0)
        return _perturbed(tf.SqueezeBertForSequenceClassification(cfg)).eval()


@settings(max_examples=5, deadline=None, derandomize=True)
@given(batch=token_batches(vocab_size=V, max_batch=4, max_len=7, num_labels=3), C=st.sampled_from([0.05, 1.0, 100.0]),
       method=st.sampled_from(["bk", "auto"]))
def test_squeezebert_channel_first_layernorm_exact_and_on_its_rule(batch, C, method):
    """SqueezeBERT's encoder runs channel-first, (B, C, T): its ``SqueezeBertLayerNorm`` normalises over dim 1
    (permute, ``nn.LayerNorm``, permute back) and took the exact fallback before round 54. On its rule now
    (``LayerNormRule`` on the permuted input and output gradient, each call checked), exact, with grouped
    1-d convolutions (its q/k/v and FFN) around it, over batch sizes, lengths, padding and clip norms."""
    m = _squeezebert()
    r = assert_exact(m, hf_cls_loss, batch, method=method, max_grad_norm=C)
    assert {n for n, v in r.routes.items() if v == "vmap"} == set(), r.routes
    reg = pdpsgd.rules.default_registry()
    names = {reg.lookup(mod).name for mod in m.modules() if type(mod).__name__ == "SqueezeBertLayerNorm"}
    assert names == {"channel_first_layernorm"}, names


@pytest.mark.parametrize("which", ["user_class", "other_formula", "other_gradient"])
def test_channel_first_layernorm_takes_only_the_known_code(which, monkeypatch):
    """A user's class named SqueezeBertLayerNorm is not matched; neither is transformers' own class with another
    forward, whether it computes other values (normalised over T, not C) or the same values with another gradient
    (review, round 54: ``y.detach() + (y - y.detach()) * 2``, which no value check can see): all take the exact
    fallback, still exact."""
    import transformers.models.squeezebert.modeling_squeezebert as sm

    orig = sm.SqueezeBertLayerNorm
    if which == "user_class":
        class SqueezeBertLayerNorm(torch.nn.LayerNorm):  # the same forward, a class of the user's own
            def __init__(self, hidden_size, eps=1e-12):
                torch.nn.LayerNorm.__init__(self, normalized_shape=hidden_size, eps=eps)

            forward = orig.forward
        monkeypatch.setattr(sm, "SqueezeBertLayerNorm", SqueezeBertLayerNorm)
    elif which == "other_formula":
        def forward(self, x):  # over the last dim of (B, C, T) (a square case: C = T = 16 below)
            return torch.nn.LayerNorm.forward(self, x)
        monkeypatch.setattr(orig, "forward", forward)
    else:
        def forward(self, x):
            y = torch.nn.LayerNorm.forward(self, x.permute(0, 2, 1))
            return (y.detach() + (y - y.detach()) * 2).permute(0, 2, 1)
        monkeypatch.setattr(orig, "forward", forward)
    m = _squeezebert()
    n = 16 if which == "other_formula" else 5
    ids = torch.randint(1, V, (3, n), generator=torch.Generator().manual_seed(2))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2, 1])}
    r = assert_exact(m, hf_cls_loss, b, method="bk", max_grad_norm=0.1)
    fell = {k for k, v in r.routes.items() if v == "vmap"}
    assert fell and fell == {k for k in r.routes if "layernorm" in k}, fell


def test_channel_first_layernorm_checks_each_call():
    """The rule's check as each call runs: the output of the layer's own formula passes, one that differs in any
    element (here: normalised over T instead of C, and one value off by one ulp) does not, nor a 2-d call."""
    from pdpsgd.rules.custom_layernorm import ChannelFirstLayerNormRule

    ln = next(mod for mod in _squeezebert().modules() if type(mod).__name__ == "SqueezeBertLayerNorm")
    x = torch.randn(3, 16, 5)
    y = ln(x).detach()
    assert ChannelFirstLayerNormRule.verify(ln, (x,), {}, y)
    over_t = F.layer_norm(x, (5,)).detach()  # normalised over T
    assert not ChannelFirstLayerNormRule.verify(ln, (x,), {}, over_t)
    y2 = y.clone()
    y2[1, 3, 2] = torch.nextafter(y2[1, 3, 2], torch.tensor(float("inf")))
    assert not ChannelFirstLayerNormRule.verify(ln, (x,), {}, y2)
    assert not ChannelFirstLayerNormRule.verify(ln, (x[:, :, 0],), {}, y[:, :, 0])  # (B, C): not channel-first rows


def test_vmap_failure_of_a_model_without_experts_names_no_experts_fix(monkeypatch):
    """Review, round 54: every transformers 5 config says ``_experts_implementation`` ('eager' by default), and a
    model without experts that vmap could not run (here: SqueezeBERT whose norm ends in a custom autograd Function
    without ``setup_context``; its norms take the fallback) was told to build its experts another way. The
    experts fix is named only for a model with transformers' experts modules."""
    import transformers.models.squeezebert.modeling_squeezebert as sm

    class Same(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, g):
            return g

    def forward(self, x):
        return Same.apply(torch.nn.LayerNorm.forward(self, x.permute(0, 2, 1))).permute(0, 2, 1)
    monkeypatch.setattr(sm.SqueezeBertLayerNorm, "forward", forward)
    m = _squeezebert()
    ids = torch.randint(1, V, (3, 5), generator=torch.Generator().manual_seed(2))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 2, 1])}
    step = pdpsgd.make_dp_step(m, hf_cls_loss, max_grad_norm=0.1, noise_multiplier=0.0, method="bk")
    with pytest.raises(RuntimeError) as err:
        step.clipped_sum(pdpsgd.trainable_params(m), b)
    assert "setup_context" in str(err.value) and "experts_implementation" not in str(err.value), str(err.value)[:600]


def test_squeezebert_sensitivity():
    """Each example's clipped contribution ≤ C and one example replaced moves the sum by ≤ 2C, with the
    channel-first norms on their rule."""
    m = _squeezebert()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (4, 6), generator=g)
    am = torch.ones_like(ids)
    am[2, 3:] = 0
    b = {"input_ids": ids, "attention_mask": am, "labels": torch.tensor([0, 1, 2, 1])}
    step = pdpsgd.make_dp_step(m.double(), hf_cls_loss, max_grad_norm=0.01, noise_multiplier=0.0, method="bk")
    rep = check_sensitivity(step, pdpsgd.trainable_params(m), b)
    assert rep.max_ratio <= 1 + 1e-6, rep
