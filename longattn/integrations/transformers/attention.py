"""The attention calls, one per implementation, with transformers' signature
``(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
**kwargs) -> (out, None)``: query ``(batch, heads, q_len, dim)``, key/value
``(batch, kv_heads, kv_len, dim)``, out ``(batch, q_len, heads, dim)``. Each
translates the call into longattn's public ops and refuses what they cannot
run; ``attention_mask`` is what the mask hook returned (:mod:`.masks`)."""
from __future__ import annotations

from typing import Optional

import torch

import longattn

from . import checks, cp
from .masks import Documents, RingMask, causal_and_window, documents_of

SEGMENT_LENGTHS_KEY = "longattn_segment_lengths"
DILATION_RATES_KEY = "longattn_dilation_rates"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """``attn_implementation="longattn"``: :func:`longattn.attention`, or
    :func:`longattn.attention_varlen` on the real tokens of padded or packed
    rows. Equivalent to transformers' ``"sdpa"``/``"eager"`` on every real
    token (see the package docstring)."""
    impl = "longattn"
    if checks.sharded_layer(kwargs, key, value, module) is not None:
        raise ValueError(f"attn_implementation={impl!r} got a ShardedCache: it serves 'longattn_ring' and "
                         f"'longattn_dilated'; use the default cache with 'longattn'")
    causal, value, dv = checks.check_call(impl, module, query, key, value, dropout, softcap, kwargs, scores=True)
    docs = documents_of(attention_mask, query.shape[2], impl) if attention_mask is not None else None
    causal, sliding_window = causal_and_window(docs, causal, sliding_window, impl)
    fa = checks.flash_kwargs(kwargs)
    q, k, v = checks.to_bshd(query, key, value)
    # Gemma 2's logit soft-capping and GPT-OSS's sinks (s_aux, one logit per query head)
    scores = dict(softcap=float(softcap or 0.0), sinks=kwargs.get("s_aux"))
    if fa is not None and docs is not None and docs.pattern is not None and docs.pattern.chunk is not None:
        if not docs.packed:  # the chunks are cut inside the documents that position ids give
            raise ValueError(f"attn_implementation={impl!r}: chunked attention with cu_seq_lens_q/k needs the "
                             f"position_ids that restart at each document (and use_cache=False)")
        fa = None
    if docs is not None and (not docs.packed or fa is None):
        out = _documents_attention(impl, q, k, v, docs, causal, scaling, sliding_window, scores)
    elif fa is not None:
        out = _flash_kwargs_attention(impl, q, k, v, fa, causal, scaling, sliding_window, scores)
    else:
        out = longattn.attention(q, k, v, causal=causal, softmax_scale=scaling,
                                 window_size=checks.window(sliding_window, causal, k.shape[1]), **scores)
    return checks.crop(out, dv)


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                           sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """``attn_implementation="longattn_ring"``: this rank's shard of the
    sequence (the batch made by :func:`longattn.context_parallel.shard_batch`,
    passed as ``model(**batch)``) through :func:`longattn.ring_attention` or
    :func:`longattn.ring_attention_varlen`; or a :class:`ShardedCache` layer."""
    impl = "longattn_ring"
    layer = checks.sharded_layer(kwargs, key, value, module)
    if layer is not None:
        from .generation import sharded_layer_forward  # loaded already: the layer comes from there

        return sharded_layer_forward(impl, layer, module, query, key, value, attention_mask, scaling, dropout,
                                     sliding_window, softcap, kwargs)
    ctx = cp.context(kwargs, impl)
    ring = attention_mask if isinstance(attention_mask, RingMask) else RingMask()
    chunk = ring.chunk
    attention_mask = None if isinstance(attention_mask, RingMask) else attention_mask
    problem, causal, dv = None, True, value.shape[-1]
    try:
        causal, value, dv = checks.check_call(impl, module, query, key, value, dropout, softcap, kwargs, scores=True)
        cp.check_sharded_call(impl, ctx, query, key, attention_mask, kwargs, module, ring)
    except ValueError as e:
        problem = e
    cp.agree(module, ctx.group, impl, problem, q=tuple(query.shape), k=tuple(key.shape), dtype=str(query.dtype),
             causal=causal, window=sliding_window, layout=ctx.layout, softcap=softcap, chunk=chunk,
             sinks=kwargs.get("s_aux") is not None)
    q, k, v = checks.to_bshd(query, key, value)
    # Gemma 2's logit soft-capping, GPT-OSS's sinks, Llama 4's chunks, as in the one-device call
    scores = dict(softcap=float(softcap or 0.0), sinks=kwargs.get("s_aux"))
    return checks.crop(cp.ring_forward(ctx, q, k, v, causal, scaling, sliding_window, scores, chunk), dv)


def dilated_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask, scaling: Optional[float] = None, dropout: float = 0.0,
                              sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """``attn_implementation="longattn_dilated"``: :func:`longattn.dilated_attention`
    with the branches of ``config.longattn_segment_lengths`` /
    ``config.longattn_dilation_rates``; decoding from the KV cache through
    :func:`longattn.dilated_decode_attention`, or a :class:`ShardedCache` layer."""
    impl = "longattn_dilated"
    layer = checks.sharded_layer(kwargs, key, value, module)  # first: a call that raises has still read its layer
    causal, padded, dv = checks.check_call(impl, module, query, key, value, dropout, softcap, kwargs)
    branches = _branches(impl, module, sliding_window)
    if layer is not None:
        from .generation import sharded_layer_forward  # loaded already: the layer comes from there

        return sharded_layer_forward(impl, layer, module, query, key, value, attention_mask, scaling, dropout,
                                     sliding_window, softcap, kwargs, branches)
    if checks.flash_kwargs(kwargs) is not None:
        raise ValueError(f"attn_implementation={impl!r} does not run packed documents (cu_seq_lens_q/k)")
    if attention_mask is not None:
        docs = documents_of(attention_mask, query.shape[2], impl)
        if docs.packed:
            raise ValueError(f"attn_implementation={impl!r} does not run packed documents (position_ids that "
                             f"restart); pass one sequence per row")
        if not (docs.right_padded and causal):
            raise ValueError(f"attn_implementation={impl!r}: only right padding is exact (causal, padding after "
                             f"every real token); set tokenizer.padding_side = 'right'")
    q, k, v = checks.to_bshd(query, key, padded)
    if q.shape[1] != k.shape[1]:  # decoding: the queries are the last tokens of the cache
        if not causal:
            raise ValueError(f"attn_implementation={impl!r}: decoding from a KV cache needs a causal layer")
        lens = torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device="cpu")
        out = longattn.dilated_decode_attention(q, k, v, cache_seqlens=lens, softmax_scale=scaling, **branches)
    else:
        out = longattn.dilated_attention(q, k, v, causal=causal, softmax_scale=scaling, **branches)
    return checks.crop(out, dv)


def _branches(impl: str, module, sliding_window) -> dict:
    cfg = getattr(module, "config", None)
    segs, rates = getattr(cfg, SEGMENT_LENGTHS_KEY, None), getattr(cfg, DILATION_RATES_KEY, None)
    if segs is None or rates is None:
        raise ValueError(f"attn_implementation={impl!r} reads its branches from the model config: set "
                         f"config.{SEGMENT_LENGTHS_KEY} (e.g. [2048, 4096, 8192]) and config.{DILATION_RATES_KEY} "
                         f"(e.g. [1, 2, 4]) before building the model")
    if sliding_window is not None:
        raise ValueError(f"attn_implementation={impl!r}: this layer has a sliding window ({sliding_window}); dilated "
                         f"attention replaces it: set config.sliding_window = None (Qwen2: use_sliding_window=False) "
                         f"or use attn_implementation='longattn'")
    return dict(segment_lengths=[int(x) for x in segs], dilation_rates=[int(x) for x in rates])


def _documents_attention(impl, q, k, v, docs: Documents, causal, scale, sliding_window, scores) -> torch.Tensor:
    """Attention within the documents of the real tokens; padding rows 0."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    window = checks.window(sliding_window, causal, docs.max_k)
    if window != (-1, -1) and docs.holes:
        raise ValueError(f"attn_implementation={impl!r}: a sliding window with padding between real tokens "
                         f"is not exact after unpadding; pad only on the left or the right")
    if docs.q_idx.numel() == b * sq and docs.k_idx.numel() == b * sk:
        # no padding (packed documents filling every row): the indices are the identity, and gathering q, k, v
        # and scattering the output back would be four passes over them per layer for nothing
        o = _varlen_qk(q.reshape(b * sq, h, d), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
                       docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, causal, scale, window, scores)
        return o.view(b, sq, h, d)
    qf = q.reshape(b * sq, h, d).index_select(0, docs.q_idx)
    kf = k.reshape(b * sk, *k.shape[2:]).index_select(0, docs.k_idx)
    vf = v.reshape(b * sk, *v.shape[2:]).index_select(0, docs.k_idx)
    o = _varlen_qk(qf, kf, vf, docs.cu_q, docs.cu_k, docs.max_q, docs.max_k, causal, scale, window, scores)
    return o.new_zeros(b * sq, h, d).index_copy(0, docs.q_idx, o).view(b, sq, h, d)


def _flash_kwargs_attention(impl, q, k, v, fa, causal, scale, sliding_window, scores) -> torch.Tensor:
    """Packed documents given as transformers' flash-attention keywords."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cu_q, cu_k, max_q, max_k = fa
    cu_q, cu_k = cu_q.to(torch.int32).cpu(), cu_k.to(torch.int32).cpu()
    if int(cu_q[-1]) != b * sq or int(cu_k[-1]) != b * sk:
        raise ValueError(f"attn_implementation={impl!r}: cu_seq_lens_q/k end at {int(cu_q[-1])}/{int(cu_k[-1])} "
                         f"but the layer has {b * sq}/{b * sk} tokens (batch x seq)")
    window = checks.window(sliding_window, causal, int(max_k))
    o = _varlen_qk(q.reshape(b * sq, h, d), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
                   cu_q, cu_k, int(max_q), int(max_k), causal, scale, window, scores)
    return o.view(b, sq, h, d)


def _varlen_qk(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, scores):
    """Attention within documents whose queries are the last tokens of each
    document's keys ((total_q, H, D), (total_k, Hkv, D); int32 cu_q, cu_k);
    bottom-right causal inside each document. ``scores``: softcap and sinks."""
    if torch.equal(cu_q, cu_k):
        return longattn.attention_varlen(q, k, v, cu_q, max_seqlen=max(max_q, 1), causal=causal,
                                         softmax_scale=scale, window_size=window, **scores)
    # attention_varlen takes one cu_seqlens for queries and keys: one call per document.
    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for a, e, c, f in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if e > a:
            outs.append(longattn.attention(q[None, a:e], k[None, c:f], v[None, c:f], causal=causal,
                                           softmax_scale=scale, window_size=window, **scores)[0])
    return torch.cat(outs) if outs else q.new_zeros(q.shape)
