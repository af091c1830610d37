"""``ulysses_attention`` and ``ulysses_attention_varlen``: head parallelism
by all-to-all (DeepSpeed-Ulysses) over the ranks of a group; the algorithm
and the GQA head plan are in :mod:`longattn.distributed.ulysses`.

No custom op of its own: the exchanges are PyTorch's differentiable
functional collectives (``all_to_all_single_autograd``, traced by
``torch.compile``) and the local attention is the ``attention`` /
``attention_varlen`` op, so the backward is the transposed exchanges around
the local backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .._validation import check_attention_call, check_cu_seqlens
from ..distributed import checks
from ..distributed import ulysses as U
from ..distributed.layout import check_layout
from ..distributed.plan import local_length
from .attention import attention
from .varlen import attention_varlen

__all__ = ["ulysses_attention", "ulysses_attention_varlen"]


def check_call(q, k, v, causal, return_lse, softmax_scale, window_size, layout, backend, ndim=4):
    """The argument checks every Ulysses / hybrid entry point shares; returns (window, scale)."""
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True, ndim=ndim)
    check_layout(layout)
    bk.check_backend_name(backend)
    return window, bk.default_scale(q.shape[-1], softmax_scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                      layout: str = "contiguous", return_lse: bool = False, backend: str = "auto", group=None):
    """Exact attention over a sequence sharded across the ranks of ``group``,
    by head parallelism: an all-to-all gives each rank the whole sequence for
    nheads/p heads, it attends locally, and an all-to-all returns the shards.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)``;
            ``nheads`` divisible by the group size p (else ValueError naming the
            sizes that fit; the hybrid :func:`context_parallel_attention` takes a
            Ulysses size that divides nheads with the ring over the rest).
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)``. GQA/MQA: a rank
            receives only the kv heads its query heads read (nheads_kv/p when p
            divides nheads_kv, else one or two, replicated on as many ranks as
            read them).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            global positions of the unsharded sequence.
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`longattn.shard`); the
            local attention always runs in sequence order, so any layout gives
            the same work; zigzag lets the same shards feed ``ring_attention``.
        return_lse: also return lse ``(batch, nheads, seqlen_local)`` float32, in
            the shard's row order.
        backend: local kernel (see :mod:`longattn.backends`).
        group: a ProcessGroup, a 1-D DeviceMesh (e.g. ``mesh["ulysses"]``) or None (WORLD).

    Returns:
        This rank's shard of the output (and lse). Memory per rank: the whole
        sequence for nheads/p heads (the same bytes as the local shard of every head).

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.attention(full(q), full(k), full(v), causal=causal), layout=layout)
    """
    window, scale = check_call(q, k, v, causal, return_lse, softmax_scale, window_size, layout, backend)
    g = U.as_group(group)
    world = dist.get_world_size(g)
    U.check_heads(q.shape[2], world, "the group")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    if not torch.compiler.is_compiling():
        checks.check_consistent(g, "ulysses_attention", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                               causal=causal, window=window, layout=layout, scale=scale, backend=backend)
    heads = U.HeadPlan(q.shape[2], k.shape[2], world)
    qf, kf, vf = U.seq_to_heads(q, k, v, heads, layout, g)
    out, lse = attention(qf, kf, vf, causal=causal, softmax_scale=scale, window_size=window, return_lse=True,
                         backend=backend)
    out = U.heads_to_seq(out, layout, g)
    return (out, U.lse_to_seq(lse, layout, g)) if return_lse else out


def ulysses_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                             layout: str = "contiguous", causal: bool = False, softmax_scale: Optional[float] = None,
                             window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                             backend: str = "auto", group=None):
    """Packed documents over a token stream sharded across ranks, by head
    parallelism: after the all-to-all every rank holds every token for
    nheads/p heads and runs :func:`longattn.attention_varlen` with the global
    ``cu_seqlens``: the same work on every rank whatever the document lengths.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`longattn.shard_varlen` with ``layout`` (padding rows included);
            k, v likewise with nheads_kv (GQA as :func:`ulysses_attention`).
        cu_seqlens: the *global* int32 cumulative document lengths (same on every rank).
        layout: ``"contiguous"`` (default: the packed stream cut into p parts,
            padded by at most p-1 tokens) or ``"zigzag"`` (every document padded
            to a multiple of 2p; the ring's packed layout, so its shards can be reused).
        causal, softmax_scale, window_size, return_lse, backend: as
            :func:`longattn.attention_varlen`.
        group: a ProcessGroup, a 1-D DeviceMesh or None (WORLD).

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf.
        ``unshard_varlen(out, cu_seqlens, layout=layout)`` equals ``attention_varlen``
        of the packed input.
    """
    window, scale = check_call(q, k, v, causal, return_lse, softmax_scale, window_size, layout, backend, ndim=3)
    g = U.as_group(group)
    world = dist.get_world_size(g)
    U.check_heads(q.shape[1], world, "the group")
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
    cu = tuple(int(x) for x in cu_seqlens.tolist())
    want = local_length(cu, layout, world)
    if q.shape[0] != want:
        raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over {world} "
                         f"ranks gives {want}; shard with longattn.shard_varlen(x, cu_seqlens, layout={layout!r})")
    if not torch.compiler.is_compiling():
        checks.check_consistent(g, "ulysses_attention_varlen", q=tuple(q.shape), k=tuple(k.shape),
                               dtype=str(q.dtype), cu=cu, causal=causal, window=window, layout=layout, scale=scale,
                               backend=backend)
    heads = U.HeadPlan(q.shape[1], k.shape[1], world)
    # the shards concatenated in rank order (a "contiguous" exchange), then put in packed order
    qf, kf, vf = (U.to_packed(x[0], cu, layout, world)
                  for x in U.seq_to_heads(q[None], k[None], v[None], heads, "contiguous", g))
    out, lse = attention_varlen(qf, kf, vf, cu_seqlens, causal=causal, softmax_scale=scale, window_size=window,
                                return_lse=True, backend=backend)
    out = U.heads_to_seq(U.from_packed(out, cu, layout, world, 0.0)[None], "contiguous", g)[0]
    if not return_lse:
        return out
    lse = U.from_packed(lse.t(), cu, layout, world, float("-inf"))  # (rows, heads)
    return out, U.lse_to_seq(lse.t()[None], "contiguous", g)[0]
