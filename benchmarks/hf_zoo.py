"""Book-keeping across Hugging Face model families (not timed): for each tiny model built from a
config, `method="bk"` and `"auto"` against the naive float64 loop (`pdpsgd.testing.assert_exact`,
rtol 1e-9), with the routes taken and the parameters that fall back to vmap.

    python benchmarks/hf_zoo.py                 # every family (~4 min on 2 cores)
    python benchmarks/hf_zoo.py opt t5          # some
    python benchmarks/hf_zoo.py --batch 40      # B = 40 (default 3): past the order check's 32 run alone

For a model of your own: `pdpsgd check FILE` (see README).
"""
import argparse
import collections
import warnings

import torch
import torch.nn.functional as F
import transformers as tf

from pdpsgd.testing import assert_exact

warnings.filterwarnings("ignore")
torch.manual_seed(0)
ap = argparse.ArgumentParser()
ap.add_argument("families", nargs="*", help="some families only (default: every one)")
ap.add_argument("--batch", type=int, default=3)
args = ap.parse_args()
B, T, V = args.batch, 7, 50
CAUSAL = {
 "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=32)),
 "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=32)),
 "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=32)),
 "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=V, max_position_embeddings=32)),
 "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=32)),
 "opt": (tf.OPTConfig, tf.OPTForCausalLM, dict(hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=32, word_embed_proj_dim=16)),
 "gpt_neo": (tf.GPTNeoConfig, tf.GPTNeoForCausalLM, dict(hidden_size=16, num_layers=2, num_heads=4, attention_types=[[["global","local"],1]], vocab_size=V, max_position_embeddings=32, window_size=4)),
 "phi": (tf.PhiConfig, tf.PhiForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=32)),
 "biogpt": (tf.BioGptConfig, tf.BioGptForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40, scale_embedding=True)),
 "vaultgemma": (tf.VaultGemmaConfig, tf.VaultGemmaForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=V, max_position_embeddings=32)),
 "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=V, max_position_embeddings=32, sliding_window=4)),
 "falcon": (tf.FalconConfig, tf.FalconForCausalLM, dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4, vocab_size=V)),
 "phi3_longrope": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, original_max_position_embeddings=4, pad_token_id=0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 3.0]})),
 "llama_dynamic": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V, max_position_embeddings=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
 "gptj": (tf.GPTJConfig, tf.GPTJForCausalLM, dict(n_embd=16, n_layer=2, n_head=4, rotary_dim=4, vocab_size=V, n_positions=32)),
 "bloom": (tf.BloomConfig, tf.BloomForCausalLM, dict(hidden_size=16, n_layer=2, n_head=4, vocab_size=V)),
}
CLS = {
 "roberta": (tf.RobertaConfig, tf.RobertaForSequenceClassification, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40)),
 "distilbert": (tf.DistilBertConfig, tf.DistilBertForSequenceClassification, dict(dim=16, hidden_dim=32, n_layers=2, n_heads=4, vocab_size=V, max_position_embeddings=40)),
 "albert": (tf.AlbertConfig, tf.AlbertForSequenceClassification, dict(hidden_size=16, embedding_size=8, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, vocab_size=V, max_position_embeddings=40)),
 "electra": (tf.ElectraConfig, tf.ElectraForSequenceClassification, dict(hidden_size=16, embedding_size=8, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40)),
 "deberta_v2": (tf.DebertaV2Config, tf.DebertaV2ForSequenceClassification, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40, relative_attention=True, position_buckets=8, pos_att_type=["p2c","c2p"])),
 "deberta_v1": (tf.DebertaConfig, tf.DebertaForSequenceClassification, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40, relative_attention=True, pos_att_type=["c2p","p2c"], position_biased_input=False)),
 "bart": (tf.BartConfig, tf.BartForSequenceClassification, dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=V, max_position_embeddings=40, eos_token_id=2, scale_embedding=True)),
 "mbart": (tf.MBartConfig, tf.MBartForSequenceClassification, dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=V, max_position_embeddings=40, eos_token_id=2, scale_embedding=True)),
 "t5": (tf.T5Config, tf.T5ForConditionalGeneration, dict(d_model=16, d_ff=32, d_kv=4, num_layers=1, num_decoder_layers=1, num_heads=4, vocab_size=V, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)),
 "xlm_roberta": (tf.XLMRobertaConfig, tf.XLMRobertaForSequenceClassification, dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=V, max_position_embeddings=40)),
}
# more families from one set of small sizes (every config takes the keys it knows; ``transformers``' auto
# classes pick the model); the mixture-of-experts ones run their experts by ``batched_mm`` (``grouped_mm``, the
# default, has no float64 kernel on CPU; ``eager`` cannot run under vmap): their experts and routers take the
# exact fallback
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=4, vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             sliding_window=4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
             shared_expert_intermediate_size=16, experts_implementation="batched_mm", partial_rotary_factor=0.5, rotary_dim=4,
             local_attention=4, global_attn_every_n_layers=2, embedding_size=16, use_qk_norm=True)
GENERIC_CAUSAL = ["qwen3", "olmo", "olmo2", "olmo3", "cohere", "cohere2", "granite", "starcoder2", "stablelm",
                  "persimmon", "gpt_bigcode", "codegen", "mpt", "gemma2", "smollm3", "ministral", "helium", "glm4",
                  "exaone4", "nemotron", "openai-gpt", "ctrl", "modernbert-decoder", "lfm2", "internlm3", "seed_oss",
                  "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "gpt_oss"]
GENERIC_CLS = ["modernbert", "mobilebert", "esm", "nomic_bert", "eurobert", "roformer", "big_bird", "megatron-bert",
               "rembert", "nystromformer", "yoso", "fnet", "roberta-prelayernorm", "mpnet", "convbert", "squeezebert"]
_AUTO = {"causal": tf.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
         "cls": tf.models.auto.modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}
for _kind, _names, _into in (("causal", GENERIC_CAUSAL, CAUSAL), ("cls", GENERIC_CLS, CLS)):
    for _n in _names:
        _into[_n] = (tf.CONFIG_MAPPING[_n], getattr(tf, _AUTO[_kind][_n]), dict(SMALL, num_labels=2) if _kind == "cls" else SMALL)
ids = torch.randint(3, V, (B, T)); ids[0, -1] = 2; ids[1, 4] = 2; ids[2, 2] = 2; ids[3:, -1] = 2; am = torch.ones(B, T, dtype=torch.long); am[1, 5:] = 0; am[2, 3:] = 0
def causal_loss(m, b):
    lg = m(input_ids=b["ids"], attention_mask=b["am"]).logits[:, :-1]
    tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), b["ids"][:, 1:].reshape(-1), reduction="none").view(b["ids"].shape[0], T - 1)
    return (tok * b["am"][:, 1:]).sum(1)
def cls_loss(m, b):
    return F.cross_entropy(m(input_ids=b["ids"], attention_mask=b["am"]).logits, b["y"], reduction="none")
def t5_loss(m, b):
    out = m(input_ids=b["ids"], attention_mask=b["am"], decoder_input_ids=b["ids"][:, :4].contiguous())
    return F.cross_entropy(out.logits.reshape(-1, V), b["ids"][:, :4].reshape(-1), reduction="none").view(b["ids"].shape[0], 4).sum(1)
batch = {"ids": ids, "am": am, "y": torch.randint(0, 2, (B,))}
only = args.families
for name, (cc, mc, kw) in {**CAUSAL, **CLS}.items():
    if only and name not in only: continue
    try:
        cfg = cc(**kw)
        try: cfg._attn_implementation = "eager"
        except Exception: pass
        m = mc(cfg)
        with torch.no_grad():  # norm weights off their init (ones / zeros): formulas that differ only in the dtype
            for pn, p in m.named_parameters():  # of w's product (LLaMA's vs Helium's) then differ in value too
                if "norm" in pn.lower():
                    p.add_(0.3 * torch.randn_like(p))
    except Exception as e:
        print(f"{name:12s} BUILD {type(e).__name__}: {str(e)[:150]}"); continue
    lf = t5_loss if name == "t5" else (causal_loss if name in CAUSAL else cls_loss)
    for meth in ("bk", "auto"):
        try:
            r = assert_exact(m, lf, batch, method=meth, max_grad_norm=0.05)
            cnt = collections.Counter(r.routes.values())
            fb = [n for n, v in r.routes.items() if v == "vmap"]
            print(f"{name:12s} {meth:4s} OK {dict(cnt)} vmap: {fb[:4]}")
        except Exception as e:
            print(f"{name:12s} {meth:4s} {type(e).__name__}: {str(e)[:300]}")
