"""Context-parallel generation: :class:`ShardedCache`, a transformers
``Cache`` whose layers are :class:`longattn.KVCache` parts sharded over a
group, and the attention call of a layer that holds one (see the package
docstring). Imported on first use of
``longattn.integrations.transformers.ShardedCache`` (it imports transformers).

A layer's ``update`` writes itself into the keyword arguments that the model
passes on to the attention call (``cache.update(..., kwargs=kwargs)``, the
channel transformers' paged cache uses, from transformers 5.24); the
attention call finds it there. Models of earlier releases call
``update(key, value, layer_idx)`` and pass the returned key and value
straight to the attention call: the layer is handed over with them
(:func:`.checks.sharded_layer` matches the very tensors)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, CacheLayerMixin

import longattn
from longattn import context_parallel as _cp
from longattn.distributed import checks as rank_checks
from longattn.distributed.cache import prefill_pieces
from longattn.distributed.layout import check_layout

from . import checks, cp
from .cp import agree
from .masks import RingMask

__all__ = ["ShardedCache", "ShardedLayer", "sharded_layer_forward"]


class ShardedLayer(CacheLayerMixin):
    """One layer of a :class:`ShardedCache`: a :class:`longattn.KVCache` built by
    the layer's first attention call (the prefill), appended by ``update``."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner):
        super().__init__()
        self.owner, self.kv = owner, None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, kwargs=None, **_):
        """Append the new tokens (decoding) and return them alone, never the
        cache's parts. The attention call finds this layer in ``kwargs``, its
        keyword arguments (transformers from 5.24 passes them here), else
        handed over with the very key and value returned
        (:func:`.checks.hand_over`). Raises where the attention call after the
        previous update did not read its layer: that call attended to its new
        tokens alone."""
        self.owner.check_read()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv is not None:
            self.kv.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        if kwargs is not None:
            kwargs[checks.SHARDED_LAYER_KEY] = self
        else:
            checks.hand_over(self, key_states, value_states)
        self.owner.pending = self
        return key_states, value_states

    def read(self) -> None:
        """Called by the attention call this layer reached."""
        if self.owner.pending is self:
            self.owner.pending = None

    def is_pending(self) -> bool:
        """Updated last, and no attention call has read it yet."""
        return self.owner.pending is self

    def index(self) -> int:
        return next(i for i, layer in enumerate(self.owner.layers) if layer is self)

    def get_seq_length(self) -> int:
        return 0 if self.kv is None else self.kv.layout.seqlens[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv, self.is_initialized = None, False
        self.owner.pending = None

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("a ShardedCache cannot be reordered, cropped or re-batched (beam search, "
                                  "assisted decoding); use greedy or sampled generation")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class ShardedCache(Cache):
    """A transformers ``Cache`` for context-parallel generation with
    ``attn_implementation="longattn_ring"`` or ``"longattn_dilated"``: each
    layer is a :class:`longattn.KVCache` sharded over ``group`` (default: the
    whole world), filled by the prefill and appended to one rank per token
    (see the package docstring). Only those two attention implementations
    read it: ``update`` returns the new tokens alone, so ``"sdpa"`` or
    ``"eager"`` would attend to nothing else (``"longattn"`` raises).

    Args:
        group: ProcessGroup (default WORLD; torch.distributed must be
            initialised); a group of one rank works too.
        layout: how a prompt given whole is split for the cache (``"zigzag"``
            or ``"contiguous"``; any length); a sharded batch brings its own.
        reserve: tokens to be generated, preallocated (otherwise the parts
            grow when full, a copy each time).
        block: tokens that go to one rank before the next is chosen.
    """

    def __init__(self, group=None, *, layout: str = "zigzag", reserve: int = 0, block: int = 256):
        check_layout(layout)
        self.group = _cp.resolve_group(group)
        self.layout, self.reserve, self.block = layout, reserve, block
        self.pending = None  # the layer updated last, until its attention call reads it
        super().__init__(layer_class_to_replicate=functools.partial(ShardedLayer, self))

    def check_read(self) -> None:
        """Raise where the attention call after the last update did not read
        its layer (and forget that layer)."""
        layer, self.pending = self.pending, None
        if layer is not None:
            raise ValueError("ShardedCache: the attention call after the cache's last update did not read its "
                             "sharded layer, so it attended to the new tokens alone. A ShardedCache serves "
                             "attn_implementation='longattn_ring' or 'longattn_dilated' on every layer, which find "
                             "the layer in their keyword arguments or (transformers before 5.24) as the key and "
                             "value the update returned, unchanged; with any other attention, use the default cache")


def sharded_layer_forward(impl: str, layer: ShardedLayer, module, query, key, value, attention_mask, scaling,
                          dropout, sliding_window, softcap, kwargs, branches=None):
    """The attention call of a layer whose cache is ``layer``: ``key``/``value``
    are the tokens of this forward (``update`` already appended them when
    decoding). ``branches``: the dilated segment lengths and rates, or None.
    Dense layers run soft-capping, sinks (``s_aux``), sliding windows and
    chunks (:class:`~.masks.RingMask`) in the prefill and every step."""
    cache = layer.owner
    ctx = kwargs.get(checks.CP_KEY)
    chunk = attention_mask.chunk if isinstance(attention_mask, RingMask) else None
    attention_mask = None if isinstance(attention_mask, RingMask) else attention_mask
    sinks = kwargs.get("s_aux")
    problem, causal, dv = None, True, value.shape[-1]
    try:
        causal, value, dv = checks.check_call(impl, module, query, key, value, dropout, softcap, kwargs,
                                              scores=branches is None)
        _check_cached_call(impl, layer, ctx, query, key, attention_mask, causal, branches)
    except ValueError as e:
        problem = e
    agree(module, cache.group, impl, problem, q=tuple(query.shape), k=tuple(key.shape), dtype=str(query.dtype),
          prefill=layer.kv is None, sharded_batch=ctx is not None, softcap=softcap, sinks=sinks is not None,
          chunk=chunk, window=sliding_window)
    q, k, v = checks.to_bshd(query, key, value)
    # Gemma 2's soft-capping, GPT-OSS's sinks, as in the calls without a cache
    scores = dict(softcap=float(softcap or 0.0), sinks=sinks)
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)  # transformers': q - k < window
    if layer.kv is not None:
        if branches is not None:
            return checks.crop(layer.kv.attend(q, softmax_scale=scaling, **branches), dv)
        out = layer.kv.attend(q, softmax_scale=scaling, chunk_size=chunk, window_size=window, **scores)
    elif ctx is not None:  # this rank's shard of the prompt: ring attention, then keep the shard's K/V
        out = cp.ring_forward(ctx, q, k, v, True, scaling, sliding_window, scores, chunk)
        layer.kv = longattn.KVCache.from_prefill(k, v, layout=ctx.layout, group=cache.group, reserve=cache.reserve,
                                                 block=cache.block)
    else:  # the whole prompt on every rank: keep this rank's pieces
        layer.kv = longattn.KVCache.from_sequence(k, v, layout=cache.layout, group=cache.group,
                                                  reserve=cache.reserve, block=cache.block)
        if branches is not None:
            out = longattn.dilated_attention(q, k, v, causal=True, softmax_scale=scaling, **branches)
        else:
            out = _pieces_attention(q, k, v, scaling, cache.layout, cache.group, window, chunk, scores)
    return checks.crop(out, dv)


def _check_cached_call(impl, layer, ctx, query, key, attention_mask, causal, branches) -> None:
    # (a dilated layer's sliding window is refused before: dilated attention replaces it)
    if attention_mask is not None:
        raise ValueError(f"attn_implementation={impl!r} with a ShardedCache: got a padding mask; generate from "
                         f"prompts of one length (no padding), or one prompt per call")
    if not causal:
        raise ValueError(f"attn_implementation={impl!r}: decoding from a ShardedCache needs a causal layer")
    if ctx is not None:
        if branches is not None or layer.kv is not None or ctx.cu_seqlens is not None:
            raise ValueError(f"attn_implementation={impl!r}: a sharded batch (longattn_cp) fills an empty "
                             f"ShardedCache with dense rows of one length under 'longattn_ring' (no padding, no "
                             f"packed documents); decode with model.generate(input_ids, past_key_values=cache)")
        if rank_checks.group_name(ctx.group) != rank_checks.group_name(layer.owner.group):
            raise ValueError(f"attn_implementation={impl!r}: the sharded batch's group differs from the "
                             f"ShardedCache's group")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"attn_implementation={impl!r}: the ShardedCache returned {key.shape[2]} keys for "
                         f"{query.shape[2]} queries")


def _pieces_attention(q, k, v, scale, layout: str, group, window, chunk, scores: dict) -> torch.Tensor:
    """Causal attention of the whole prompt when every rank holds all of q, k,
    v: each rank computes the queries of its pieces (their keys are all at or
    before them: no communication; cut at chunk edges under chunked
    attention, each part over its chunk's keys) and one all-reduce assembles
    the output."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for g0, n in prefill_pieces(layout, rank, world, q.shape[1]):
        a = g0
        while a < g0 + n:
            lo = 0 if chunk is None else a - a % chunk
            e = g0 + n if chunk is None else min(g0 + n, lo + chunk)
            out[:, a:e] = longattn.attention(q[:, a:e], k[:, lo:e], v[:, lo:e], causal=True, softmax_scale=scale,
                                             window_size=window, **scores)
            a = e
    dist.all_reduce(out, group=group)  # the other ranks add zeros: exact
    return out
