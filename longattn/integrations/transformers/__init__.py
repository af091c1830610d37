"""longattn as the attention of Hugging Face transformers models (transformers >= 5.17).

::

    import longattn.integrations.transformers as lt
    lt.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="longattn")

:func:`register` adds three names to transformers' ``AttentionInterface`` (the
attention call of every layer) and ``AttentionMaskInterface`` (the mask the
model builds once per forward, so that padding and packed documents reach the
attention call instead of being dropped):

``"longattn"`` — one device, :func:`longattn.attention`.
    * no mask: dense, causal from the layer (``module.is_causal``, or the
      ``is_causal`` keyword), bottom-right aligned when the query is shorter
      than the keys (generation with the KV cache);
    * a 2-D padding mask (left or right, also during generation): the real
      tokens only, as packed documents (:func:`longattn.attention_varlen`; one
      :func:`longattn.attention` call per sequence when queries are fewer than
      keys). Padding rows output 0 (as with flash-attention); their logits are
      meaningless under every implementation;
    * packed documents: ``position_ids`` that restart (a position that does
      not follow its predecessor by 1 starts a document) whenever transformers
      itself treats them as packed — no ``attention_mask`` and no cache, i.e.
      ``use_cache=False`` — or the ``cu_seq_lens_q/k``, ``max_length_q/k``
      keywords of transformers' flash-attention path (``DataCollatorWithFlattening
      (return_flash_attn_kwargs=True)``), which always count. transformers'
      GPT-OSS builds its masks without position_ids (huggingface/transformers#39997):
      its packed row is one sequence, as under eager; its documents run as
      ``cu_seq_lens_q/k``;
    * ``sliding_window`` (Mistral, Qwen2, ...): a key is seen when
      ``q - k < sliding_window`` (causal), i.e. ``window_size=(sliding_window - 1, 0)``,
      as transformers' own masks; bidirectional layers ``|q - k| <= sliding_window``;
    * GQA natively (K/V keep their heads); ``scaling`` as the softmax scale;
    * logit soft-capping (Gemma 2's ``softcap``) and attention sinks (GPT-OSS's
      ``s_aux``), as :func:`longattn.attention`'s ``softcap`` and ``sinks``;
    * chunked attention (Llama 4's ``attention_chunk_size``): the mask hook cuts
      the documents at the chunk edges (after left padding, inside packed
      documents, from the cache's offset while decoding), so each chunk is a
      causal document.

``"longattn_ring"`` — the sequence sharded over a process group (context
parallelism), :func:`longattn.ring_attention` (zigzag layout by default) or, for
padding and packed documents, :func:`longattn.ring_attention_varlen` on the global
document boundaries (documents from restarting ``position_ids`` raise for a
model whose masks transformers builds without them, GPT-OSS, since unsharded
its packed row is one sequence; ``shard_batch(cu_seqlens=...)`` runs its
documents). Logit soft-capping and attention sinks as under
``"longattn"`` (a sink's gradient on each rank sums its rows, summed over the
group with the other parameters' by ``context_parallel.all_reduce_grads``);
chunked attention by ``ring_attention_varlen``'s ``chunk_size``: the sharded
documents (or dense rows) cut at the chunk edges where the tokens lie (a
``layout="documents"`` batch runs all three through :func:`longattn.packed_attention`). The batch comes from
:func:`longattn.context_parallel.shard_batch`, whose ``longattn_cp`` entry
carries the group and layout to every attention call through the model's
keyword arguments: ``model(**batch)``. Problems are raised on every rank of the
group (one small all-gather per forward, at the first layer) so that no rank
waits in the ring. Generation (context-parallel inference) takes a
:class:`ShardedCache`, a transformers ``Cache`` whose layers are
:class:`longattn.KVCache` parts sharded over the group::

    out = model.generate(input_ids, past_key_values=lt.ShardedCache(group), max_new_tokens=64)

Every rank runs ``generate`` with the same prompt. Prefill: each rank keeps
the K/V of its pieces of the prompt (zigzag by default) and computes the
attention of its pieces' queries (the projections and MLPs, outside the
attention call, run on the whole prompt on every rank); decoding: each new
token's K/V goes to one rank and every rank attends to its part, merged by
lse (:meth:`longattn.KVCache.attend`). For a prefill sharded end to end, run
the prompt but its last token as a sharded batch first:
``model(**cp.shard_batch(input_ids[:, :-1]), past_key_values=cache)`` (ring
attention; each rank keeps its shard's K/V), then
``model.generate(input_ids, past_key_values=cache, ...)``. Prompts of one
length (no padding mask), greedy or sampled with the same seed on every rank;
no beam search. Soft-capping, sinks, sliding windows and chunked attention
run in the prefill (the pieces cut at chunk edges) and in every decoding step
(:meth:`longattn.KVCache.attend`'s ``softcap``, ``sinks``, ``window_size``,
``chunk_size``: Gemma 2, GPT-OSS, Llama 4). Every rank returns the same tokens.

``"longattn_dilated"`` — LongNet dilated attention
(:func:`longattn.dilated_attention`) with the branches read from the model
config: ``config.longattn_segment_lengths`` and ``config.longattn_dilation_rates``
(lists of ints, one (segment, rate) pair per branch). Causal as the layer
says. Right padding is exact under causal attention (padding comes after
every real token and positions, hence segments, are unchanged); left
padding, packed documents and sliding windows raise. Generation decodes from
the KV cache with :func:`longattn.dilated_decode_attention` (the last rows of
causal dilated attention: the tokens of ``generate(..., use_cache=False)``),
or from a :class:`ShardedCache` sharded over a group.

Raised, never ignored (each error names the setting to change): attention
dropout in training (``config.attention_dropout``), ``output_attentions=True``,
position biases, paged caches, a static cache, 4-D or other custom masks
(or-masks, bidirectional image-token blocks: use ``"sdpa"`` or
``"flex_attention"`` there), head counts that GQA cannot pair; logit
soft-capping, attention sinks and chunked attention under
``"longattn_dilated"`` (with a :class:`ShardedCache` too).

Modules: ``attention`` (the three attention calls), ``masks`` (the mask hooks
and the ``Documents`` they return, which transformers hands each attention
call as its ``attention_mask``), ``cp`` (the sharded batch in the ring call),
``generation`` (:class:`ShardedCache`; its layers reach the attention call
through the call's keyword arguments), ``checks`` (what every call refuses or
translates).
"""
from __future__ import annotations

import functools

from .attention import (DILATION_RATES_KEY, SEGMENT_LENGTHS_KEY, attention_forward, dilated_attention_forward,
                        ring_attention_forward)
from .masks import local_mask, ring_mask

__all__ = ["register", "NAMES", "SEGMENT_LENGTHS_KEY", "DILATION_RATES_KEY", "attention_forward",
           "ring_attention_forward", "dilated_attention_forward", "ShardedCache"]

NAMES = ("longattn", "longattn_ring", "longattn_dilated")


def register() -> tuple[str, ...]:
    """Register ``"longattn"``, ``"longattn_ring"`` and ``"longattn_dilated"`` with
    transformers (attention and mask functions); returns the names. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("longattn", attention_forward)
    AttentionInterface.register("longattn_ring", ring_attention_forward)
    AttentionInterface.register("longattn_dilated", dilated_attention_forward)
    AttentionMaskInterface.register("longattn", functools.partial(local_mask, impl="longattn"))
    AttentionMaskInterface.register("longattn_dilated", functools.partial(local_mask, impl="longattn_dilated"))
    AttentionMaskInterface.register("longattn_ring", ring_mask)
    return NAMES


def __getattr__(name: str):
    if name == "ShardedCache":  # in its own module: importing this package does not import transformers
        from .generation import ShardedCache

        return ShardedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
