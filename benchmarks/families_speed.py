"""The bk step against the non-private one, per Hugging Face family, one process, interleaved, CPU time. Run it
once per tree (``PYTHONPATH``) to compare an engine where some layers took the exact fallback: round 53's families
(Cohere's and Nemotron's layer norms, MPNet's relative attention bias), round 54's (SqueezeBERT's channel-first
layer norms, ConvBERT's separable-convolution bias); ``--all``: every family of ``SCAN`` (round 54's scan).

    python benchmarks/families_speed.py                       # cohere, nemotron, mpnet; 1 thread
    python benchmarks/families_speed.py squeezebert convbert  # round 54's
    python benchmarks/families_speed.py deberta-v3 --seq 128  # DeBERTa-v3's 512-row position table (round 54)
    python benchmarks/families_speed.py --all                 # 47 families (~10 min on 2 cores)
    PYTHONPATH=/tmp/old python benchmarks/families_speed.py   # the same with another checkout of pdpsgd

Models from configs (no downloads): 4 layers, width 256, 4 heads, FFN 512, vocab 8192, B = 8, T = 64 (``--seq``), train mode;
causal-LM loss or sequence classification (the families in ``transformers``' sequence-classification mapping that
have no causal-LM class here: ``CLS``); SGD; C = 1, σ = 1. A family not in ``BUILD`` is built from one config of
those sizes through ``transformers.CONFIG_MAPPING`` and the auto classes, with SDPA attention where the model takes
it, else eager.
"""
import argparse
import time
import warnings

import torch
import torch.nn.functional as F
import transformers as tf

import pdpsgd

warnings.filterwarnings("ignore")
ap = argparse.ArgumentParser()
ap.add_argument("families", nargs="*", default=["cohere", "nemotron", "mpnet"])
ap.add_argument("--all", action="store_true", help="every family of SCAN")
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--seq", type=int, default=64, help="T, the sequence length")
args = ap.parse_args()
torch.set_num_threads(args.threads)
V, B, T = 8192, 8, args.seq
KW = dict(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
          max_position_embeddings=256)
BUILD = {
    "cohere": lambda: tf.CohereForCausalLM(tf.CohereConfig(**KW, num_key_value_heads=4, pad_token_id=0)),
    "nemotron": lambda: tf.NemotronForCausalLM(tf.NemotronConfig(**KW, num_key_value_heads=4, pad_token_id=0,
                                                                 partial_rotary_factor=0.5)),
    "mpnet": lambda: tf.MPNetForSequenceClassification(tf.MPNetConfig(**KW, num_labels=2)),
    "squeezebert": lambda: tf.SqueezeBertForSequenceClassification(tf.SqueezeBertConfig(**KW, embedding_size=256,
                                                                                       num_labels=2)),
    "convbert": lambda: tf.ConvBertForSequenceClassification(tf.ConvBertConfig(**KW, embedding_size=256, num_labels=2)),
    # DeBERTa-v3's relative positions: 256 log buckets (a 512-row table), shared position projections
    "deberta-v3": lambda: tf.DebertaV2ForSequenceClassification(tf.DebertaV2Config(
        **dict(KW, max_position_embeddings=512), num_labels=2, relative_attention=True, position_buckets=256,
        pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False)),
}
# one config for every other family (each takes the keys it knows; GPT-2-style names too)
GENERIC = dict(KW, num_key_value_heads=4, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=32,
               partial_rotary_factor=0.5, rotary_dim=32, local_attention=32, global_attn_every_n_layers=2,
               embedding_size=256, n_embd=256, n_layer=4, n_head=4, n_positions=256, d_model=256, num_labels=2,
               ffn_hidden_size=512, dff=512)
SCAN = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt_neox", "opt",
        "bloom", "olmo2", "cohere", "granite", "starcoder2", "stablelm", "gpt_bigcode", "codegen", "mpt", "gptj",
        "biogpt", "nemotron", "helium", "glm4", "lfm2", "ctrl", "openai-gpt",
        "bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "modernbert", "mobilebert", "esm",
        "roformer", "megatron-bert", "rembert", "mpnet", "convbert", "squeezebert", "fnet", "xlm-roberta"]
_AUTO = tf.models.auto.modeling_auto
CLS = {"mpnet", "squeezebert", "convbert", "deberta-v3"} | {f for f in SCAN if f not in _AUTO.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}


def build(fam):
    if fam in BUILD:
        return BUILD[fam]()
    names = _AUTO.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if fam in CLS else _AUTO.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cls = getattr(tf, names[fam])
    for attn in ("sdpa", "eager"):
        cfg = tf.CONFIG_MAPPING[fam](**GENERIC)
        cfg._attn_implementation = attn
        try:
            return cls(cfg)
        except ValueError:  # (no SDPA for this model)
            if attn == "eager":
                raise


def run(fam):
    torch.manual_seed(0)
    m = build(fam).train()
    ids = torch.randint(3, V, (B, T))
    batch = (ids, torch.ones(B, T, dtype=torch.long), torch.randint(0, 2, (B,)))

    def loss(mm, b):
        out = mm(input_ids=b[0], attention_mask=b[1]).logits
        if fam in CLS:
            return F.cross_entropy(out, b[2], reduction="none")
        tok = F.cross_entropy(out[:, :-1].reshape(-1, V), b[0][:, 1:].reshape(-1), reduction="none")
        return tok.view(b[0].shape[0], -1).sum(1)

    params = pdpsgd.trainable_params(m)
    step = pdpsgd.make_dp_step(m, loss, max_grad_norm=1.0, noise_multiplier=1.0, method="bk", expected_batch_size=B)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)

    def nonprivate():
        opt.zero_grad(set_to_none=True)
        loss(m, batch).sum().backward()
        opt.step()

    def bk():
        step(params, batch)

    for f in (nonprivate, bk, bk):  # warm-up (bk's first step of a shape runs its checks)
        f()
    fell = sum(r == "vmap" for r in step.plan(batch).values())
    t = {"nonprivate": [], "bk": []}
    for _ in range(args.reps):
        for name, f in (("nonprivate", nonprivate), ("bk", bk)):
            t0 = time.process_time()
            f()
            t[name].append(time.process_time() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in t.items()}
    print(f"{fam:9s} non-private {med['nonprivate']:7.1f} ms  bk {med['bk']:7.1f} ms  bk × np {med['bk'] / med['nonprivate']:.2f}"
          f"  parameters on the vmap fallback: {fell}/{len(params)}", flush=True)


for fam in (SCAN if args.all else args.families):
    try:
        run(fam)
    except Exception as e:  # (a family this transformers cannot build from the config: said, and the scan goes on)
        print(f"{fam:9s} not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
