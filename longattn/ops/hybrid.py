"""``context_parallel_attention`` and ``context_parallel_attention_varlen``:
the Ulysses x ring hybrid over a 2-D mesh (all-to-all inside the ulysses dim,
``ring_attention`` across the ring dim), as USP / TransformerEngine's a2a+p2p /
Megatron's hierarchical context parallelism do. The layout is in
:mod:`longattn.distributed.ulysses` (``shard_for_mesh``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._sinks import sinks_meta
from .._validation import check_chunk_size, check_cu_seqlens
from ..distributed import checks
from ..distributed import ulysses as U
from ..distributed.plan import local_length
from .ring import ring_attention
from .ring_varlen import ring_attention_varlen
from .ulysses import check_call, with_sinks

__all__ = ["context_parallel_attention", "context_parallel_attention_varlen"]


def _mesh(mesh, nheads: int):
    ug, rg = U.mesh_groups(mesh)
    u, r = dist.get_world_size(ug), dist.get_world_size(rg)
    U.check_heads(nheads, u, "the mesh's ulysses dim")
    return ug, rg, u, r


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mesh,
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               window_size: tuple[int, int] = (-1, -1), layout: str = "zigzag",
                               return_lse: bool = False, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                               backend: str = "auto"):
    """Exact attention over a sequence sharded across a 2-D mesh of u x r
    ranks: Ulysses all-to-all inside the ulysses dim (map it to the fast links,
    the GPUs of a node), the ring across the ring dim (between nodes).

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)`` as made by
            :func:`longattn.shard_for_mesh` (``layout`` over the ring dim, each
            ring shard cut into u contiguous pieces over the ulysses dim);
            ``nheads`` divisible by u.
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)`` (GQA as
            :func:`longattn.ulysses_attention`; the ring carries the kv heads
            each rank received).
        mesh: a 2-D ``DeviceMesh`` with ``mesh_dim_names`` "ulysses" and "ring"
            (either order; e.g. ``init_device_mesh("cuda", (nodes, gpus_per_node),
            mesh_dim_names=("ring", "ulysses"))``), or a pair (ulysses, ring) of
            ProcessGroups / 1-D DeviceMeshes. A u x 1 mesh is Ulysses (contiguous
            layout), 1 x r the ring.
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            global positions.
        layout: the ring's layout over the ring dim, ``"zigzag"`` (default;
            balanced causal work) or ``"contiguous"``.
        return_lse: also return lse ``(batch, nheads, seqlen_local)`` float32.
        softcap: logit soft-capping of every ring block, as :func:`longattn.ring_attention`.
        sinks: ``(nheads,)``, as :func:`longattn.attention`: merged on this
            rank's shard after the exchange back; each rank's gradient of
            ``sinks`` sums its rows (the mesh sums them like any replicated
            parameter's gradient).
        backend: local kernel of each ring block.

    Returns:
        This rank's shard of the output (and lse).

    Equivalent PyTorch::

        full = lambda x: longattn.unshard_for_mesh(x, mesh, layout=layout)
        out = longattn.shard_for_mesh(longattn.attention(full(q), full(k), full(v), causal=causal),
                                      mesh, layout=layout)
    """
    window, scale, backend, softcap, problem = check_call(q, k, v, causal, return_lse, softmax_scale, window_size,
                                                          layout, backend, softcap, sinks)
    ug, rg, u, r = _mesh(mesh, q.shape[2])
    if layout == "zigzag" and (q.shape[1] * u) % 2:
        raise ValueError(f"layout='zigzag' needs an even ring shard (seqlen_local x ulysses size = "
                         f"{q.shape[1]} x {u}): pad the sequence to a multiple of 2 x {u * r}")
    checks.consistent_call((ug, rg), "context_parallel_attention", problem, q=tuple(q.shape), k=tuple(k.shape),
                           dtype=str(q.dtype), mesh=(u, r), causal=causal, window=window, layout=layout,
                           scale=scale, backend=backend, softcap=softcap, sinks=sinks_meta(sinks))
    heads = U.HeadPlan(q.shape[2], k.shape[2], u)
    qr, kr, vr = U.seq_to_heads(q, k, v, heads, "contiguous", ug)  # this ring rank's shard, nheads/u heads
    out, lse = ring_attention(qr, kr, vr, causal=causal, softmax_scale=scale, window_size=window, layout=layout,
                              return_lse=True, softcap=softcap, backend=backend, group=rg)
    out = U.heads_to_seq(out, "contiguous", ug)
    if not (return_lse or sinks is not None):
        return out
    return with_sinks((out, U.lse_to_seq(lse, "contiguous", ug)), sinks, return_lse)


def context_parallel_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                      *, mesh, layout: str = "zigzag", causal: bool = False,
                                      softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                                      return_lse: bool = False, softcap: float = 0.0,
                                      sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                                      backend: str = "auto"):
    """Packed documents over a 2-D mesh: :func:`ring_attention_varlen` across
    the ring dim on the ring shard that the ulysses dim's all-to-all rebuilds.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`longattn.shard_varlen_for_mesh` (the ring shard of
            ``shard_varlen(layout)`` over the ring dim, padded at its end to a
            multiple of u, cut into u pieces); k, v likewise with nheads_kv.
        cu_seqlens: the *global* int32 cumulative document lengths.
        mesh, layout, causal, softmax_scale, window_size, return_lse, softcap, sinks, backend: as
            :func:`context_parallel_attention` / :func:`longattn.attention_varlen`.
        chunk_size: chunked attention, as :func:`longattn.ring_attention_varlen`.

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf.
        ``unshard_varlen_for_mesh(out, cu_seqlens, mesh, layout=layout)`` equals
        ``attention_varlen`` of the packed input.
    """
    window, scale, backend, softcap, problem = check_call(q, k, v, causal, return_lse, softmax_scale, window_size,
                                                          layout, backend, softcap, sinks, ndim=3)
    chunk, chunk_problem = checks.local_problem(check_chunk_size, chunk_size)
    problem = problem or chunk_problem  # raised on every rank by the cross-rank check below
    ug, rg, u, r = _mesh(mesh, q.shape[1])
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
    cu = tuple(int(x) for x in cu_seqlens.tolist())
    ring_rows, want = local_length(cu, layout, r), U.mesh_varlen_length(cu, layout, u, r)
    if q.shape[0] != want:
        raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over a {u} x {r} "
                         f"mesh gives {want}; shard with longattn.shard_varlen_for_mesh")
    checks.consistent_call((ug, rg), "context_parallel_attention_varlen", problem, q=tuple(q.shape),
                           k=tuple(k.shape), dtype=str(q.dtype), mesh=(u, r), cu=cu, causal=causal, window=window,
                           layout=layout, scale=scale, backend=backend, softcap=softcap, sinks=sinks_meta(sinks),
                           chunk=chunk)
    heads = U.HeadPlan(q.shape[1], k.shape[1], u)
    qr, kr, vr = (x[0, :ring_rows] for x in U.seq_to_heads(q[None], k[None], v[None], heads, "contiguous", ug))
    out, lse = ring_attention_varlen(qr, kr, vr, cu_seqlens, layout=layout, causal=causal, softmax_scale=scale,
                                     window_size=window, return_lse=True, softcap=softcap, chunk_size=chunk_size,
                                     backend=backend, group=rg)
    out = U.heads_to_seq(U.pad_rows(out, u * want)[None], "contiguous", ug)[0]
    if not (return_lse or sinks is not None):
        return out
    lse = U.pad_rows(lse.t(), u * want, float("-inf")).t()
    return with_sinks((out, U.lse_to_seq(lse[None], "contiguous", ug)[0]), sinks, return_lse, varlen=True)
