"""Tiny models used across the tests (built from configs; no downloads)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn


def mlp(d_in=5, hidden=7, n_out=3):
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, n_out))


def mlp_loss(model, b):
    return F.cross_entropy(model(b["x"]), b["y"], reduction="none")


class TextCNN(nn.Module):
    def __init__(self, vocab=30, dim=8, channels=6, classes=3, kernel=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.conv = nn.Conv1d(dim, channels, kernel, padding=1)
        self.norm = nn.LayerNorm(channels)
        self.out = nn.Linear(channels, classes)

    def forward(self, ids):
        h = self.emb(ids).transpose(1, 2)  # (B, d, T)
        h = torch.relu(self.conv(h)).amax(dim=2)  # (B, C)
        return self.out(self.norm(h))


class RNNClassifier(nn.Module):
    def __init__(self, kind="lstm", vocab=30, dim=6, hidden=5, classes=3, bidirectional=True, layers=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(dim, hidden, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.out = nn.Linear(hidden * (2 if bidirectional else 1), classes)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.out(h.mean(1))


def cls_loss(model, b):
    return F.cross_entropy(model(b["input_ids"]), b["labels"], reduction="none")


class TiedLM(nn.Module):
    """Embedding shared with the output projection (like GPT-2's wte / lm_head)."""

    def __init__(self, vocab=20, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class SharedTwice(nn.Module):
    """One Linear applied twice, plus a buffer and a raw parameter used in forward."""

    def __init__(self, d=6, classes=3):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("shift", torch.linspace(-1, 1, d))
        self.out = nn.Linear(d, classes)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        h = torch.tanh(self.lin(h) * self.scale + self.shift)
        return self.out(h)


class NanoGPT(nn.Module):
    """nanoGPT's GPT (Karpathy), small: wte tied to lm_head, positions ``wpe(torch.arange(t))`` of
    shape (T, d) broadcast over the batch by the add, fused c_attn, scaled_dot_product_attention."""

    def __init__(self, vocab=23, block=16, d=8, heads=2, layers=2, dropout=0.0, bias=True):
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(d, bias=bias), c_attn=nn.Linear(d, 3 * d, bias=bias), c_proj=nn.Linear(d, d, bias=bias),
            ln_2=nn.LayerNorm(d, bias=bias), c_fc=nn.Linear(d, 4 * d, bias=bias), m_proj=nn.Linear(4 * d, d, bias=bias),
        )) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=bias)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # shape (t)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.h:
            q, k, v = blk["c_attn"](blk["ln_1"](x)).split(x.size(-1), dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["c_proj"](y.transpose(1, 2).contiguous().view(b, t, -1))
            x = x + blk["m_proj"](F.gelu(blk["c_fc"](blk["ln_2"](x))))
        return self.lm_head(self.ln_f(x))


def lm_loss_fn(model, b):
    """Per-example summed next-token loss for any model returning logits (or .logits)."""
    out = model(b["input_ids"])
    logits = getattr(out, "logits", out)[:, :-1]
    labels = b["labels"][:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return tok.view(labels.shape).sum(1)


def hf_lm_loss(model, b):
    out = model(b["input_ids"], attention_mask=b["attention_mask"])
    logits = out.logits[:, :-1]
    labels = b["labels"][:, 1:]
    tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=-100)
    return tok.view(labels.shape).sum(1)


def hf_cls_loss(model, b):
    logits = model(b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits, b["labels"], reduction="none")


def tiny_gpt2(vocab=40, dim=16, layers=2, positions=32, seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=2, vocab_size=vocab, n_positions=positions,
                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        m = GPT2LMHeadModel(cfg)
    return m.eval()


def tiny_bert(vocab=40, dim=16, layers=2, classes=3, seed=0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = BertConfig(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=2, intermediate_size=2 * dim,
                         vocab_size=vocab, num_labels=classes, max_position_embeddings=32,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        m = BertForSequenceClassification(cfg)
    return m.eval()


def assert_checkpointed_exact(plain, loss_fn, batch, methods=("bk", "auto"), max_grad_norm=0.5):
    """Book-keeping on a checkpointed copy of ``plain`` (float64, train mode, where Hugging Face
    checkpoints) equals the naive loop on ``plain`` itself, on the rules (no vmap)."""
    from pdpsgd import make_dp_step
    from pdpsgd.testing import naive_clipped_sum

    params = {n: p.detach() for n, p in plain.named_parameters()}
    norms, sums = naive_clipped_sum(plain, loss_fn, batch, max_grad_norm=max_grad_norm, params=params)
    model, calls = checkpointed_copy(plain)
    for method in methods:
        calls.clear()
        step = make_dp_step(model, loss_fn, max_grad_norm=max_grad_norm, noise_multiplier=0.0,
                            expected_batch_size=1.0, method=method)
        part = step.clipped_sum({n: p.detach() for n, p in model.named_parameters()}, batch)
        assert calls, "Hugging Face did not checkpoint"
        assert "vmap" not in part.routes.values(), part.routes
        torch.testing.assert_close(part.per_sample_norms, norms, rtol=1e-9, atol=0)
        for n in sums:
            torch.testing.assert_close(part.sums[n], sums[n], rtol=1e-9, atol=1e-12)


def checkpointed_copy(model):
    """A copy of a Hugging Face model with non-reentrant activation checkpointing on, in train mode, and
    the list that each checkpointed call appends to (so a test can see that it checkpointed)."""
    import copy

    calls = []

    def counted(f):
        def g(*a, **k):
            calls.append(1)
            return f(*a, **k)
        return g

    out = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in out.modules():
        if callable(getattr(m, "_gradient_checkpointing_func", None)):
            m._gradient_checkpointing_func = counted(m._gradient_checkpointing_func)
    return out.train(), calls


T5_VOCAB = 30


def tiny_t5(layers=1, buckets=8, max_distance=16, tie=True, attn="eager", encoder_only=False):
    """A tiny Hugging Face T5 (its relative attention bias: ``rules/t5_relative_bias.py``), eval mode."""
    import transformers as tf

    cfg = tf.T5Config(vocab_size=T5_VOCAB, d_model=16, d_ff=32, d_kv=4, num_layers=layers, num_decoder_layers=layers,
                      num_heads=4, relative_attention_num_buckets=buckets, relative_attention_max_distance=max_distance,
                      decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0, tie_word_embeddings=tie)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = (tf.T5EncoderModel if encoder_only else tf.T5ForConditionalGeneration)(cfg)
    return m.eval()


def tiny_longt5(attention="transient-global", radius=2, global_block=2, buckets=8, layers=1):
    """A tiny Hugging Face LongT5 (encoder: local or transient-global attention, whose block-local
    relative bias is (1, 1, H, block_len, 3·block_len); decoder: T5 attention), eval mode."""
    import transformers as tf

    cfg = tf.LongT5Config(vocab_size=T5_VOCAB, d_model=16, d_ff=32, d_kv=4, num_layers=layers, num_decoder_layers=layers,
                          num_heads=2, encoder_attention_type=attention, local_radius=radius,
                          global_block_size=global_block, relative_attention_num_buckets=buckets,
                          decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = tf.LongT5ForConditionalGeneration(cfg)
    return m.eval()


DEBERTA_VOCAB = 40


def tiny_deberta(share_att_key=True, pos_att_type=("p2c", "c2p"), buckets=8, norm_rel_ebd="layer_norm", layers=2,
                 dropout=0.0, kind="DebertaV2ForSequenceClassification"):
    """A tiny Hugging Face DeBERTa-v2/v3 (relative positions: ``rules/deberta_relative.py``), eval mode."""
    import transformers as tf

    cfg = tf.DebertaV2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
                             vocab_size=DEBERTA_VOCAB, max_position_embeddings=40, relative_attention=True,
                             position_buckets=buckets, pos_att_type=list(pos_att_type), share_att_key=share_att_key,
                             norm_rel_ebd=norm_rel_ebd, num_labels=3, position_biased_input=False,
                             hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = getattr(tf, kind)(cfg)
    return m.eval()


def tiny_deberta_v1(relative=True, pos_att_type=("c2p", "p2c"), layers=2, dropout=0.0,
                    kind="DebertaForSequenceClassification"):
    """A tiny Hugging Face DeBERTa (v1: ``DebertaLayerNorm``, raw q/v biases; ``rules/deberta_v1.py``), eval mode."""
    import transformers as tf

    cfg = tf.DebertaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
                           vocab_size=DEBERTA_VOCAB, max_position_embeddings=40, relative_attention=relative,
                           pos_att_type=list(pos_att_type), max_relative_positions=-1, num_labels=3,
                           position_biased_input=not relative, hidden_dropout_prob=dropout,
                           attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = getattr(tf, kind)(cfg)
    return m.eval()


def deberta_mlm_loss(m, b):
    """Per-example summed token CE of the masked-LM logits against ``labels`` (B, T)."""
    lg = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), b["mlm_labels"].reshape(-1), reduction="none")
    return tok.view(b["mlm_labels"].shape).sum(1)


def deberta_loss(m, b):
    """Per-example CE of the sequence label."""
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits, b["labels"], reduction="none")


def t5_loss(m, b):
    """Per-sequence summed token CE of the target ``labels`` (B, S), teacher forcing."""
    lg = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
           decoder_input_ids=m._shift_right(b["labels"])).logits
    tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), b["labels"].reshape(-1), reduction="none")
    return tok.view(b["labels"].shape).sum(1)
