"""The models of ``python -m longattn.bench hf-train --family``: a config of
transformers' own config class per family (random weights, nothing
downloaded), about 1.1B parameters with the default vocabulary of 32000:

  llama    16 layers, hidden 2048, 16 query / 4 KV heads of 128, MLP 8192, RoPE
  gemma2   16 layers, hidden 2048, 8 / 4 heads of 256, MLP 8192; logit soft-capping
           50 on every layer, a sliding window of 4096 on every other layer, final
           logit soft-capping 30 (applied in the bench's chunked loss too)
  gpt_oss  16 layers, hidden 2048, 32 / 8 heads of 64; a learned sink per query head
           (``s_aux``), a sliding window of 128 on every other layer; mixture of 4
           experts of 2048, top 2 (GPT-OSS 20B: 32 experts, top 4)
  llama4   Llama 4 text: 16 layers, hidden 2048, 16 / 4 heads of 128, QK norm;
           chunked attention (chunks of 8192, RoPE) on 3 layers of 4, the 4th full
           attention without RoPE (temperature tuning); experts (4 of 2048, top 1,
           plus the shared expert) on every other layer, MLP 8192 on the rest

``--tiny``: the same family at hidden 64, windows and chunks of 32 (so that
they cut 256 tokens). An explicit --layers/--hidden/--heads/--kv-heads/
--intermediate/--vocab overrides the family's value. Packed documents
(--docs) of GPT-OSS: transformers builds its masks without position_ids, so
its packed row is one sequence under eager, flex_attention and longattn alike,
and longattn_ring (documents) is a row with that reason.
"""
from __future__ import annotations

from typing import Optional

FAMILIES = ("llama", "gemma2", "gpt_oss", "llama4")
SHAPE = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")

# (full, --tiny) values of the shape flags
_SHAPES = {
    "llama": (dict(layers=16, hidden=2048, heads=16, kv_heads=4, intermediate=8192, vocab=32000),
              dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)),
    "gemma2": (dict(layers=16, hidden=2048, heads=8, kv_heads=4, intermediate=8192, vocab=32000),
               dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256)),
    "gpt_oss": (dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=2048, vocab=32000),
                dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=256)),
    "llama4": (dict(layers=16, hidden=2048, heads=16, kv_heads=4, intermediate=2048, vocab=32000),
               dict(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=256)),
}
# (full, --tiny) family settings beyond the shape
_EXTRA = {
    "llama": (dict(rope_theta=500000.0), dict(rope_theta=500000.0)),
    "gemma2": (dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0),
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=32, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)),
    "gpt_oss": (dict(head_dim=64, sliding_window=128, num_local_experts=4, num_experts_per_tok=2),
                dict(head_dim=16, sliding_window=32, num_local_experts=4, num_experts_per_tok=2)),
    "llama4": (dict(head_dim=128, attention_chunk_size=8192, intermediate_size_mlp=8192, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2),
               dict(head_dim=16, attention_chunk_size=32, intermediate_size_mlp=128, num_local_experts=2,
                    num_experts_per_tok=1, interleave_moe_layer_step=2)),
}
# transformers' own implementations that run the family as it is (sdpa has no
# soft-capping or sinks: transformers refuses it for Gemma 2 and GPT-OSS)
NATIVE = {
    "llama": ("sdpa", "eager", "flex_attention", "flash_attention_2", "torch_cp"),
    "gemma2": ("eager", "flex_attention", "flash_attention_2"),
    "gpt_oss": ("eager", "flex_attention"),
    "llama4": ("sdpa", "eager", "flex_attention"),
}
OURS = ("longattn", "longattn_ring")


def fill_shape(args) -> None:
    """The family's value of every shape flag left unset (full size or --tiny)."""
    values = _SHAPES[args.family][1 if args.tiny else 0]
    for name in SHAPE:
        if getattr(args, name) is None:
            setattr(args, name, values[name])


def config_kwargs(args) -> dict:
    """The keyword arguments of the family's config class (recorded in the JSON)."""
    kw = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
              max_position_embeddings=max(args.seqlen, 8192), tie_word_embeddings=False, use_cache=False,
              attention_dropout=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    kw.update(_EXTRA[args.family][1 if args.tiny else 0])
    if args.family == "gpt_oss":  # its YaRN RoPE (factor 32 over 4096) is defined for 131072 positions
        kw["max_position_embeddings"] = max(args.seqlen, 131072)
    return kw


def make_config(args):
    import transformers

    cls = dict(llama=transformers.LlamaConfig, gemma2=transformers.Gemma2Config,
               gpt_oss=transformers.GptOssConfig, llama4=transformers.Llama4TextConfig)[args.family]
    return cls(**config_kwargs(args))


def unavailable(family: str, attn: str, docs: int = 1) -> Optional[str]:
    """Why the family cannot run under ``attn`` as transformers defines it (None: it can)."""
    if family == "gpt_oss" and docs > 1 and attn == "longattn_ring":
        # unsharded, restarting positions leave GPT-OSS's packed row one sequence
        return ("transformers' GPT-OSS builds its masks without position_ids: a packed row is one sequence "
                "unsharded, which longattn_ring's documents cannot run (longattn.context_parallel.shard_batch "
                "with cu_seqlens runs documents)")
    if attn in OURS or attn in NATIVE[family]:
        return None
    return (f"transformers runs {family} under {', '.join(NATIVE[family][:3])} (its soft-capping, sinks or "
            f"chunks), not {attn}")


def final_softcap(model) -> Optional[float]:
    """The final logit soft-capping the model's own loss applies (Gemma 2), or None."""
    return getattr(model.config, "final_logit_softcapping", None) or None
