"""Ring attention, the algorithm: ``ring_forward(q, k, v, schedule, op, transport)``.

Each step sends this rank's current K/V block to the next rank and receives
the previous rank's (batched P2P, two buffers), while the local op attends to
the block in hand; partial results merge by lse in float32. Memory per rank
stays O(seqlen / p): the local shard, one K/V block in flight and the
accumulators. The ring carries only ``nheads_kv`` heads (GQA/MQA send 1/g of
MHA's bytes).

Backward: K/V go round again, in the reverse order, starting on the block the
forward ended on (kept by the forward); each step's local backward uses the
merged output and lse (exact pieces of the full gradient); dK/dV accumulate
(float32 where a block has more than one other contributor) in buffers that
travel with their K/V and reach the owner at its last step.

The three parts are arguments, so one loop serves every ring (dense, packed
documents, dilated branches over ranks):

* ``schedule`` (:class:`RingSchedule`): how many steps, and which dense calls
  (:class:`longattn.distributed.plan.Call`) this rank makes on the block that
  started at each ring position (:mod:`longattn.distributed.plan`);
* ``op`` (:class:`longattn.distributed.local.LocalOp`, e.g. :class:`BackendOp`):
  the local attention of one call;
* ``transport(tag) -> exchange``: the P2P exchange for a tag (``"kv"``,
  ``"dkv"``), e.g. :func:`longattn.distributed.transport.ring_transport`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from .accumulate import MergedRows, RowSums, assemble, disjoint, home, kv_sums, max_cover
from .local import BackendOp, LocalOp
from .plan import Call

__all__ = ["RingSchedule", "BackendOp", "ring_forward", "ring_backward"]


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """``steps`` ring steps; ``calls(src)`` the dense calls this rank makes on
    the K/V block that started at ring position ``src``."""

    steps: int
    calls: Callable[[int], Sequence[Call]]


def ring_forward(q, k, v, schedule: RingSchedule, op: LocalOp, transport, keep_last: bool = False):
    """Returns (out, lse, kv_last): with ``keep_last`` and more than one step,
    ``kv_last`` is the last K/V block received (ring position rank - steps +
    1) in tensors of its own, for :func:`ring_backward` to start on; else None."""
    comm = transport("kv")
    steps = schedule.steps
    plans = [list(schedule.calls((comm.rank - s) % comm.size)) for s in range(steps)]
    acc = MergedRows(q, q.dtype if max_cover(plans) <= 2 else torch.float32)
    kc, vc = k, v
    for s in range(steps):
        if s + 1 < steps:
            comm.start([kc, vc], comm.rank + 1, comm.rank - 1, fresh=keep_last and s + 2 == steps)
        for c in plans[s]:
            ob, lb = op.forward(c, q[:, c.q0:c.q1], kc[:, c.k0:c.k1], vc[:, c.k0:c.k1])
            acc.add(c.q0, c.q1, ob, lb)
        if s + 1 < steps:
            kc, vc = comm.wait()
    out, lse = acc.result()
    return out, lse, ((kc, vc) if keep_last and steps > 1 else None)


def flat_calls(calls) -> list:
    """Calls as the backward may run them (a fused executor can fall back to its plain blocks)."""
    return [x for c in calls for x in (c.run.calls if c.run is not None else [c])]


class _StepGrads:
    """The backward's per-step work: runs a step's calls, sums dQ over the
    whole ring, and returns each call's (k0, k1, dK, dV)."""

    def __init__(self, op: LocalOp, dout, q, out, lse, dlse, plans):
        self.op, self.dout, self.q, self.out, self.lse, self.dlse = op, dout, q, out, lse, dlse
        # Rows with at most two dQ pieces are summed in the input dtype (copy, then one add in float32
        # arithmetic: one rounding, as a float32 accumulator's cast).
        self.dq_dtype = q.dtype if max_cover([flat_calls(p) for p in plans]) <= 2 else torch.float32
        self.dq: Optional[RowSums] = None

    def run(self, calls, kc, vc) -> list:
        grads = []
        for c in calls:
            qs = slice(c.q0, c.q1)
            dl = None if self.dlse is None else self.dlse[:, :, qs].contiguous()
            g = self.op.backward(c, self.dout[:, qs], self.q[:, qs], kc[:, c.k0:c.k1], vc[:, c.k0:c.k1],
                                 self.out[:, qs], self.lse[:, :, qs].contiguous(), dl)
            if g is None:
                grads += self.run(c.run.calls, kc, vc)
                continue
            self._add_dq(c, g[0])
            grads.append((c.k0, c.k1, g[1], g[2]))
        return grads

    def _add_dq(self, c: Call, dqb: torch.Tensor) -> None:
        q = self.q
        if (self.dq is None and (c.q0, c.q1) == (0, q.shape[1]) and dqb.dtype == self.dq_dtype
                and dqb.stride() == q.stride()):
            self.dq = RowSums(dqb, [(0, q.shape[1])])  # the first piece covers every row: it becomes the sum
            return
        if self.dq is None:
            self.dq = RowSums.empty(q, self.dq_dtype)
        self.dq.add(c.q0, c.q1, dqb)

    def dq_result(self) -> torch.Tensor:
        return self.dq.result(self.q.dtype) if self.dq is not None else torch.zeros_like(self.q)


def ring_backward(dout, q, k, v, out, lse, dlse, schedule: RingSchedule, op: LocalOp, transport, kv_last=None):
    """(dq, dk, dv) of this rank's shard, in the reverse order of the forward.

    The forward ends holding the K/V block of ring position rank - steps + 1
    (``kv_last``, which the forward op saves); the backward starts on it and
    walks back towards its own block: step t works on the block of position
    rank - steps + 1 + t, then passes the block and its dK/dV sums to
    rank - 1, which works on that block next. So every block's sums end on
    their owner with the owner's own contribution, at the last step: no hop
    home and no hop before the first step. A two-step ring's one hop carries
    the other rank's pieces in the input dtype (summed with the owner's in
    float32 arithmetic, one rounding); longer rings pass float32 sums.
    Without ``kv_last`` (callers that do not save it) that block is fetched
    first, a hop nothing overlaps.
    """
    comm, steps = transport("kv"), schedule.steps
    rank, first = comm.rank, comm.rank - steps + 1
    plans = [list(schedule.calls((first + t) % comm.size)) for t in range(steps)]
    work = _StepGrads(op, dout, q, out, lse, dlse, plans)
    if steps == 1:
        grads = work.run(plans[0], k, v)
        if disjoint(grads) and all(g[2].dtype == k.dtype for g in grads):
            return work.dq_result(), assemble(grads, 2, k).contiguous(), assemble(grads, 3, v).contiguous()
        dk, dv = kv_sums(k, v, grads)
        return work.dq_result(), dk.to(k.dtype), dv.to(v.dtype)
    dkv_comm = transport("dkv")
    if kv_last is None:
        comm.start([k, v], send_to=rank + steps - 1, recv_from=first, fresh=True)
        kv_last = comm.wait()
    kc, vc = kv_last
    for t in range(steps - 1):
        comm.start([kc, vc], send_to=rank - 1, recv_from=rank + 1)
        grads = work.run(plans[t], kc, vc)
        if t == 0 and steps == 2 and disjoint(grads):
            # the block's one contributor besides its owner: its pieces as the kernel returned them
            travel = (assemble(grads, 2, k), assemble(grads, 3, v))
        else:
            # this step's dK/dV go into fresh float32 sums, or into those that arrived from rank + 1
            travel = kv_sums(k, v, grads, None if t == 0 else dkv_comm.wait())
        del grads
        dkv_comm.start(list(travel), send_to=rank - 1, recv_from=rank + 1, fresh=t == steps - 2)
        del travel
        kc, vc = comm.wait()
    own = work.run(plans[-1], kc, vc)  # the own block; the other contributors' sums arrive from rank + 1
    dk_in, dv_in = dkv_comm.wait()
    return work.dq_result(), home(dk_in, own, 2, k.dtype), home(dv_in, own, 3, v.dtype)
