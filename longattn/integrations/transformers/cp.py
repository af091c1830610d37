"""The sharded batch of :func:`longattn.context_parallel.shard_batch` in the
attention call of ``"longattn_ring"``: its :class:`~longattn.context_parallel.CPContext`
arrives as the ``longattn_cp`` keyword; problems are found on each rank and
raised on all of them (one small all-gather per forward, at the first layer)
so that no rank waits in the ring."""
from __future__ import annotations

import torch

import longattn
from longattn import context_parallel as _cp
from longattn.distributed import checks as rank_checks

from . import checks
from .masks import RingMask, mask_error


def context(kwargs, impl: str) -> _cp.CPContext:
    ctx = kwargs.get(checks.CP_KEY)
    if not isinstance(ctx, _cp.CPContext):
        raise ValueError(f"attn_implementation={impl!r} runs on a batch sharded by "
                         f"longattn.context_parallel.shard_batch: call model(**batch) with the dict it returns (its "
                         f"'{checks.CP_KEY}' entry carries the process group and layout)")
    return ctx


def check_sharded_call(impl: str, ctx: _cp.CPContext, query, key, attention_mask, kwargs, module,
                       ring: RingMask) -> None:
    """What a sharded batch cannot carry (ValueError). ``ring``: what the
    mask hook handed the layer (:class:`~.masks.RingMask`): masks built
    without position_ids, chunks cut on token indices."""
    if ctx.from_positions and not ring.positions:
        raise ValueError(
            f"attn_implementation={impl!r}: the sharded batch's documents come from position_ids that restart, "
            f"but this model ({type(module).__name__}) builds its attention masks without position_ids "
            f"(as transformers' GPT-OSS does: huggingface/transformers#39997), so unsharded ('eager', "
            f"'flex_attention', 'longattn') a packed row is one causal sequence whose documents see each other, "
            f"which the sharded batch cannot run. For documents, pass their boundaries as "
            f"longattn.context_parallel.shard_batch(cu_seqlens=...) (unsharded: the cu_seq_lens_q/k keywords with "
            f"'longattn', as transformers' flash-attention path); for one sequence, give position_ids that do not "
            f"restart")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        raise mask_error(impl, attention_mask)
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={impl!r}: an attention_mask with padding reached the model; give "
                         f"it to longattn.context_parallel.shard_batch(attention_mask=...) instead")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"attn_implementation={impl!r} runs training and prefill over a sharded sequence, "
                         f"without a KV cache (queries {query.shape[2]}, keys {key.shape[2]}): call the model "
                         f"with use_cache=False; generate with past_key_values=ShardedCache(group) "
                         f"(longattn.integrations.transformers)")
    if checks.flash_kwargs(kwargs) is not None:
        raise ValueError(f"attn_implementation={impl!r}: pass packed documents to "
                         f"longattn.context_parallel.shard_batch (cu_seqlens=...), not cu_seq_lens_q/k")
    if ctx.cu_seqlens is not None and query.shape[0] != 1:
        raise ValueError(f"attn_implementation={impl!r}: a packed batch is one row, got batch {query.shape[0]}")
    if ring.chunk is not None and ctx.cu_seqlens is not None:
        _check_chunks(impl, ctx, ring)


def _check_chunks(impl: str, ctx: _cp.CPContext, ring: RingMask) -> None:
    """Chunked attention on a packed stream: the ring cuts each document into
    chunks from its own start; transformers cuts them at multiples of the
    position ids (5.24 on) or of each row's token index (before): the same
    where every document starts on a chunk edge of that count (ValueError
    elsewhere; the same on every rank: the release and the batch are)."""
    import transformers

    if ring.chunk_on_index:
        off, count = _chunk_offsets(ctx, ring.chunk), "each row's token index"
        fix = "use transformers >= 5.24 (chunks on the documents' position ids)"
    elif ctx.first_positions is not None:
        off, count = ctx.first_positions % ring.chunk, "the position ids"
        fix = "give every document position ids that start at 0"
    else:
        return
    if bool(off.any()):
        raise ValueError(
            f"attn_implementation={impl!r}: transformers {transformers.__version__} cuts chunked attention's chunks "
            f"(attention_chunk_size={ring.chunk}) at multiples of {count}, and {int((off != 0).sum())} of the "
            f"sharded batch's documents start inside a chunk, where the ring cuts each document from its own "
            f"start: {fix}, start every document on a multiple of {ring.chunk} tokens, or run the model unsharded "
            f"with attn_implementation='longattn'")


def _chunk_offsets(ctx: _cp.CPContext, chunk: int) -> torch.Tensor:
    """Per document of the packed stream, its first token's index in its row
    counted from the row's first real token, modulo ``chunk``: where
    transformers cuts chunks on token indices, the ring's per-document chunks
    agree with it only where this is 0 (documents from padding start at
    their row's first real token: always 0)."""
    idx = ctx.token_index.long().cpu()
    row, col = idx // ctx.seqlen, idx % ctx.seqlen
    first = torch.full((ctx.batch_size,), ctx.seqlen, dtype=torch.long, device="cpu")
    first = first.scatter_reduce(0, row, col, "amin")
    starts = ctx.cu_seqlens[:-1].long().cpu()
    starts = starts[starts < len(idx)]
    return (col[starts] - first[row[starts]]) % chunk


def agree(module, group, impl: str, problem, **facts) -> None:
    """Raise ``problem`` on every rank of ``group`` (at the first layer, with
    the facts that must match across ranks), or here alone at later layers,
    which every rank reaches only when the first agreed."""
    if checks.first_layer(module):
        rank_checks.agree(group, impl, problem, **facts)
    elif problem is not None:
        raise problem


def ring_forward(ctx: _cp.CPContext, q, k, v, causal: bool, scaling, sliding_window, scores: dict, chunk=None):
    """Ring attention of this rank's shard, (batch, seq, heads, dim): dense rows,
    or the packed stream on the global document boundaries (documents held whole
    under ``layout="documents"``: :func:`longattn.packed_attention`). ``scores``:
    softcap and sinks; ``chunk``: chunked attention's chunk size (or None)."""
    if ctx.cu_seqlens is None and (chunk is None or chunk >= ctx.seqlen):
        return longattn.ring_attention(q, k, v, causal=causal, softmax_scale=scaling,
                                       window_size=checks.window(sliding_window, causal, ctx.seqlen),
                                       layout=ctx.layout, group=ctx.group, **scores)
    if ctx.cu_seqlens is None:  # chunks of dense rows: the rows as documents (each row's shard in the varlen layout)
        return _dense_chunks(ctx, q, k, v, causal, scaling, sliding_window, scores, chunk)
    lens = ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1]
    window = checks.window(sliding_window, causal, int(lens.max()))
    return ctx.attention_varlen(q[0], k[0], v[0], causal=causal, softmax_scale=scaling, window_size=window,
                                chunk_size=chunk, **scores)[None]


def _dense_chunks(ctx: _cp.CPContext, q, k, v, causal, scaling, sliding_window, scores, chunk):
    """Chunked attention over dense rows of ``ctx.seqlen`` (divisible by the
    layout's parts, as shard_batch made them): the zigzag shards of b rows
    are those of b documents of that length packed (one call); a contiguous
    shard is a one-document stream's (one call per row)."""
    b, l = q.shape[:2]
    window = checks.window(sliding_window, causal, ctx.seqlen)
    rows = b if ctx.layout == "zigzag" else 1
    cu = torch.arange(rows + 1, dtype=torch.int32, device="cpu") * ctx.seqlen
    run = lambda x, y, z: longattn.ring_attention_varlen(x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:]),
                                                         z.reshape(-1, *z.shape[2:]), cu, layout=ctx.layout,
                                                         causal=causal, softmax_scale=scaling, window_size=window,
                                                         chunk_size=chunk, group=ctx.group, **scores)
    if rows == b:
        return run(q, k, v).view(b, l, *q.shape[2:])
    return torch.stack([run(q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(b)])
