"""The pipelined Ulysses call: exchange, local attention and exchange back,
over groups of heads (:class:`longattn.tuning.UlyssesTuning`)."""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..local import LocalOp
from .exchange import (Exchange, _elems, _from_full, _group_widths, _kv_index, _kv_received, _place, _split, _start,
                       _start_group, _to_full, _wait)


def _start_back(y, ranges, ex: Exchange, local: LocalOp, b: int, s: int, rows: int, d: int):
    """Start returning y (B, R, w, D), one group's heads over every rank's rows,
    to the ranks the rows belong to; what comes back is every rank's heads
    ``ranges`` (one group) of this rank's ``rows``."""
    w = y.shape[2]
    sent = [b * r * w * d for r in local.send_rows] if local.send_rows is not None else [b * s * w * d] * ex.world
    return _start(_from_full(y, ex, local.send_rows), _elems(ranges, b * rows * d, ex.chunks), sent, ex)


class _Ulysses(torch.autograd.Function):
    """Exchange, local attention and exchange back, pipelined over head groups
    (forward and backward alike): group c+1's inputs travel while group c
    computes, and group c-1's outputs land once group c's kernel is queued,
    so at most two groups are in flight. Every send buffer is freed at its
    wait, every receive buffer once landed or, for the inputs, once the local
    call has consumed it; what backward keeps is what the local call saves."""

    @staticmethod
    def forward(ctx, q, k, v, ex: Exchange, local: LocalOp, return_lse: bool):
        b, s, h, d = q.shape
        n = ex.chunks
        qr, kr = ex.q_ranges, ex.kv_ranges
        wq, wk = _group_widths(ex)
        ins = [(q, qr, wq), (k, kr, wk), (v, kr, wk)]
        idx = _kv_index(ex, q.device)
        rows = local.recv_rows if local.recv_rows is not None else s
        outs = [None, None] if return_lse else [None]  # out, lse: made at their first landing

        def land(t, i, c):
            if outs[i] is None:
                outs[i] = q.new_empty(b, s, h, d) if i == 0 else q.new_empty(b, h, s, dtype=torch.float32)
            dst = outs[0] if i == 0 else outs[1].transpose(1, 2).unsqueeze(-1)
            _place(dst[:, :rows], _wait(t), qr, ex, c, n)

        saved, pending = [], []
        inbound = _start_group(ins, ex, 0, n)
        for c in range(n):
            following = _start_group(ins, ex, c + 1, n) if c + 1 < n else []
            qf, kf, vf = (_to_full(_wait(inbound.pop(0)), ex, b, s, w, d) for w in (wq, wk, wk))
            inbound = following
            if idx is not None:
                kf, vf = kf.index_select(2, idx), vf.index_select(2, idx)
            o, lse = local.forward(None, qf, kf, vf)
            keep = local.saved(qf, kf, vf, o, lse)
            del qf, kf, vf
            saved += keep
            # lse travels as (B, R, h, 1) rows: the same exchange with D = 1
            sent = [_start_back(x, qr, ex, local, b, s, rows, e)
                    for x, e in ((o, d), (lse.transpose(1, 2).unsqueeze(-1), 1))[:len(outs)]]
            del o, lse
            while pending:
                land(*pending.pop(0))
            pending = [(t, i, c) for i, t in enumerate(sent)]
            del sent
        while pending:
            land(*pending.pop(0))
        out, lse_out = outs[0], outs[1] if return_lse else None
        if rows < s:
            out[:, rows:] = 0
            if return_lse:
                lse_out[:, :, rows:] = float("-inf")
        ctx.set_materialize_grads(False)
        ctx.return_lse = return_lse
        ctx.save_for_backward(*saved)
        ctx.ex, ctx.local, ctx.per_chunk = ex, local, len(saved) // n
        ctx.shapes = (q.shape, k.shape, v.shape)
        return (out, lse_out) if return_lse else out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse=None):
        ex, local = ctx.ex, ctx.local
        shapes = ctx.shapes
        b, s, h, d = shapes[0]
        n, per = ex.chunks, ctx.per_chunk
        qr, kr = ex.q_ranges, ex.kv_ranges
        ranges = (qr, kr, kr)
        wq, wk = _group_widths(ex)
        saved = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = saved[0].new_zeros(b, s, h, d)
        if ctx.return_lse and dlse is None:
            # every rank exchanges dlse when lse was returned: one whose loss ignores lse must not skip a collective
            # the others run
            dlse = dout.new_zeros(b, h, s, dtype=torch.float32)
        ins = [(dout, qr, wq)] + ([] if dlse is None else [(dlse.transpose(1, 2).unsqueeze(-1), qr, wq)])
        rows = local.recv_rows if local.recv_rows is not None else s
        grads = [None, None, None]  # dq, dk, dv: made at their first landing

        def land(t, i, c):
            if grads[i] is None:
                # kv heads that several ranks read come back from each and are summed
                split = _split(ranges[i], ex.world, shapes[i][2])
                grads[i] = dout.new_empty(shapes[i]) if split else dout.new_zeros(shapes[i])
            _place(grads[i][:, :rows], _wait(t), ranges[i], ex, c, n)

        pending = []  # (transfer, gradient, group)
        inbound = _start_group(ins, ex, 0, n)
        for c in range(n):
            following = _start_group(ins, ex, c + 1, n) if c + 1 < n else []
            do = _to_full(_wait(inbound.pop(0)), ex, b, s, wq, d)
            dl = None
            if dlse is not None:
                dl = _to_full(_wait(inbound.pop(0)), ex, b, s, wq, 1).squeeze(-1).transpose(1, 2)
            inbound = following
            g = list(local.backward(None, do, *saved[c * per:(c + 1) * per], dl))
            del do, dl
            g[1], g[2] = _kv_received(g[1], ex), _kv_received(g[2], ex)
            last = c == n - 1
            for i in range(3):
                # after the last kernel there is nothing to hide the transfers behind: each lands
                # before the next starts, so that one receive buffer and one new gradient are
                # made at a time while the saved tensors are still held
                while last and pending:
                    land(*pending.pop(0))
                pending.append((_start_back(g[i], ranges[i], ex, local, b, s, rows, d), i, c))
                g[i] = None
            # the previous group's gradients land once this group's kernel is queued behind them
            while pending and pending[0][2] < c:
                land(*pending.pop(0))
        while pending:
            land(*pending.pop(0))
        if rows < s:
            for g in grads:
                g[:, rows:] = 0
        return (*grads, None, None, None)


def ulysses(q, k, v, ex: Exchange, local: LocalOp, return_lse: bool):
    """Ulysses attention of this rank's shards q (B, s, H, D), k, v (B, s, Hkv, D)
    with ``local`` on the whole sequence, pipelined over ``ex.chunks`` head
    groups; returns out (B, s, H, D) (and lse (B, H, s)), this rank's rows."""
    return _Ulysses.apply(q, k, v, ex, local, return_lse)
