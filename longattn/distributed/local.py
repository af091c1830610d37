"""The local op: what a distributed algorithm runs on the tensors it holds.

One protocol for the ring (:mod:`longattn.distributed.ring`: a call per
visiting block) and Ulysses (:mod:`longattn.distributed.ulysses`: the whole
sequence of a group of heads):

* ``forward(call, q, k, v) -> (out, lse)``;
* ``saved(q, k, v, out, lse)``: the ``(q, k, v, out, lse)`` the backward
  will take (Ulysses keeps them; the ring passes the merged out and lse);
* ``backward(call, dout, q, k, v, out, lse, dlse) -> (dq, dk, dv)``, or None
  where an executor cannot (the ring then runs its plain calls).

``call`` is the ring's :class:`longattn.distributed.plan.Call` (rows of q and
of the block, mask, an optional executor ``call.run``), None for Ulysses.
Tensors are (B, S, heads, D), lse (B, heads, S) float32. ``send_rows`` /
``recv_rows`` are Ulysses' row layout (see :class:`LocalOp`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .. import backends as bk


class LocalOp:
    """Base of every local op (see the module docstring).

    Ulysses' row layout: ``send_rows``, rows of the outputs sent to each rank
    (None: S / p each); ``recv_rows``, rows received from each rank (this
    rank's rows that hold tokens; the rest are padding, filled with 0 and lse
    -inf)."""

    send_rows: Optional[Sequence[int]] = None
    recv_rows: Optional[int] = None

    def forward(self, call, q, k, v):
        raise NotImplementedError

    def saved(self, q, k, v, out, lse) -> tuple:
        return q, k, v, out, lse

    def backward(self, call, dout, q, k, v, out, lse, dlse):
        raise NotImplementedError


class BackendOp(LocalOp):
    """A ring step's local op: one dense block through the backend layer, or
    a call's own executor (``Call.run``: a fused step of many document blocks).

    ``plan`` (a :class:`longattn.distributed.ring_plan.RingPlan`): each block
    runs the backend the plan chose for it, forward and backward alike.
    Without a plan, ``backend`` as the backend layer takes it (``"auto"``: the
    first backend whose capabilities fit the block)."""

    def __init__(self, backend: str = "auto", plan=None):
        self.backend, self.plan = backend, plan

    def _backend(self, c, q, k) -> bk.Backend:
        if self.plan is None:
            return bk.select_backend(q, k, c.spec, self.backend)
        return bk.BACKENDS[self.plan.backend_of(c.spec, q, k)]  # chosen for this block kind by the plan

    def forward(self, c, q, k, v):
        if c.run is not None:
            return c.run.forward(q, k, v)
        return self._backend(c, q, k).forward(q, k, v, c.spec)

    def backward(self, c, dout, q, k, v, out, lse, dlse):
        """(dq, dk, dv), or None when the executor cannot (its plain calls run instead)."""
        if c.run is not None:
            return c.run.backward(dout, q, k, v, out, lse, dlse)
        return self._backend(c, q, k).backward(dout, q, k, v, out, lse, c.spec, dlse=dlse)
