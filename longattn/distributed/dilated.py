"""LongNet dilated attention over a sequence sharded contiguously on p ranks.

Rank j holds positions [j*L, (j+1)*L). For each branch (w, r):

* ``L % w == 0``: every segment lies inside one rank. The branch runs locally
  (fused kernel or gather path) with no communication.
* ``w % L == 0`` (or ``w >= S``): a segment spans G = min(w, S) / L ranks.
  Each rank takes its dilated rows (for head h, rows with ``i % r == h % r``;
  ``L % r == 0`` makes that class the same on every rank), L/r rows per head,
  and the G ranks of the segment run a ring over just those rows: each step
  passes the dilated K/V (1/r of the tokens) to the next rank of the segment
  while the local block is computed. Backward sends the dK/dV of the
  exchanged rows back to their owners.

All branches merge by lse in float32; the backward of every part uses the
merged output and lse, so gradients are exact.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import dilated as _dil
from .._merge import empty_state, merge_
from ..dilated.plan import DilatedPlan
from .plan import num_steps, plan
from .ring import BackendOp, RingSchedule, ring_backward, ring_forward
from .ring_plan import RingPlan, block_backends, cached, choose_transport, make, meta


def split_branches(local_len: int, world: int, segment_lengths, dilation_rates):
    """(local branches, spanning branches); raises when a branch fits neither."""
    total = local_len * world
    local, span = [], []
    for w, r in zip(segment_lengths, dilation_rates):
        if local_len % w == 0:
            local.append((w, r))
        elif w % local_len == 0 or w >= total:
            if local_len % r:
                raise ValueError(f"dilation rate {r} must divide the shard length {local_len} for a segment "
                                 f"({w}) that spans ranks")
            if w < total and total % w:
                raise ValueError(f"segment length {w} spans ranks but does not divide the sequence ({total})")
            span.append((w, r))
        else:
            raise ValueError(f"segment length {w} must divide the shard length {local_len} or be a multiple of it "
                             f"(sequence {total} over {world} ranks); choose segment lengths and a world size "
                             f"that align")
    return local, span


def _heads(nheads: int, nheads_kv: int, r: int, device):
    """Per query head: its offset class; per exchanged kv row: (class, kv head); and whether that is GQA-regular."""
    g = nheads // nheads_kv
    cls = torch.arange(nheads, device="cpu") % r
    pairs = [(h % r, h // g) for h in range(nheads)]
    uniq = list(dict.fromkeys(pairs))
    run = nheads // len(uniq)
    regular = nheads % len(uniq) == 0 and pairs == [u for u in uniq for _ in range(run)]
    kv_pairs = uniq if regular else pairs
    pcls = torch.tensor([p[0] for p in kv_pairs], device=device)
    pkv = torch.tensor([p[1] for p in kv_pairs], device=device)
    return cls.to(device), torch.arange(nheads, device=device), pcls, pkv


def _rows(x: torch.Tensor, r: int):
    b, l, h, d = x.shape
    return x.view(b, l // r, r, h, d)


def _span_ring(l: int, w: int, r: int, world: int, rank: int, causal: bool, scale: float):
    """(schedule, peers, this rank's place among them) of the ring of the G
    ranks a segment of branch (w, r) spans, over its dilated rows: a pure
    function of the call's arguments."""
    gsize = min(w, l * world) // l
    first = (rank // gsize) * gsize
    m = l // r
    me = rank - first
    sched = RingSchedule(num_steps("contiguous", gsize, m, causal, (-1, -1)),
                         lambda src: plan("contiguous", me, src, gsize, m, causal, (-1, -1), scale))
    return sched, list(range(first, first + gsize)), me


def make_ring_plan(q, k, segs, rates, causal: bool, scale: float, group, backend: str) -> str:
    """The key of the spanning branches' rings' plan (:mod:`longattn.distributed.ring_plan`)."""
    world, l = dist.get_world_size(group), q.shape[1]
    _, span = split_branches(l, world, segs, rates)
    tr = choose_transport(group, whole=any(min(w, l * world) // l == world for w, _ in span))
    return make(lambda b, t: _ring_plan(q, k, segs, rates, causal, scale, group, b, t), backend, tr)


def _ring_plan(q, k, segs, rates, causal, scale, group, backend: str, tr: tuple) -> RingPlan:
    """The spanning branches' rings' plan: every block's backend and the transport, for all of them."""
    q_meta, k_meta, world, rank = meta(q), meta(k), dist.get_world_size(group), dist.get_rank(group)
    (b, l, h, d), dtype, device = q_meta
    _, span = split_branches(l, world, segs, rates)

    def build():
        blocks = {}
        for w, r in span:
            sched, peers, me = _span_ring(l, w, r, world, rank, causal, scale)
            hp = _heads(h, k_meta[0][2], r, "cpu")[2].numel()  # the exchanged dilated rows' kv heads
            steps = (sched.calls((me - s) % len(peers)) for s in range(sched.steps))
            blocks.update(block_backends(q_meta, ((b, l // r, hp, d), dtype, device), steps, backend))
        return RingPlan(backend, tuple(sorted(blocks.items())), False, *tr)
    return cached(("dilated", q_meta, k_meta, tuple(span), causal, scale, world, rank, backend, tr), build, group,
                  "dilated_attention")


def _span_setup(q, k, w, r, world, rank, causal, scale, group, ring_plan: RingPlan):
    """The ring of the G ranks a segment of branch (w, r) spans: schedule,
    transport and head classes, as the call's plan says."""
    sched, peers, _ = _span_ring(q.shape[1], w, r, world, rank, causal, scale)
    return sched, ring_plan.transport_for(group, peers), _heads(q.shape[2], k.shape[2], r, q.device)


# The local branches' results stay in float32 only when spanning branches
# merge into them afterwards; with none, they are final and kept in the input
# dtype (at 2M tokens per GPU the float32 copies were 50 GiB of the peak).
def _split(ring_plan: RingPlan, q, k, segs, rates, causal, scale, group):
    """What both passes start from: (world, rank, local branches, spanning
    branches, the local segments and rates, the ring plan completed)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local, span = split_branches(q.shape[1], world, segs, rates)
    ring_plan = ring_plan.complete(lambda bk_, tr: _ring_plan(q, k, segs, rates, causal, scale, group, bk_, tr))
    return world, rank, local, span, [w for w, _ in local], [r for _, r in local], ring_plan


def forward(plan: Optional[DilatedPlan], ring_plan: RingPlan, q, k, v, segs, rates, scale, causal, group, backend):
    """(out, lse) of this rank's shard; ``plan`` runs the local branches (see
    :func:`split_branches`; None when there are none), ``ring_plan`` the
    spanning ones (:func:`make_ring_plan`)."""
    world, rank, local, span, lsegs, lrates, ring_plan = _split(ring_plan, q, k, segs, rates, causal, scale, group)
    b, l, h, d = q.shape
    if not span:
        return _dil.forward(plan, q, k, v, lsegs, lrates, causal, scale, backend, out_dtype=q.dtype)
    if local:
        out, lse = _dil.forward(plan, q, k, v, lsegs, lrates, causal, scale, backend, out_dtype=torch.float32)
    else:
        out, lse = empty_state(q, torch.float32)
    lse_blh = lse.transpose(1, 2).contiguous()
    for w, r in span:
        sched, transport, (cls, hidx, pcls, pkv) = _span_setup(q, k, w, r, world, rank, causal, scale, group,
                                                               ring_plan)
        qd = _rows(q, r)[:, :, cls, hidx]                    # (B, L/r, H, D)
        kd = _rows(k, r)[:, :, pcls, pkv].contiguous()       # (B, L/r, Hp, D)
        vd = _rows(v, r)[:, :, pcls, pkv].contiguous()
        ob, lb, _ = ring_forward(qd, kd, vd, sched, BackendOp(plan=ring_plan), transport)
        o_sel = _rows(out, r)[:, :, cls, hidx]
        l_sel = lse_blh.view(b, l // r, r, h)[:, :, cls, hidx]
        merge_(o_sel, l_sel, ob, lb.transpose(1, 2))
        _rows(out, r)[:, :, cls, hidx] = o_sel
        lse_blh.view(b, l // r, r, h)[:, :, cls, hidx] = l_sel
    return out.to(q.dtype), lse_blh.transpose(1, 2).contiguous()


def backward(plan: Optional[DilatedPlan], ring_plan: RingPlan, dout, q, k, v, out, lse, dlse, segs, rates, scale,
             causal, group, backend):
    world, rank, local, span, lsegs, lrates, ring_plan = _split(ring_plan, q, k, segs, rates, causal, scale, group)
    b, l, h, d = q.shape
    if not span:
        return _dil.backward(plan, dout, q, k, v, out, lse, dlse, lsegs, lrates, causal, scale, backend)
    if local:
        dq, dk, dv = _dil.backward(plan, dout, q, k, v, out, lse, dlse, lsegs, lrates, causal, scale, backend,
                                   grad_dtype=torch.float32)
    else:
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
    lse_blh = lse.transpose(1, 2).contiguous()
    dlse_blh = None if dlse is None else dlse.transpose(1, 2).contiguous()
    for w, r in span:
        sched, transport, (cls, hidx, pcls, pkv) = _span_setup(q, k, w, r, world, rank, causal, scale, group,
                                                               ring_plan)
        sel = lambda x: _rows(x, r)[:, :, cls, hidx]
        lsel = lambda x: x.view(b, l // r, r, h)[:, :, cls, hidx].transpose(1, 2).contiguous()
        kd = _rows(k, r)[:, :, pcls, pkv].contiguous()
        vd = _rows(v, r)[:, :, pcls, pkv].contiguous()
        dqd, dkd, dvd = ring_backward(sel(dout), sel(q), kd, vd, sel(out), lsel(lse_blh),
                                      None if dlse_blh is None else lsel(dlse_blh), sched, BackendOp(plan=ring_plan),
                                      transport)
        _add_rows(dq, r, cls, hidx, dqd)
        _add_rows(dk, r, pcls, pkv, dkd)
        _add_rows(dv, r, pcls, pkv, dvd)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_rows(acc: torch.Tensor, r: int, cls: torch.Tensor, heads: torch.Tensor, val: torch.Tensor) -> None:
    """acc[rows of class cls[j], head heads[j]] += val[:, :, j] (repeated pairs add up)."""
    view = _rows(acc, r)
    b, m = view.shape[:2]
    bi = torch.arange(b, device=acc.device)[:, None, None]
    mi = torch.arange(m, device=acc.device)[None, :, None]
    view.index_put_((bi, mi, cls[None, None, :], heads[None, None, :]), val.float(), accumulate=True)


def comm_bytes(seqlen: int, world: int, segment_lengths, dilation_rates, *, batch: int, nheads: int,
               nheads_kv: int, headdim: int, itemsize: int, causal: bool, backward: bool = False) -> int:
    """Bytes one rank sends through P2P for one forward (or forward+backward):
    per spanning branch, (steps - 1) ring hops of the dilated K and V
    (B x L/r x Hp x D each); the backward (which runs the ring in reverse,
    see ``ring_backward``) first fetches the block the forward ended on (this
    op does not keep it), then the K/V ring again and dK/dV: one hop of the
    other rank's pieces in the input dtype in a two-step ring, else (steps -
    1) hops of float32 sums."""
    l = seqlen // world
    _, span = split_branches(l, world, segment_lengths, dilation_rates)
    total = 0
    for w, r in span:
        gsize = min(w, seqlen) // l
        steps = num_steps("contiguous", gsize, l // r, causal, (-1, -1))
        hp = _heads(nheads, nheads_kv, r, "cpu")[2].numel()
        rows = batch * (l // r) * hp * headdim
        fwd = (steps - 1) * 2 * rows * itemsize
        total += fwd
        if backward and steps > 1:
            total += 2 * rows * itemsize + fwd + (2 * rows * itemsize if steps == 2 else (steps - 1) * 2 * rows * 4)
    return total
