"""``ring_attention_varlen``: packed documents over a token stream sharded
across ranks (the ring of :mod:`longattn.distributed.ring` with the
same-document planner; a step of many short documents runs as one fused
varlen launch where that pays, :mod:`longattn.distributed.fused_varlen`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .._autograd import register_attention_autograd, varlen_out_lse_like
from .._sinks import apply_sinks, sinks_meta
from .._validation import check_chunk_size, check_attention_call, check_cu_seqlens, check_softcap_sinks
from ..distributed import checks
from ..distributed.fused_varlen import fused_call, step_kernel
from ..distributed.layout import check_layout
from ..distributed.plan import local_length, num_steps_varlen, plan_varlen
from ..distributed.ring import BackendOp, RingSchedule, ring_backward, ring_forward
from ..distributed import ring_plan
from ..distributed.ring_plan import RingPlan, block_backends, cached, meta

__all__ = ["ring_attention_varlen"]


def _schedule(cu: tuple, layout, causal, window, scale, mask: tuple, world: int, rank: int, device,
              heads_x_dim: int, fuse) -> RingSchedule:
    """A pure function of the call's arguments and the plan's ``fuse`` (the
    fused steps' varlen kernel, falsy for none): both passes rebuild the same
    one. ``mask``: (softcap, chunk size)."""
    softcap, chunk = mask

    def calls(src):
        one = fuse and fused_call(cu, layout, world, rank, src, causal, window, scale, str(device), heads_x_dim,
                                  fuse, chunk)
        return one or plan_varlen(cu, layout, world, rank, src, causal, window, scale, softcap, chunk)
    return RingSchedule(num_steps_varlen(cu, layout, world, causal, window, chunk), calls)


def _plan(q, k, cu: tuple, scale, causal, window, layout, mask, group, backend: str, tr: tuple) -> RingPlan:
    """The call's plan (:mod:`longattn.distributed.ring_plan`): fusion, every block's backend, the transport."""
    q_meta, k_meta, world, rank = meta(q), meta(k), dist.get_world_size(group), dist.get_rank(group)

    def build():
        qs = q_meta[0]
        fuse = step_kernel(q, window, backend, mask[0])
        sched = _schedule(cu, layout, causal, window, scale, mask, world, rank, q_meta[2], qs[1] * qs[2], fuse)
        steps = (sched.calls((rank - s) % world) for s in range(sched.steps))
        batched = lambda m: ((1, *m[0]), *m[1:])  # the ring runs on (1, T, H, D)
        return RingPlan(backend, block_backends(batched(q_meta), batched(k_meta), steps, backend), fuse, *tr)
    return cached(("ring_varlen", q_meta, k_meta, cu, scale, causal, window, layout, mask, world, rank, backend, tr),
                  build, group, "ring_attention_varlen")


def _run(cu_seqlens, layout, causal, window, scale, mask, group_name, q, k, plan_key):
    g = checks.group_from_name(group_name)
    cu = tuple(cu_seqlens.tolist())
    plan = RingPlan.from_key(plan_key).complete(
        lambda b, tr: _plan(q, k, cu, scale, causal, window, layout, mask, g, b, tr))
    sched = _schedule(cu, layout, causal, window, scale, mask, dist.get_world_size(g), dist.get_rank(g), q.device,
                      q.shape[1] * q.shape[2], plan.fuse)
    return sched, BackendOp(plan=plan), plan.transport_for(g)


@torch.library.custom_op("longattn::ring_varlen_fwd", mutates_args=(), device_types=None)
def _ring_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, softcap: float, chunk: int,
                     group_name: str, plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    sched, op, tr = _run(cu_seqlens, layout, causal, (window_left, window_right), scale, (softcap, chunk), group_name,
                         q, k, plan)
    out, lse, _ = ring_forward(q[None], k[None], v[None], sched, op, tr)
    return out[0], lse[0]


@torch.library.custom_op("longattn::ring_varlen_bwd", mutates_args=(), device_types=None)
def _ring_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, softcap: float, chunk: int,
                     group_name: str, plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sched, op, tr = _run(cu_seqlens, layout, causal, (window_left, window_right), scale, (softcap, chunk), group_name,
                         q, k, plan)
    dq, dk, dv = ring_backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                               None if dlse is None else dlse[None], sched, op, tr)
    return dq[0], dk[0], dv[0]


_ring_varlen = register_attention_autograd(_ring_varlen_fwd, _ring_varlen_bwd,
                                           ("scale", "causal", "window_left", "window_right", "layout", "softcap",
                                            "chunk", "group_name", "plan"),
                                           extra_tensors=1, fwd_fake=varlen_out_lse_like)


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          layout: str = "zigzag", causal: bool = False, softmax_scale: Optional[float] = None,
                          window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, softcap: float = 0.0,
                          sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                          backend: str = "auto", group=None):
    """Packed-document attention over a token stream sharded across ranks.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`shard_varlen` (padding rows included); k, v likewise with nheads_kv.
        cu_seqlens: the *global* int32 cumulative document lengths (same on every rank).
        layout: ``"zigzag"`` (per document) or ``"contiguous"`` (see module docstring).
        causal, softmax_scale, window_size, return_lse, backend: as :func:`longattn.attention_varlen`.
        softcap, sinks: as :func:`longattn.ring_attention` (the sink's
            gradient on each rank sums that rank's rows).
        chunk_size: chunked attention (Llama 4's ``attention_chunk_size``): a
            token sees only the keys of its document in the same chunk of
            ``chunk_size`` positions (positions counted from each document's
            start), i.e. the documents cut at the chunk edges while the tokens
            stay where ``shard_varlen(x, cu_seqlens)`` put them. None: whole documents.
        group: ProcessGroup (default WORLD).

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf (with sinks:
        the head's sink). ``unshard_varlen(out, cu_seqlens)`` equals
        ``attention_varlen`` of the packed input (on ``cu_seqlens`` cut at the
        chunk edges with ``chunk_size``).
    """
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True, ndim=3)
    softcap, problem = checks.local_problem(check_softcap_sinks, softcap, sinks, q)
    chunk, chunk_problem = checks.local_problem(check_chunk_size, chunk_size)
    problem = problem or chunk_problem  # raised on every rank by the cross-rank check below
    check_layout(layout)
    backend = bk.resolve(backend)
    g = checks.resolve_group(group)
    vals = check_cu_seqlens(cu_seqlens, None)  # the call's one read of cu_seqlens
    want = local_length(vals, layout, dist.get_world_size(g))
    if q.shape[0] != want:
        raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over "
                         f"{dist.get_world_size(g)} ranks gives {want}; shard with longattn.shard_varlen")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    cu = tuple(vals)
    checks.consistent_call(g, "ring_attention_varlen", problem, q=tuple(q.shape), k=tuple(k.shape),
                           dtype=str(q.dtype), cu=cu, causal=causal, window=window, layout=layout, scale=scale,
                           backend=backend, softcap=softcap, sinks=sinks_meta(sinks), chunk=chunk)
    mask = (softcap, chunk)
    plan = ring_plan.make(lambda b, tr: _plan(q, k, cu, scale, causal, window, layout, mask, g, b, tr), backend,
                          ring_plan.choose_transport(g))
    out, lse = _ring_varlen(q, k, v, cu_seqlens.cpu(), scale, causal, window[0], window[1], layout, softcap, chunk,
                            checks.group_name(g), plan)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, varlen=True)
    return (out, lse) if return_lse else out

