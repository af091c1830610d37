"""The autograd of the flex ops: the ring's (each step's FlexAttention graph
recorded in the forward, run with the merged statistics in the backward) and
the result of a call where no query sees any key.

The ring's backward (:func:`ring_grads`) is the generic ring's order
(:func:`longattn.distributed.ring.ring_backward`: start on the block the
forward ended on, walk back to the own block, dK/dV sums travel with their
block and reach the owner at its last step) specialised to the flex ring's one
full-size call per step, which lets it hold fewer shards (one shard: one
rank's q) at its peak:

* the own block is never received back: the step before it sends no K/V (a
  two-rank ring exchanges no K/V at all in the backward), and the block the
  forward kept is released after its step, not at the end of the backward
  (under saved-tensor hooks, i.e. activation checkpointing or offloading, the
  forward keeps none: the backward fetches it first, one hop nothing overlaps);
* dQ and the travelling dK/dV are the first step's kernel outputs, added to in
  place (float32 copies only where a row gets more than two pieces: more than
  two steps);
* sent dK/dV go into the exchange slot at once (``release``): the next step's
  kernel reuses their memory;
* a two-step ring's dK/dV share the K/V exchange's slots (they never overlap).

Peak of a forward + backward (the bench's measure: allocations above the
inputs, plus the exchange slots), in shards, as
:mod:`longattn.bench.flex_ring_memory` counts it (``tests/test_flex_ring.py``
pins the 2-rank numbers). 2 ranks, copy transport: 10, at the backward's
first step: the slots (two of K+V: 4), out, the kept K/V block (2), that
step's dQ/dK/dV (3); the second step holds 9 (slots, out, dQ, its
dQ/dK/dV). 2 ranks over send/recv: 9, at the second step: out, dQ, dK/dV
sent and received (4), its dQ/dK/dV. 3 ranks: 20 with the copy transport
(slots: 4 for K/V, 8 for float32 dK/dV sums), 18 over send/recv.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._merge import empty_state
from ..distributed.plan import Call
from ..distributed.ring import BackendOp, RingSchedule, ring_forward
from ..distributed.ring_plan import choose_transport
from ..distributed.transport import ring_transport


class NoKeys(torch.autograd.Function):
    """The result where no query sees any key: output 0, lse -inf, zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.like = [(x.shape, x.dtype, x.device) for x in (q, k, v)]
        return empty_state(q, q.dtype)

    @staticmethod
    def backward(ctx, dout, dlse):
        return tuple(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.like)


_OP = BackendOp()  # every call of a flex ring carries its executor (Call.run)


class _RecordingOp(BackendOp):
    """The local op of one flex ring call that a backward will follow: each
    step's forward keeps its FlexAttention graph (without tensors,
    :meth:`longattn.flex.step.FlexStep.record`) for :func:`ring_grads`."""

    def __init__(self):
        super().__init__()
        self.graphs: dict = {}

    def forward(self, c: Call, q, k, v):
        out, lse, self.graphs[c.run] = c.run.record(q, k, v)
        return out, lse


class _Sum:
    """A sum of full-size pieces: the first piece itself (two pieces: one add
    in float32 arithmetic, one rounding, as a float32 accumulator's cast), or
    a float32 copy of it where more pieces come (``wide``)."""

    def __init__(self, wide: bool, first: Optional[torch.Tensor] = None):
        self.wide, self.acc = wide, None
        if first is not None:
            self.add(first)

    def add(self, x: torch.Tensor) -> None:
        if self.acc is None:
            self.acc = x.to(torch.promote_types(x.dtype, torch.float32)) if self.wide else x
        else:
            self.acc.add_(x)


def _first_sums(piece: list, like: tuple, wide: bool) -> list:
    """The dK/dV sums a block's first contributor starts (its pieces, taken out
    of ``piece``): the pieces themselves, float32 copies (``wide``, made one
    at a time, each piece dropped after its copy), or zeros where the step
    was empty."""
    sums = []
    for i, x in enumerate(like):
        p, piece[i] = piece[i], None
        dtype = torch.promote_types(x.dtype, torch.float32) if wide else x.dtype
        sums.append(torch.zeros_like(x, dtype=dtype) if p is None else _Sum(wide, p).acc)
        del p
    return sums


def _added(sums: list, piece: list) -> list:
    """The float32 dK/dV sums that arrived from rank + 1 with this step's pieces added in place."""
    for acc, p in zip(sums, piece):
        if p is not None:
            acc.add_(p)
    return sums


def _home(sums: list, pieces: list, i: int, dtype) -> torch.Tensor:
    """The owner's dK (i=0) or dV (i=1), taken out of the lists: the sums that
    came round (a receive buffer, which the result never aliases) plus its own
    piece, rounded once."""
    incoming, own = sums[i], pieces[i]
    sums[i] = pieces[i] = None
    if own is None:
        return incoming.to(dtype, copy=True)
    if own.dtype == incoming.dtype:
        return own.add_(incoming)
    return incoming.add_(own).to(dtype)


def ring_grads(dout, q, k, v, out, lse, dlse, schedule: RingSchedule, graphs: dict, transport,
               kept: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shard (see the module docstring). Step t
    works on the block of ring position rank - steps + 1 + t; ``kept`` holds
    that of t = 0, which the forward received last, and is emptied here (no
    reference outlives the step; empty: the block is fetched first, a hop
    nothing overlaps, as a second backward through the same graph does)."""
    comm, steps = transport("kv"), schedule.steps
    rank, first = comm.rank, comm.rank - steps + 1
    runs = [next((c.run for c in schedule.calls((first + t) % comm.size)), None) for t in range(steps)]
    wide = steps > 2
    dq = _Sum(wide)

    def grads(t, kc, vc):
        if runs[t] is None:  # an empty step: no piece
            return None, None
        g = runs[t].backward(dout, q, kc, vc, out, lse, dlse, graphs[runs[t]])
        dq.add(g[0])
        return g[1], g[2]

    def dq_result():
        return torch.zeros_like(q) if dq.acc is None else dq.acc.to(q.dtype)

    if steps == 1:
        dk, dv = grads(0, k, v)
        return dq_result(), torch.zeros_like(k) if dk is None else dk, torch.zeros_like(v) if dv is None else dv
    # a two-step ring moves no K/V in the backward: its dK/dV take the K/V exchange's slots
    dkv = transport("kv" if steps == 2 else "dkv")
    if kept:
        kc, vc = kept.pop()
    else:
        comm.start([k, v], send_to=rank + steps - 1, recv_from=first, fresh=True)
        kc, vc = comm.wait()
    for t in range(steps - 1):
        more = t + 2 < steps  # the next block is not the own one: it comes from rank + 1
        if more:  # released: the kept block goes into the send slot now (received ones are there already)
            comm.start([kc, vc], send_to=rank - 1, recv_from=rank + 1, release=True)
        piece = list(grads(t, kc, vc))
        kc = vc = None  # the kept block is dead after its step
        travel = _first_sums(piece, (k, v), wide) if t == 0 else _added(dkv.wait(), piece)
        del piece
        dkv.start(travel, send_to=rank - 1, recv_from=rank + 1, release=True)
        del travel
        if more:
            kc, vc = comm.wait()
    own = list(grads(steps - 1, k, v))  # the own block; the other contributors' sums arrive from rank + 1
    dq_out = dq_result()
    dq.acc = None
    sums = list(dkv.wait())
    return dq_out, _home(sums, own, 0, k.dtype), _home(sums, own, 1, v.dtype)


def _no_saved_tensor_hooks() -> bool:
    """No saved_tensors_hooks context (checkpoint, save_on_cpu) is active."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is None


class RingFlex(torch.autograd.Function):
    """(out, lse) of the flex ring over ``schedule``
    (:func:`longattn.flex.schedule.ring_schedule`); ``grad``: record each
    step's graph for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, schedule, group, grad: bool):
        ctx.set_materialize_grads(False)
        op = _RecordingOp() if grad else _OP
        # keep_last: the block the backward starts on, kept only where a backward will run
        # the transport is chosen once, here (ring_plan.choose_transport), and the backward exchanges the same way
        transport = ring_transport(group, None, *choose_transport(group))
        # Under saved-tensor hooks (activation checkpointing, offloading) a block kept outside save_for_backward
        # would escape them and stay alive until the backward: there the backward fetches it again instead.
        keep = grad and _no_saved_tensor_hooks()
        out, lse, kv_last = ring_forward(q, k, v, schedule, op, transport, keep_last=keep)
        ctx.save_for_backward(q, k, v, out, lse)
        # not a saved tensor (those live until the backward returns): the backward drops it after its first step
        ctx.kept = [kv_last] if kv_last is not None else []
        ctx.schedule, ctx.transport, ctx.op = schedule, transport, op
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = ring_grads(dout, q, k, v, out, lse, dlse, ctx.schedule, ctx.op.graphs, ctx.transport, ctx.kept)
        return dq, dk, dv, None, None, None
