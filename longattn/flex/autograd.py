"""The autograd of the flex ops: the ring's (each step's FlexAttention graph
recorded in the forward, run with the merged statistics in the backward) and
the result of a call where no query sees any key."""
from __future__ import annotations

import torch

from .._merge import empty_state
from ..distributed.plan import Call
from ..distributed.ring import BackendOp, ring_backward, ring_forward
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
    :meth:`longattn.flex.step.FlexStep.record`) and the backward runs it."""

    def __init__(self):
        super().__init__()
        self.graphs: dict = {}

    def forward(self, c: Call, q, k, v):
        out, lse, self.graphs[c.run] = c.run.record(q, k, v)
        return out, lse

    def backward(self, c: Call, dout, q, k, v, out, lse, dlse):
        return c.run.backward(dout, q, k, v, out, lse, dlse, self.graphs[c.run])


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
        out, lse, kv_last = ring_forward(q, k, v, schedule, op, transport, keep_last=grad)
        ctx.save_for_backward(q, k, v, out, lse, *(kv_last or ()))
        ctx.schedule, ctx.transport, ctx.op = schedule, transport, op
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *last = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, ctx.schedule, ctx.op, ctx.transport,
                                   tuple(last) or None)
        return dq, dk, dv, None, None, None
