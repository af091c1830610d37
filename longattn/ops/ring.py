"""``ring_attention``: exact attention over a sequence sharded across ranks
(the ring algorithm of :mod:`longattn.distributed.ring` with the dense
planner of :mod:`longattn.distributed.plan`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .._autograd import grads_like, register_attention_autograd
from .._sinks import apply_sinks, sinks_meta
from .._validation import check_attention_call, check_softcap_sinks
from ..distributed import checks
from ..distributed.layout import check_layout
from ..distributed.plan import num_steps, plan
from ..distributed.ring import BackendOp, RingSchedule, ring_backward, ring_forward
from ..distributed import ring_plan
from ..distributed.ring_plan import RingPlan, block_backends, cached, meta

__all__ = ["ring_attention"]


def _schedule(world: int, rank: int, l: int, causal: bool, window, layout: str, scale: float,
              softcap: float) -> RingSchedule:
    """A pure function of the call's arguments: the forward and the backward rebuild the same one."""
    return RingSchedule(num_steps(layout, world, l, causal, window),
                        lambda src: plan(layout, rank, src, world, l, causal, window, scale, softcap))


def _plan(q, k, scale, causal, window, layout, softcap, group, backend: str, tr: tuple) -> RingPlan:
    """The call's plan (:mod:`longattn.distributed.ring_plan`): every block's backend and the transport."""
    q_meta, k_meta, world, rank = meta(q), meta(k), dist.get_world_size(group), dist.get_rank(group)

    def build():
        sched = _schedule(world, rank, q_meta[0][1], causal, window, layout, scale, softcap)
        steps = (sched.calls((rank - s) % world) for s in range(sched.steps))
        return RingPlan(backend, block_backends(q_meta, k_meta, steps, backend), False, *tr)
    return cached(("ring", q_meta, k_meta, scale, causal, window, layout, softcap, world, rank, backend, tr), build,
                  group, "ring_attention")


def _forward(q, k, v, scale, causal, window, layout, softcap, group, plan: RingPlan):
    plan = plan.complete(lambda b, tr: _plan(q, k, scale, causal, window, layout, softcap, group, b, tr))
    sched = _schedule(dist.get_world_size(group), dist.get_rank(group), q.shape[1], causal, window, layout, scale,
                      softcap)
    out, lse, kv_last = ring_forward(q, k, v, sched, BackendOp(plan=plan), plan.transport_for(group),
                                     keep_last=True)
    if kv_last is None:
        kv_last = (k.new_empty(0), v.new_empty(0))
    return out, lse, *kv_last


def _backward(dout, q, k, v, out, lse, dlse, k_last, v_last, scale, causal, window, layout, softcap, group,
              plan: RingPlan):
    plan = plan.complete(lambda b, tr: _plan(q, k, scale, causal, window, layout, softcap, group, b, tr))
    sched = _schedule(dist.get_world_size(group), dist.get_rank(group), q.shape[1], causal, window, layout, scale,
                      softcap)
    kv_last = (k_last, v_last) if k_last.numel() else None
    return ring_backward(dout, q, k, v, out, lse, dlse, sched, BackendOp(plan=plan), plan.transport_for(group),
                         kv_last)


# ------------------------------------------------------------------ custom ops
# The forward also returns the last K/V block it received (empty when the ring
# has one step): the backward starts on it (see ring_backward). It is saved for
# the backward like q, k and v: one more local K/V block per call. ``plan`` is
# the call's RingPlan as a key: both ops follow it.
@torch.library.custom_op("longattn::ring_fwd", mutates_args=(), device_types=None)
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window_left: int,
              window_right: int, layout: str, softcap: float, group_name: str, plan: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = checks.group_from_name(group_name)
    return _forward(q, k, v, scale, causal, (window_left, window_right), layout, softcap, g, RingPlan.from_key(plan))


@_ring_fwd.register_fake
def _(q, k, v, scale, causal, window_left, window_right, layout, softcap, group_name, plan):
    b, l, h, _ = q.shape
    world = checks.group_from_name(group_name).size()
    # int(): the step count depends on the length and window, so a traced graph specialises on them
    kept = num_steps(layout, world, int(l), causal, (int(window_left), int(window_right))) > 1
    return (torch.empty_like(q), q.new_empty(b, h, l, dtype=torch.float32),
            torch.empty_like(k) if kept else k.new_empty(0), torch.empty_like(v) if kept else v.new_empty(0))


@torch.library.custom_op("longattn::ring_bwd", mutates_args=(), device_types=None)
def _ring_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dlse: Optional[torch.Tensor], k_last: torch.Tensor, v_last: torch.Tensor,
              scale: float, causal: bool, window_left: int, window_right: int, layout: str, softcap: float,
              group_name: str, plan: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = checks.group_from_name(group_name)
    return _backward(dout, q, k, v, out, lse, dlse, k_last, v_last, scale, causal, (window_left, window_right),
                     layout, softcap, g, RingPlan.from_key(plan))


_ring_bwd.register_fake(grads_like)
_ring = register_attention_autograd(_ring_fwd, _ring_bwd, ("scale", "causal", "window_left", "window_right",
                                                          "layout", "softcap", "group_name", "plan"),
                                    kept_outputs=2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                   layout: str = "contiguous", return_lse: bool = False, softcap: float = 0.0,
                   sinks: Optional[torch.Tensor] = None, backend: str = "auto", group=None):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)``.
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)`` (GQA/MQA: only the kv
            heads travel the ring).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            global positions of the unsharded sequence.
        layout: how the sequence was split (see :func:`longattn.shard`):
            ``"contiguous"`` (rank r holds chunk r of p) or ``"zigzag"`` (chunks r
            and 2p-1-r of 2p; balanced causal work).
        return_lse: also return lse ``(batch, nheads, seqlen_local)`` float32.
        softcap: logit soft-capping, as :func:`longattn.attention`: part of
            every ring block, so only backends that apply it run the blocks.
        sinks: ``(nheads,)`` one logit per query head in every row's softmax
            denominator, as :func:`longattn.attention`, merged once after the
            ring. Its gradient on each rank is the sum over that rank's rows:
            a replicated parameter's partial gradient, summed over the group
            like any other (:func:`longattn.context_parallel.all_reduce_grads`).
        backend: local kernel for each block (see :mod:`longattn.backends`).
        group: a ProcessGroup (default WORLD); any size, sub-groups allowed.

    Returns:
        This rank's shard of the output (and lse). ``unshard(out)`` equals
        ``longattn.attention`` on the unsharded q, k, v. Rows that see no key
        give 0 and lse -inf (with sinks: 0 and the head's sink).

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.attention(full(q), full(k), full(v), causal=causal), layout=layout)
    """
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True)
    softcap, problem = checks.local_problem(check_softcap_sinks, softcap, sinks, q)
    check_layout(layout)
    backend = bk.resolve(backend)
    g = checks.resolve_group(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    checks.consistent_call(g, "ring_attention", problem, q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                           causal=causal, window=window, layout=layout, scale=scale, backend=backend,
                           softcap=softcap, sinks=sinks_meta(sinks))
    plan = ring_plan.make(lambda b, tr: _plan(q, k, scale, causal, window, layout, softcap, g, b, tr), backend,
                          ring_plan.choose_transport(g))
    out, lse, _, _ = _ring(q, k, v, scale, causal, window[0], window[1], layout, softcap, checks.group_name(g),
                           plan)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
