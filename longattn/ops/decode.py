"""Decoding with a KV cache: the queries of the newest tokens against the
cached keys, dense or dilated, on one device or with the cache sharded over
the ranks of a group (each rank attends to its part; the parts merge by lse).

The public functions take the cache as tensors (flash-attn's
``flash_attn_with_kvcache`` convention); :class:`longattn.KVCache` owns such
tensors and knows where each token lives when sharded. Both call down into
the engines of :mod:`longattn.decode`. Inference only: no autograd graph is
built.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import backends as bk
from ..decode import dilated, engine, sharded

__all__ = ["decode_attention", "dilated_decode_attention"]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cache_seqlens: torch.Tensor,
                     causal: bool = True, softmax_scale: Optional[float] = None, return_lse: bool = False,
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None, backend: str = "auto", group=None):
    """Attention of the newest tokens' queries over a KV cache (decoding).

    Args:
        q: ``(batch, q_len, nheads, headdim)``, usually ``q_len == 1``.
        k_cache, v_cache: ``(batch, capacity, nheads_kv, headdim)``; row ``b``'s
            keys are its first ``cache_seqlens[b]`` slots (the rest is unused
            capacity). GQA: query head ``h`` reads kv head ``h // (nheads // nheads_kv)``.
        cache_seqlens: int32 ``(batch,)`` valid lengths (rows may differ); they are
            read on the host, so a CPU tensor saves a device sync per call.
            Inside CUDA graph capture (one device) they must be on q's device
            and are read there only: the captured step replays with whatever
            lengths the tensor holds (the split-KV kernel; see Notes).
        causal: bottom-right as :func:`longattn.attention`: the queries are the
            last ``q_len`` tokens of the cache, query ``i`` at position
            ``cache_seqlens[b] - q_len + i`` sees the keys up to it (so
            ``cache_seqlens >= q_len``). False: every valid key (e.g. a cache of
            another sequence). With one query both are the same.
        softmax_scale, return_lse, backend: as :func:`longattn.attention`.
        softcap: logit soft-capping as :func:`longattn.attention` (run by a
            backend that applies it on views of the cache, never the split-KV
            kernel: so not under CUDA graph capture).
        sinks: ``(nheads,)`` one logit per query head in every row's softmax
            denominator, as :func:`longattn.attention`; with ``group``, merged
            once after the ranks' parts.
        group: a ProcessGroup: the cache is sharded, ``k_cache``/``v_cache``/
            ``cache_seqlens`` are this rank's part and q is the same on every
            rank. Each rank attends to its part (``causal`` applies to the part:
            True on the rank whose part ends with the queries' own keys, False
            on the others, whose keys all precede the queries; a part may be
            empty) and the parts merge by lse in float32 with one all-gather of
            ``(batch, q_len, nheads, headdim + 1)`` floats per rank, whatever the
            context length; the result is the same on every rank. The
            all-gather carries a flag so that lengths out of range on one rank
            raise on every rank. :class:`longattn.KVCache` manages such parts.

    Returns:
        ``out`` ``(batch, q_len, nheads, headdim)`` in q's dtype, and lse
        ``(batch, nheads, q_len)`` float32 when asked. Rows that see no key: 0
        and -inf (with sinks: 0 and the head's sink).

    Equivalent PyTorch (one row ``b``, ``n = cache_seqlens[b]``)::

        longattn.attention(q[b:b+1], k_cache[b:b+1, :n], v_cache[b:b+1, :n], causal=causal,
                           softcap=softcap, sinks=sinks)

    Chunked attention and sliding windows over a cache: :meth:`longattn.KVCache.attend`
    (``chunk_size``, ``window_size``), which knows every slot's position.

    Notes:
        Engines (``backend="auto"``,
        :func:`longattn.decode.engine.dense_engine`): on CUDA, rows of
        different lengths, or lengths given on the device, go to the split-KV
        kernel (:mod:`longattn.kernels.decode`: the cache's tokens cut into
        splits over the whole GPU, all rows in one launch); rows of one length
        given on the host to the flash kernel on views of the cache (one
        launch, the least host time; ``DecodeTuning``). A whole decode
        step can be captured in a CUDA graph and replayed with new lengths
        (the split-KV kernel, lengths read on the device)::

            lens = torch.tensor([n], dtype=torch.int32, device="cuda")
            longattn.decode_attention(q, k_cache, v_cache, cache_seqlens=lens)  # compiles the kernels
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = longattn.decode_attention(q, k_cache, v_cache, cache_seqlens=lens)
            lens += 1; q.copy_(q_next); g.replay()  # out now holds the next step's output
    """
    backend = bk.resolve(backend) if backend == "auto" else backend  # a bad name is raised by the checks below
    if group is None:
        out, lse = engine.decode_call(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, return_lse, backend,
                                      softcap, sinks)
    else:
        out, lse = sharded.decode_call(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, return_lse,
                                       backend, group, softcap, sinks)
    return (out, lse) if return_lse else out


@torch.no_grad()
def dilated_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                             cache_seqlens: torch.Tensor, segment_lengths: Sequence[int],
                             dilation_rates: Sequence[int], softmax_scale: Optional[float] = None,
                             return_lse: bool = False, backend: str = "auto"):
    """LongNet dilated attention of the newest tokens over a KV cache on one
    device: exactly the last ``q_len`` rows of
    ``dilated_attention(..., causal=True)`` on each row's whole sequence
    (the cache's first ``cache_seqlens[b]`` tokens, the queries being the last
    ``q_len`` of them).

    A query at position p, branch ``(w, r)``: the heads h with
    ``h % r == (p % w) % r`` read the keys at p, p - r, p - 2r, ... down to its
    segment's start ``(p // w) * w``; the other heads get nothing from that
    branch. All branches are one softmax over the union (a key given twice
    counts twice). What must stay cached: every token (all kv heads) from
    :func:`longattn.decode.dilated_read_start` on. Sharded caches: :meth:`longattn.KVCache.attend`.

    Args:
        q: ``(batch, q_len, nheads, headdim)``.
        k_cache, v_cache, cache_seqlens: as :func:`decode_attention`
            (``cache_seqlens >= q_len``).
        segment_lengths, dilation_rates: one ``(w, r)`` per branch.
        softmax_scale, return_lse, backend: as :func:`longattn.attention`.

    Returns:
        ``out`` like q (and lse ``(batch, nheads, q_len)`` float32 if asked).

    Equivalent PyTorch (row ``b``, ``n = cache_seqlens[b]``, ``Q`` the queries of
    all n tokens)::

        longattn.dilated_attention(Q, k_cache[b:b+1, :n], v_cache[b:b+1, :n], causal=True,
                                   segment_lengths=segment_lengths, dilation_rates=dilation_rates)[:, -q_len:]
    """
    backend = bk.resolve(backend) if backend == "auto" else backend  # a bad name is raised by the checks below
    out, lse = dilated.decode_call(q, k_cache, v_cache, cache_seqlens, segment_lengths, dilation_rates,
                                   softmax_scale, return_lse, backend)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
