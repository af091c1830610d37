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
from .._validation import check_attention_call, check_cu_seqlens
from ..distributed import checks
from ..distributed.fused_varlen import fusable, fused_call
from ..distributed.layout import check_layout
from ..distributed.plan import local_length, num_steps_varlen, plan_varlen
from ..distributed.ring import BackendOp, RingSchedule, ring_backward, ring_forward
from ..distributed.transport import ring_transport

__all__ = ["ring_attention_varlen"]


def _schedule(cu_seqlens, layout, causal, window, scale, group, q, backend) -> RingSchedule:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    fuse = fusable(q, window, backend)

    def calls(src):
        one = fuse and fused_call(cu, layout, world, rank, src, causal, window, scale, str(q.device),
                                  q.shape[1] * q.shape[2])
        return one or plan_varlen(cu, layout, world, rank, src, causal, window, scale)
    return RingSchedule(num_steps_varlen(cu, layout, world, causal, window), calls)


@torch.library.custom_op("longattn::ring_varlen_fwd", mutates_args=(), device_types=None)
def _ring_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    g = checks.group_from_name(group_name)
    sched = _schedule(cu_seqlens, layout, causal, (window_left, window_right), scale, g, q, backend)
    out, lse, _ = ring_forward(q[None], k[None], v[None], sched, BackendOp(backend), ring_transport(g))
    return out[0], lse[0]


@torch.library.custom_op("longattn::ring_varlen_bwd", mutates_args=(), device_types=None)
def _ring_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = checks.group_from_name(group_name)
    sched = _schedule(cu_seqlens, layout, causal, (window_left, window_right), scale, g, q, backend)
    dq, dk, dv = ring_backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                               None if dlse is None else dlse[None], sched, BackendOp(backend),
                               ring_transport(g))
    return dq[0], dk[0], dv[0]


_ring_varlen = register_attention_autograd(_ring_varlen_fwd, _ring_varlen_bwd,
                                           ("scale", "causal", "window_left", "window_right", "layout", "group_name",
                                            "backend"),
                                           extra_tensors=1, fwd_fake=varlen_out_lse_like)


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          layout: str = "zigzag", causal: bool = False, softmax_scale: Optional[float] = None,
                          window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, backend: str = "auto",
                          group=None):
    """Packed-document attention over a token stream sharded across ranks.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`shard_varlen` (padding rows included); k, v likewise with nheads_kv.
        cu_seqlens: the *global* int32 cumulative document lengths (same on every rank).
        layout: ``"zigzag"`` (per document) or ``"contiguous"`` (see module docstring).
        causal, softmax_scale, window_size, return_lse, backend: as :func:`longattn.attention_varlen`.
        group: ProcessGroup (default WORLD).

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf.
        ``unshard_varlen(out, cu_seqlens)`` equals ``attention_varlen`` of the packed input.
    """
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True, ndim=3)
    check_layout(layout)
    backend = bk.resolve(backend)
    g = checks.resolve_group(group)
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
    want = local_length(cu_seqlens.tolist(), layout, dist.get_world_size(g))
    if q.shape[0] != want:
        raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over "
                         f"{dist.get_world_size(g)} ranks gives {want}; shard with longattn.shard_varlen")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if not torch.compiler.is_compiling():
        checks.check_consistent(g, "ring_attention_varlen", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                               cu=tuple(cu_seqlens.tolist()), causal=causal, window=window, layout=layout,
                               scale=scale, backend=backend)
    out, lse = _ring_varlen(q, k, v, cu_seqlens.cpu(), scale, causal, window[0], window[1], layout,
                            checks.group_name(g), backend)
    return (out, lse) if return_lse else out
