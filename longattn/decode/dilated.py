"""Dilated (LongNet) decoding: which cached keys a query reads, and the
dilated part of a cache (one device: the whole cache; sharded: a rank's runs
of slots, :class:`longattn.distributed.cache.CacheLayout`)."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import backends as bk
from .._merge import empty_state, merge_
from .._validation import check_dilation, check_flag, check_scale
from .checks import check_cache_tensors, check_lengths, check_seqlens_tensor, no_capture
from .engine import unmasked_backend


def dilated_read_start(position: int, segment_lengths: Sequence[int]) -> int:
    """The first position that dilated decoding of a query at ``position`` (or
    any later one) reads: the start of the earliest current segment,
    ``min over branches of (position // w) * w``. Keys before it are never read
    again; the cache must hold every token from there on (all kv heads: each
    head reads its own offset class)."""
    return min((position // w) * w for w in segment_lengths)


def _kv_heads(c: int, r: int, h: int, hkv: int):
    """The kv heads query heads ``c, c + r, ...`` read, as an index into the
    cache's head dim, in the order the backend's GQA grouping expects."""
    g = h // hkv
    if g == 1:
        return slice(c, h, r)
    if r % g == 0:  # one kv head per query head of the class
        return slice(c // g, hkv, r // g)
    if g % r == 0:  # every kv head, each for g / r consecutive heads of the class
        return slice(0, hkv)
    return [hh // g for hh in range(c, h, r)]  # irregular: one (copied) kv head per query head


def dilated_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs, q_pos: Sequence[int],
                 segment_lengths: Sequence[int], dilation_rates: Sequence[int], scale: float, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention of q ``(B, Lq, H, D)`` over the cached slots of each row.

    ``runs[b]``: ``(global_start, local_start, length)`` runs of row b's slots
    (:class:`longattn.distributed.cache.CacheLayout`; one device: one run
    ``(0, 0, length)``); ``q_pos[b]``: global position of row b's first query.
    Query i at position p = q_pos[b] + i, branch (w, r): heads h with
    ``h % r == (p % w) % r`` read the keys at p, p - r, ... down to the segment
    start ``(p // w) * w``; all branches are one softmax (merged by lse). Each
    (query, branch, run) is one backend call on strided views of the cache.
    Returns out float32 ``(B, Lq, H, D)`` and lse ``(B, H, Lq)``.
    """
    b, lq, h, _ = q.shape
    hkv = k_cache.shape[2]
    out, lse = empty_state(q, torch.float32)
    lse_q = lse.transpose(1, 2)  # (B, Lq, H) view: merge_ aligns lse with out's leading dims
    spec = bk.BlockSpec(scale)
    for row in range(b):
        for i in range(lq):
            p = q_pos[row] + i
            for w, r in zip(segment_lengths, dilation_rates):
                s0 = (p // w) * w
                c = (p - s0) % r
                if c >= h:
                    continue
                qs = q[row:row + 1, i:i + 1, c::r]
                heads = _kv_heads(c, r, h, hkv)
                for g0, l0, n in runs[row]:
                    lo, hi = max(g0, s0), min(g0 + n - 1, p)
                    if lo > hi:
                        continue
                    j0 = lo + (p - lo) % r  # first position >= lo in p's class
                    if j0 > hi:
                        continue
                    a = l0 + j0 - g0
                    e = a + (hi - j0) // r * r + 1
                    k = k_cache[row:row + 1, a:e:r][:, :, heads]
                    v = v_cache[row:row + 1, a:e:r][:, :, heads]
                    o, l = (_one_key(qs, k, v, scale) if k.shape[1] == 1 else
                            unmasked_backend(qs, k, spec, backend).forward(qs, k, v, spec))
                    merge_(out[row:row + 1, i:i + 1, c::r], lse_q[row:row + 1, i:i + 1, c::r], o, l.transpose(1, 2))
    return out, lse


def _one_key(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (1, 1, H, D) queries over one key (kv heads (1, 1, Hkv, D)):
    the softmax is 1, so out = v and lse = the score. Computed here for every
    backend: a segment's first position gives such a branch, and cuDNN takes no
    seqlen_q = seqlen_k = 1 call."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    lse = (q.float() * k.float()).sum(-1) * scale  # (1, 1, H)
    return v.to(q.dtype), lse.transpose(1, 2)


def decode_call(q, k_cache, v_cache, cache_seqlens, segment_lengths, dilation_rates, softmax_scale, return_lse,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`longattn.dilated_decode_attention`: checked, then the whole cache
    as one run per row; (out float32, lse)."""
    check_cache_tensors(q, k_cache, v_cache)
    no_capture(q, "dilated_decode_attention")
    check_seqlens_tensor(cache_seqlens, q.shape[0])
    segs, rates = check_dilation(segment_lengths, dilation_rates)
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    bk.check_backend_name(backend)
    lens = cache_seqlens.tolist()
    lq = q.shape[1]
    check_lengths(lens, k_cache.shape[1], lq, True)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if backend != "auto":  # a forced backend that cannot run these tensors raises here, not at a later step
        unmasked_backend(q[:1, :1], k_cache[:1], bk.BlockSpec(scale), backend)
    return dilated_part(q, k_cache, v_cache, [[(0, 0, n)] for n in lens], [n - lq for n in lens], segs, rates,
                        scale, backend)
