"""longattn as the attention of Hugging Face transformers models (transformers >= 5).

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
      (return_flash_attn_kwargs=True)``), which always count;
    * ``sliding_window`` (Mistral, Qwen2, ...): a key is seen when
      ``q - k < sliding_window`` (causal), i.e. ``window_size=(sliding_window - 1, 0)``,
      as transformers' own masks; bidirectional layers ``|q - k| <= sliding_window``;
    * GQA natively (K/V keep their heads); ``scaling`` as the softmax scale.

``"longattn_ring"`` — the sequence sharded over a process group (context
parallelism), :func:`longattn.ring_attention` (zigzag layout by default) or, for
padding and packed documents, :func:`longattn.ring_attention_varlen` on the global
document boundaries. The batch comes from
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
length (no padding mask), no sliding window, greedy or sampled with the same
seed on every rank; no beam search. Every rank returns the same tokens.

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
dropout in training (``config.attention_dropout``), logit soft-capping,
``output_attentions=True``, attention sinks, position biases, paged caches, a
static cache, 4-D or other custom masks (chunked attention, bidirectional
image-token blocks: use ``"sdpa"`` or ``"flex_attention"`` there), head counts
that GQA cannot pair.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

import longattn
from longattn import context_parallel as _cp
from longattn.distributed import checks as _checks
from longattn.distributed.cache import prefill_pieces

__all__ = ["register", "NAMES", "SEGMENT_LENGTHS_KEY", "DILATION_RATES_KEY", "attention_forward",
           "ring_attention_forward", "dilated_attention_forward", "ShardedCache"]

NAMES = ("longattn", "longattn_ring", "longattn_dilated")
SEGMENT_LENGTHS_KEY = "longattn_segment_lengths"
DILATION_RATES_KEY = "longattn_dilation_rates"


def register() -> tuple[str, ...]:
    """Register ``"longattn"``, ``"longattn_ring"`` and ``"longattn_dilated"`` with
    transformers (attention and mask functions); returns the names. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("longattn", attention_forward)
    AttentionInterface.register("longattn_ring", ring_attention_forward)
    AttentionInterface.register("longattn_dilated", dilated_attention_forward)
    AttentionMaskInterface.register("longattn", functools.partial(_local_mask, impl="longattn"))
    AttentionMaskInterface.register("longattn_dilated", functools.partial(_local_mask, impl="longattn_dilated"))
    AttentionMaskInterface.register("longattn_ring", _ring_mask)
    return NAMES


# ----------------------------------------------------------------------------- masks
@dataclasses.dataclass(frozen=True)
class _Pattern:
    """What a transformers mask function describes, when longattn can run it."""

    causal: Optional[bool] = None
    window: Optional[int] = None  # causal sliding window: kv > q - window
    bidirectional_window: Optional[int] = None  # |q - kv| <= window
    packed: Optional[torch.Tensor] = None  # (batch, seq) document index of each token


def _unsupported(impl: str, what: str) -> ValueError:
    return ValueError(
        f"attn_implementation={impl!r}: this model's attention mask contains {what}, which longattn cannot "
        f"express (it runs causal or bidirectional attention, sliding windows, padding and packed documents); "
        f"use attn_implementation='sdpa' or 'flex_attention' for this model")


def _read_pattern(fn, impl: str) -> _Pattern:
    """Walk the closures transformers.masking_utils builds (and_masks of causal,
    sliding-window and packed-sequence parts) and return what they say; any
    other part (chunked attention, or_masks, block overlays, user functions)
    raises."""
    import transformers.masking_utils as mu

    found: dict = {}

    def visit(f):
        name = getattr(f, "__qualname__", type(f).__name__)
        if getattr(f, "__module__", None) != mu.__name__:
            raise _unsupported(impl, f"a custom mask function ({name})")
        cells = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in (f.__closure__ or ()))))
        if f is mu.causal_mask_function:
            found["causal"] = True
        elif f is mu.bidirectional_mask_function:
            found["causal"] = False
        elif name == "and_masks.<locals>.and_mask":
            for g in cells["mask_functions"]:
                visit(g)
        elif name == "sliding_window_overlay.<locals>.inner_mask":
            found["window"] = int(cells["sliding_window"])
        elif name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
            found["bidirectional_window"] = int(cells["sliding_window"])
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            found["packed"] = cells["packed_sequence_mask"]
        elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            # Inside a document positions rise by 1, so the wrapped causal/window
            # function on positions equals itself on indices.
            visit(cells["mask_function"])
        else:
            raise _unsupported(impl, f"the part {name!r} (e.g. chunked attention or image-token blocks)")

    visit(fn if fn is not None else mu.causal_mask_function)
    return _Pattern(**found)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Real tokens of a (batch, kv_len) document-id mask as packed documents.

    Queries are the last ``q_len`` key positions of each row (the cache holds
    the tokens up to the last query). ``q_idx``/``k_idx``: flat indices of
    real tokens in ``batch * q_len`` / ``batch * kv_len``; documents in the same
    order for both, ``cu_q``/``cu_k`` int32 (a document may have no query)."""

    q_len: int
    kv_len: int
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    packed: bool  # documents from position ids (not padding)
    holes: bool  # some row has padding between real tokens
    right_padded: bool  # every row: real tokens first, then padding; one document per row
    pattern: Optional[_Pattern] = None


def _make_plan(ids: torch.Tensor, q_len: int, packed: bool, pattern: Optional[_Pattern] = None) -> _Plan:
    b, kv = ids.shape
    valid = ids > 0
    k_idx = torch.nonzero(valid.reshape(-1)).flatten()
    m = int(ids.max()) + 1
    key_doc = (k_idx // kv) * m + ids.reshape(-1)[k_idx].long()
    docs, k_counts = torch.unique_consecutive(key_doc, return_counts=True)
    qv = valid[:, kv - q_len:]
    q_idx = torch.nonzero(qv.reshape(-1)).flatten()
    q_rows, q_cols = q_idx // q_len, q_idx % q_len + (kv - q_len)
    q_doc = q_rows * m + ids[q_rows, q_cols].long()
    q_counts = torch.bincount(torch.searchsorted(docs, q_doc), minlength=docs.numel())
    cu = lambda c: torch.cat([c.new_zeros(1), c.cumsum(0)]).to(torch.int32).cpu()
    n = valid.sum(1)
    first = valid.float().argmax(1)
    last = kv - 1 - valid.flip(1).float().argmax(1)
    holes = bool(((n > 0) & (last - first + 1 != n)).any())
    right = (not packed) and bool(((n == 0) | ((first == 0) & (last == n - 1))).all())
    return _Plan(q_len, kv, q_idx, k_idx, cu(q_counts), cu(k_counts), int(q_counts.max()), int(k_counts.max()),
                 packed, holes, right, pattern)


def _check_offsets(impl, q_length, kv_length, q_offset, kv_offset) -> None:
    q_offset = int(q_offset)
    if q_offset - int(kv_offset) != kv_length - q_length:
        raise ValueError(
            f"attn_implementation={impl!r}: the KV cache holds keys beyond the last query (kv_length={kv_length}, "
            f"q_offset={q_offset}: a static cache); use the default dynamic cache (no "
            f"cache_implementation='static'), or attn_implementation='sdpa'")


def _local_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function=None, attention_mask: Optional[torch.Tensor] = None, *, impl: str = "longattn",
                **kwargs) -> Optional[torch.Tensor]:
    """transformers' mask hook for "longattn" / "longattn_dilated": None when
    every key is a real token of one sequence (dense attention); otherwise the
    2-D mask (bool padding mask as flash-attention gets it, or int32 document
    ids for packed sequences) with the packed-document plan attached."""
    pattern = _read_pattern(mask_function, impl)
    _check_offsets(impl, q_length, kv_length, q_offset, kv_offset)
    if pattern.packed is not None:
        ids = (pattern.packed.expand(batch_size, -1) + 1).to(torch.int32).contiguous()
        mask, packed = ids, True
    elif attention_mask is not None:
        pad = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
        if pad.shape[-1] < kv_length:  # as transformers: keys past the 2-D mask are not keys
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]))
        if bool(pad.all()):
            return None
        mask, ids, packed = pad.clone(), pad.to(torch.int32), False
    else:
        return None
    mask._longattn_plan = _make_plan(ids, q_length, packed, pattern)
    return mask


def _ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask hook for "longattn_ring": the sharded batch carries the
    documents (CPContext); local position ids jump between zigzag chunks and are
    not documents. A padding mask that reaches the model is returned so that
    the attention call reports it on every rank."""
    _read_pattern(mask_function, "longattn_ring")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return attention_mask
    return None


def _plan_of(mask: torch.Tensor, q_len: int, impl: str) -> _Plan:
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        plan = getattr(mask, "_longattn_plan", None)
        if plan is None:  # a 2-D padding mask that did not come from our mask hook
            plan = _make_plan((mask != 0).to(torch.int32), q_len, False)
        if plan.q_len != q_len:
            raise ValueError(f"attn_implementation={impl!r}: the attention mask was built for {plan.q_len} queries, "
                             f"the layer has {q_len}")
        return plan
    raise _mask_error(impl, mask)


def _mask_error(impl: str, mask) -> ValueError:
    shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
    return ValueError(
        f"attn_implementation={impl!r}: got a {shape} attention mask; longattn takes padding as a 2-D "
        f"(batch, seq) attention_mask and packed documents as position_ids or cu_seq_lens_q/k, and cannot run an "
        f"arbitrary 4-D mask: pass a 2-D mask, or use attn_implementation='sdpa' (or 'flex_attention') for "
        f"custom masks")


# ------------------------------------------------------------------ shared checks
def _check_call(impl: str, module, query, key, value, dropout, softcap, kwargs):
    """Raise on what longattn does not run; return (causal, value, value head
    dim) with value's head dim padded to the query's (exact: zero columns give
    zero output columns, cropped after)."""
    if dropout:
        raise ValueError(f"attn_implementation={impl!r} has no attention dropout (got dropout={dropout}, used in "
                         f"training): set the model's config.attention_dropout = 0.0, or use "
                         f"attn_implementation='sdpa'")
    if softcap is not None:
        raise ValueError(f"attn_implementation={impl!r} has no attention logit soft-capping (softcap={softcap}): "
                         f"set the model config's soft-capping (e.g. config.attn_logit_softcapping) to None, or use "
                         f"attn_implementation='eager'")
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation={impl!r} does not return attention weights: call the model with "
                         f"output_attentions=False, or use attn_implementation='eager'")
    for name, what in (("s_aux", "attention sinks"), ("position_bias", "an additive position bias"),
                       ("cache", "a paged cache (continuous batching)")):
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation={impl!r} cannot run {what} ({name}=...): use "
                             f"attn_implementation='sdpa' or 'eager' for this model")
    hq, hk, d, dv = query.shape[1], key.shape[1], query.shape[-1], value.shape[-1]
    if hk == 0 or hq % hk:
        raise ValueError(f"attn_implementation={impl!r}: num_attention_heads ({hq}) must be a multiple of "
                         f"num_key_value_heads ({hk}) for grouped-query attention; fix the model config")
    if key.shape[-1] != d or dv > d:
        raise ValueError(f"attn_implementation={impl!r}: query/key head dims {d}/{key.shape[-1]} must match and "
                         f"the value head dim ({dv}) must not exceed them; use attn_implementation='sdpa'")
    if dv < d:
        value = torch.nn.functional.pad(value, (0, d - dv))
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    return causal, value, dv


def _autocast(query, key, value):
    """Under autocast, q/k/v in the autocast dtype, as autocast does for SDPA
    (RoPE in float32 can leave q/k in float32 while v is already bf16)."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return query.to(dt), key.to(dt), value.to(dt)
    return query, key, value


def _window(sliding_window, causal: bool, length: int) -> tuple[int, int]:
    """transformers' sliding window as longattn's window_size; none when it
    cannot cut anything at this length."""
    if sliding_window is None or sliding_window >= length:
        return (-1, -1)
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w, w)


def _varlen_qk(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
    """Attention within documents whose queries are the last tokens of each
    document's keys ((total_q, H, D), (total_k, Hkv, D); int32 cu_q, cu_k);
    bottom-right causal inside each document."""
    if torch.equal(cu_q, cu_k):
        return longattn.attention_varlen(q, k, v, cu_q, max_seqlen=max(max_q, 1), causal=causal,
                                         softmax_scale=scale, window_size=window)
    # attention_varlen takes one cu_seqlens for queries and keys: one call per document.
    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for a, e, c, f in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if e > a:
            outs.append(longattn.attention(q[None, a:e], k[None, c:f], v[None, c:f], causal=causal,
                                           softmax_scale=scale, window_size=window)[0])
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def _flash_kwargs(kwargs) -> Optional[tuple]:
    got = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    return tuple(got) if all(x is not None for x in got) else None


# ----------------------------------------------------------------- attention calls
def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, sliding_window: Optional[int] = None,
                      softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention call for ``attn_implementation="longattn"``.

    query ``(batch, heads, q_len, dim)``, key/value ``(batch, kv_heads, kv_len, dim)``
    -> ``((batch, q_len, heads, dim), None)``. Equivalent to transformers'
    ``"sdpa"``/``"eager"`` on every real token (see the module docstring)."""
    impl = "longattn"
    if getattr(key, "_longattn_layer", None) is not None:
        raise ValueError(f"attn_implementation={impl!r} got a ShardedCache: it serves 'longattn_ring' and "
                         f"'longattn_dilated'; use the default cache with 'longattn'")
    causal, value, dv = _check_call(impl, module, query, key, value, dropout, softcap, kwargs)
    query, key, value = _autocast(query, key, value)
    b, h, sq, d = query.shape
    sk = key.shape[2]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    plan = _plan_of(attention_mask, sq, impl) if attention_mask is not None else None
    fa = _flash_kwargs(kwargs)
    if plan is not None and plan.pattern is not None:  # where transformers built a mask, it is the truth
        pat = plan.pattern
        causal = causal if pat.causal is None else pat.causal
        mask_window = pat.window if pat.window is not None else pat.bidirectional_window
        if sliding_window is not None and mask_window != sliding_window:
            raise ValueError(f"attn_implementation={impl!r}: the layer's sliding_window ({sliding_window}) differs "
                             f"from its mask's ({mask_window})")
        sliding_window = mask_window
    if plan is not None and (not plan.packed or fa is None):
        window = _window(sliding_window, causal, plan.max_k)
        if window != (-1, -1) and plan.holes:
            raise ValueError(f"attn_implementation={impl!r}: a sliding window with padding between real tokens "
                             f"is not exact after unpadding; pad only on the left or the right")
        qf = q.reshape(b * sq, h, d).index_select(0, plan.q_idx)
        kf = k.reshape(b * sk, *k.shape[2:]).index_select(0, plan.k_idx)
        vf = v.reshape(b * sk, *v.shape[2:]).index_select(0, plan.k_idx)
        o = _varlen_qk(qf, kf, vf, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, causal, scaling, window)
        out = o.new_zeros(b * sq, h, d).index_copy(0, plan.q_idx, o).view(b, sq, h, d)
    elif fa is not None:
        cu_q, cu_k, max_q, max_k = fa
        cu_q, cu_k = cu_q.to(torch.int32).cpu(), cu_k.to(torch.int32).cpu()
        if int(cu_q[-1]) != b * sq or int(cu_k[-1]) != b * sk:
            raise ValueError(f"attn_implementation={impl!r}: cu_seq_lens_q/k end at {int(cu_q[-1])}/{int(cu_k[-1])} "
                             f"but the layer has {b * sq}/{b * sk} tokens (batch x seq)")
        window = _window(sliding_window, causal, int(max_k))
        o = _varlen_qk(q.reshape(b * sq, h, d), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]),
                       cu_q, cu_k, int(max_q), int(max_k), causal, scaling, window)
        out = o.view(b, sq, h, d)
    else:
        out = longattn.attention(q, k, v, causal=causal, softmax_scale=scaling,
                                 window_size=_window(sliding_window, causal, sk))
    return (out[..., :dv] if dv != d else out), None


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                           dropout: float = 0.0, sliding_window: Optional[int] = None,
                           softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention call for ``attn_implementation="longattn_ring"``: this
    rank's shard of the sequence (the batch made by
    :func:`longattn.context_parallel.shard_batch`, passed as ``model(**batch)``)."""
    impl = "longattn_ring"
    layer = getattr(key, "_longattn_layer", None)
    if layer is not None:
        return _cached_forward(impl, layer, module, query, key, value, attention_mask, scaling, dropout,
                               sliding_window, softcap, kwargs)
    ctx = kwargs.get("longattn_cp")
    if not isinstance(ctx, _cp.CPContext):
        raise ValueError(f"attn_implementation={impl!r} runs on a batch sharded by "
                         f"longattn.context_parallel.shard_batch: call model(**batch) with the dict it returns (its "
                         f"'longattn_cp' entry carries the process group and layout)")
    problem, causal, dv = None, True, value.shape[-1]
    try:
        causal, value, dv = _check_call(impl, module, query, key, value, dropout, softcap, kwargs)
        if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
            raise _mask_error(impl, attention_mask)
        if attention_mask is not None:
            raise ValueError(f"attn_implementation={impl!r}: an attention_mask with padding reached the model; give "
                             f"it to longattn.context_parallel.shard_batch(attention_mask=...) instead")
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"attn_implementation={impl!r} runs training and prefill over a sharded sequence, "
                             f"without a KV cache (queries {query.shape[2]}, keys {key.shape[2]}): call the model "
                             f"with use_cache=False; generate with past_key_values=ShardedCache(group) "
                             f"(longattn.integrations.transformers)")
        if _flash_kwargs(kwargs) is not None:
            raise ValueError(f"attn_implementation={impl!r}: pass packed documents to "
                             f"longattn.context_parallel.shard_batch (cu_seqlens=...), not cu_seq_lens_q/k")
        if ctx.cu_seqlens is not None and query.shape[0] != 1:
            raise ValueError(f"attn_implementation={impl!r}: a packed batch is one row, got batch {query.shape[0]}")
    except ValueError as e:
        problem = e
    if getattr(module, "layer_idx", None) in (None, 0):  # once per forward: every rank raises together
        _checks.agree(ctx.group, impl, problem, q=tuple(query.shape), k=tuple(key.shape), dtype=str(query.dtype),
                  causal=causal, window=sliding_window, layout=ctx.layout)
    elif problem is not None:
        raise problem
    query, key, value = _autocast(query, key, value)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if ctx.cu_seqlens is None:
        window = _window(sliding_window, causal, ctx.seqlen)
        out = longattn.ring_attention(q, k, v, causal=causal, softmax_scale=scaling, window_size=window,
                                      layout=ctx.layout, group=ctx.group)
    else:
        lens = ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1]
        window = _window(sliding_window, causal, int(lens.max()))
        out = longattn.ring_attention_varlen(q[0], k[0], v[0], ctx.cu_seqlens, layout=ctx.layout, causal=causal,
                                             softmax_scale=scaling, window_size=window, group=ctx.group)[None]
    return (out[..., :dv] if dv != out.shape[-1] else out), None


def dilated_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                              dropout: float = 0.0, sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention call for ``attn_implementation="longattn_dilated"``:
    :func:`longattn.dilated_attention` with the branches of
    ``config.longattn_segment_lengths`` / ``config.longattn_dilation_rates``."""
    impl = "longattn_dilated"
    causal, padded, dv = _check_call(impl, module, query, key, value, dropout, softcap, kwargs)
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
    branches = dict(segment_lengths=[int(x) for x in segs], dilation_rates=[int(x) for x in rates])
    layer = getattr(key, "_longattn_layer", None)
    if layer is not None:
        return _cached_forward(impl, layer, module, query, key, value, attention_mask, scaling, dropout,
                               sliding_window, softcap, kwargs, branches)
    if _flash_kwargs(kwargs) is not None:
        raise ValueError(f"attn_implementation={impl!r} does not run packed documents (cu_seq_lens_q/k)")
    if attention_mask is not None:
        plan = _plan_of(attention_mask, query.shape[2], impl)
        if plan.packed:
            raise ValueError(f"attn_implementation={impl!r} does not run packed documents (position_ids that "
                             f"restart); pass one sequence per row")
        if not (plan.right_padded and causal):
            raise ValueError(f"attn_implementation={impl!r}: only right padding is exact (causal, padding after "
                             f"every real token); set tokenizer.padding_side = 'right'")
    query, key, value = _autocast(query, key, padded)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if q.shape[1] != k.shape[1]:  # decoding: the queries are the last tokens of the cache
        if not causal:
            raise ValueError(f"attn_implementation={impl!r}: decoding from a KV cache needs a causal layer")
        lens = torch.full((k.shape[0],), k.shape[1], dtype=torch.int32)
        out = longattn.dilated_decode_attention(q, k, v, cache_seqlens=lens, softmax_scale=scaling, **branches)
    else:
        out = longattn.dilated_attention(q, k, v, causal=causal, softmax_scale=scaling, **branches)
    return (out[..., :dv] if dv != out.shape[-1] else out), None


# ------------------------------------------------------------ generation over ranks
def _cached_forward(impl: str, layer, module, query, key, value, attention_mask, scaling, dropout, sliding_window,
                    softcap, kwargs, branches: Optional[dict] = None):
    """The attention call of a layer whose cache is a :class:`ShardedCache`
    layer: ``key``/``value`` are the tokens of this forward (the cache's
    ``update`` already appended them when decoding)."""
    cache = layer.owner
    g = cache.group
    ctx = kwargs.get("longattn_cp")
    problem, causal, dv = None, True, value.shape[-1]
    try:
        causal, value, dv = _check_call(impl, module, query, key, value, dropout, softcap, kwargs)
        if attention_mask is not None:
            raise ValueError(f"attn_implementation={impl!r} with a ShardedCache: got a padding mask; generate from "
                             f"prompts of one length (no padding), or one prompt per call")
        if sliding_window is not None:
            raise ValueError(f"attn_implementation={impl!r} with a ShardedCache has no sliding window (this layer has "
                             f"{sliding_window}); set config.sliding_window = None or use the default cache")
        if not causal:
            raise ValueError(f"attn_implementation={impl!r}: decoding from a ShardedCache needs a causal layer")
        if ctx is not None:
            if branches is not None or layer.kv is not None or ctx.cu_seqlens is not None:
                raise ValueError(f"attn_implementation={impl!r}: a sharded batch (longattn_cp) fills an empty "
                                 f"ShardedCache with dense rows of one length under 'longattn_ring' (no padding, no "
                                 f"packed documents); decode with model.generate(input_ids, past_key_values=cache)")
            if _checks.group_name(ctx.group) != _checks.group_name(g):
                raise ValueError(f"attn_implementation={impl!r}: the sharded batch's group differs from the "
                                 f"ShardedCache's group")
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"attn_implementation={impl!r}: the ShardedCache returned {key.shape[2]} keys for "
                             f"{query.shape[2]} queries")
    except ValueError as e:
        problem = e
    if getattr(module, "layer_idx", None) in (None, 0):  # once per forward: every rank raises together
        _checks.agree(g, impl, problem, q=tuple(query.shape), k=tuple(key.shape), dtype=str(query.dtype),
                  prefill=layer.kv is None, sharded_batch=ctx is not None)
    elif problem is not None:
        raise problem
    query, key, value = _autocast(query, key, value)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if layer.kv is not None:
        out = layer.kv.attend(q, softmax_scale=scaling, **(branches or {}))
    elif ctx is not None:  # this rank's shard of the prompt: ring attention, then keep the shard's K/V
        out = longattn.ring_attention(q, k, v, causal=True, softmax_scale=scaling, layout=ctx.layout, group=g)
        layer.kv = longattn.KVCache.from_prefill(k, v, layout=ctx.layout, group=g, reserve=cache.reserve,
                                                 block=cache.block)
    else:  # the whole prompt on every rank: keep this rank's pieces
        layer.kv = longattn.KVCache.from_sequence(k, v, layout=cache.layout, group=g, reserve=cache.reserve,
                                                  block=cache.block)
        if branches is not None:
            out = longattn.dilated_attention(q, k, v, causal=True, softmax_scale=scaling, **branches)
        else:
            out = _pieces_attention(q, k, v, scaling, cache.layout, g)
    return (out[..., :dv] if dv != out.shape[-1] else out), None


def _pieces_attention(q, k, v, scale, layout: str, group) -> torch.Tensor:
    """Causal attention of the whole prompt when every rank holds all of q, k,
    v: each rank computes the queries of its pieces (their keys are all at or
    before them: no communication) and one all-reduce assembles the output."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for g0, n in prefill_pieces(layout, rank, world, q.shape[1]):
        if n:
            out[:, g0:g0 + n] = longattn.attention(q[:, g0:g0 + n], k[:, :g0 + n], v[:, :g0 + n], causal=True,
                                                   softmax_scale=scale)
    dist.all_reduce(out, group=group)  # the other ranks add zeros: exact
    return out


def __getattr__(name: str):
    if name == "ShardedCache":  # in its own module: importing this one does not import transformers
        from ._sharded_cache import ShardedCache

        return ShardedCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
