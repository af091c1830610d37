"""Running an exchange plan (:mod:`.exchange`): its transfers and the sums of
its pieces, forward and backward.

One transfer is in flight at a time (gloo can pair the messages of two
concurrent collectives wrongly), each started as early as its data exists and
overlapping the largest piece that does not need it:

* forward: send the halo K/V and the shipped rows (one transfer) | own piece |
  serve the rows that arrived | send their partials back | halo pieces | merge
  the partials into the shipped rows;
* backward: send the shipped rows' dout, out and lse | halo pieces | serve
  pieces | send the halo dK/dV and the served rows' dQ back (one transfer) |
  own piece | add what came back.

Where the plan joins the halo keys to the own piece (``ExchangePlan.joined``)
that piece runs on [halo keys | my keys] after the halo arrives, and its
backward comes first: its halo dK/dV are what travels back.

Sums: the own piece's outputs (over all rows) are the accumulators, no zero
fill; they keep the input dtype while a row gets at most two pieces (one merge
or add in float32 arithmetic, one rounding, as a float32 accumulator's final
cast) and are float32 beyond. Rows that also get row pieces (shipped rows'
partials, returned halo gradients) are summed from every piece in float32
apart and rounded once. On CUDA the halo and served pieces run on a side
stream (:class:`Side`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .._merge import empty_state, merge_, merge_stack
from .._streams import has_side_stream, side_stream
from ..dilated import graphs
from ..distributed.accumulate import MergedRows, RowSums


def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape[2:]), t.dtype


ALIGN = 16  # each block starts 16-byte aligned: a view of it is one FA4 reads in place and view(dtype) accepts


def _block(n: int, tail: tuple, dt: torch.dtype, batch: int) -> int:
    """The bytes of one tensor's n rows in a transfer, padded to ``ALIGN``."""
    return -(-batch * n * math.prod(tail) * dt.itemsize // ALIGN) * ALIGN


def _n(rows: list) -> list:
    return [len(r) for r in rows]


def _rows(x) -> int:
    return x[1].numel() if isinstance(x, tuple) else x.shape[1]


class _Blocks:
    """Typed blocks of a uint8 buffer: one dtype view per dtype, each block one
    ``as_strided`` of it (a slice and two views per block would be three
    dispatches of host time per tensor and peer, on every call)."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.typed = buf, {}

    def at(self, off: int, batch: int, n: int, tail: tuple, dt: torch.dtype) -> torch.Tensor:
        t = self.typed.get(dt)
        if t is None:
            t = self.typed[dt] = self.buf.view(dt)
        shape = (batch, n, *tail)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return t.as_strided(shape, strides, t.storage_offset() + off // dt.itemsize)


class Transfer:
    """One ``all_to_all_single`` of row groups. ``groups``: (parts, counts,
    specs) each; ``parts[p]``, what goes to peer p: per spec, a tensor (B,
    n_p, ...) or a pair (tensor, long index of n_p rows along dim 1; gathered
    straight into the send buffer); ``counts[p]`` rows of the group come from
    p. Each peer's bytes hold, group by group and spec by spec, one block
    (B, n, ...) per tensor (so what arrives is read in place, :func:`unpack`;
    one collective whatever the dtypes). Nothing runs where ``active`` is
    False (no rank moves a row)."""

    def __init__(self, groups: list, batch: int, group, active: bool, device):
        self.layout = [(counts, specs) for _, counts, specs in groups]
        self.batch, self.work, self.src = batch, None, None
        self.stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
        peers = len(groups[0][1])
        out_splits = [sum(_block(counts[p], tail, dt, batch) for counts, specs in self.layout for tail, dt in specs)
                      for p in range(peers)]
        self.buf = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        if active:
            self.src, in_splits = pack(groups, batch, device)
            self.work = dist.all_to_all_single(self.buf, self.src, out_splits, in_splits, group=group,
                                               async_op=True)

    def wait(self) -> list:
        """Per group, per spec, the rows every peer sent, in rank order: (B, sum(counts), ...) (:func:`unpack`).
        The stream current here waits for the collective; it may be another than the one the buffers were made
        on (the side stream waits for the halo the main stream sent)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            waiting = torch.cuda.current_stream(self.buf.device) if self.stream is not None else None
            if waiting is not None and waiting != self.stream:
                # NCCL's wait releases the send buffer to the allocator once the *waiting* stream is ordered
                # after the collective; the allocator hands a block back to the stream that made it, which may
                # still be behind the collective, and a kernel there would overwrite rows not yet sent (peers
                # then receive wrong keys). Recording the waiting stream keeps both buffers until it gets there.
                self.src.record_stream(waiting)
                self.buf.record_stream(waiting)
            self.src = None
        return unpack(self.buf, self.layout, self.batch)


def pack(groups: list, batch: int, device) -> tuple[torch.Tensor, list]:
    """A :class:`Transfer`'s send buffer (uint8) and its bytes per peer: each
    tensor's rows written once, as a block (a pair's rows gathered straight
    into it), in the order :func:`unpack` reads."""
    peers = len(groups[0][1])
    in_splits = [sum(_block(_rows(x), tail, dt, batch) for parts, _, specs in groups
                     for x, (tail, dt) in zip(parts[p] or (), specs)) for p in range(peers)]
    src, off = torch.empty(sum(in_splits), dtype=torch.uint8, device=device), 0
    blocks = _Blocks(src)
    for p in range(peers):
        for parts, _, specs in groups:
            for x, (tail, dt) in zip(parts[p] or (), specs):
                n = _rows(x)
                if not n:  # nothing for this peer: no block (every view is host time on each call)
                    continue
                block = blocks.at(off, batch, n, tail, dt)
                if isinstance(x, tuple):
                    torch.index_select(x[0], 1, x[1], out=block)
                else:
                    block.copy_(x)
                off += _block(n, tail, dt, batch)
    return src, in_splits


def unpack(buf: torch.Tensor, layout: list, batch: int) -> list:
    """A :class:`Transfer`'s received bytes ``buf`` as its groups' tensors
    (``layout``: (counts, specs) per group): per group, per spec, one tensor
    (B, sum(counts), ...) of every peer's rows in rank order: a view of
    ``buf`` where one peer sent rows, else one concatenation (its consumers
    take every peer's rows at once: one launch per tensor, not one per
    peer)."""
    peers = len(layout[0][0])
    blocks, off, typed = [[[] for _ in specs] for _, specs in layout], 0, _Blocks(buf)
    for p in range(peers):
        for g, (counts, specs) in enumerate(layout):
            for i, (tail, dt) in enumerate(specs):
                n = counts[p]
                if n:
                    blocks[g][i].append(typed.at(off, batch, n, tail, dt))
                off += _block(n, tail, dt, batch)
    res = []
    for g, (counts, specs) in enumerate(layout):
        res.append([torch.cat(bs, 1) if len(bs) > 1 else bs[0] if bs else
                    torch.empty(batch, 0, *tail, dtype=dt, device=buf.device)
                    for bs, (tail, dt) in zip(blocks[g], specs)])
    return res


class OutSum:
    """The running (out (B, L, H, D), lse (B, H, L)) of a rank's rows: pieces
    over row ranges merged as the ring's (:class:`MergedRows`: the first
    full-size piece is the accumulator, in the input dtype where a row gets at
    most ``pieces``  = 2), the rows ``rows`` (long, ascending) also merged apart
    in float32 with the row pieces (:meth:`add_rows`)."""

    def __init__(self, q: torch.Tensor, rows: torch.Tensor, pieces: int):
        self.q, self.rows = q, rows
        self.acc = MergedRows(q, q.dtype if pieces <= 2 else torch.promote_types(q.dtype, torch.float32))
        self.rout = self.rlse = None

    def _rows(self, pos, o, l_, full: bool = False) -> None:
        if full:  # every row, positions 0, 1, ...: merged in place; the first such piece is the accumulator
            if self.rout is None:
                self.rout, self.rlse = o.float(), l_.float().contiguous()
            else:
                merge_(self.rout, self.rlse, o.float(), l_)
            return
        if self.rout is None:
            b, _, h, _ = self.q.shape
            self.rout = torch.zeros(b, len(self.rows), h, o.shape[-1], dtype=torch.float32, device=o.device)
            self.rlse = torch.full((b, len(self.rows), h), float("-inf"), device=o.device)
        so, sl = self.rout[:, pos], self.rlse[:, pos]
        merge_(so, sl, o.float(), l_.float())
        self.rout[:, pos], self.rlse[:, pos] = so, sl

    def add(self, o: torch.Tensor, l_: torch.Tensor, r0: int, at: tuple) -> None:
        """A piece of the rows [r0, r0 + n): o (B, n, H, D), l_ (B, H, n) float32;
        ``at``: (positions in ``rows``, rows in the piece) of the rows it covers."""
        if len(at[0]):
            self._rows(at[0], o.index_select(1, at[1]), l_.index_select(2, at[1]).transpose(1, 2),
                       full=len(at[0]) == len(self.rows))
        self.acc.add(r0, r0 + o.shape[1], o, l_)

    def merge_in(self, piece, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A few-keys piece (:class:`.pieces.FewKeys` over its rows [r0, r1) and keys [k0, k1) of ``k``, ``v``)
        merged into the accumulator in place (no rows merged apart: the plan makes one only where ``rows`` is
        empty)."""
        acc, r0, r1 = self.acc, piece.r0, piece.r1
        if acc.out is None:
            acc.out, acc.lse = empty_state(self.q, acc.dtype)
        keys = slice(piece.k0, piece.k1)
        piece.run.forward_into(q[:, r0:r1], k[:, keys], v[:, keys], acc.out[:, r0:r1], acc.lse[:, :, r0:r1])
        acc.written.append((r0, r1))  # a later piece over these rows merges with them

    def add_rows(self, pos: torch.Tensor, o: torch.Tensor, l_: torch.Tensor) -> None:
        """A partial of the rows at positions ``pos`` of ``rows``: o (B, n, H, D), l_ (B, n, H)."""
        if len(pos):
            self._rows(pos, o, l_)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        acc = self.acc
        if acc.out is None:
            acc.out, acc.lse = empty_state(self.q, acc.dtype)
        if self.rout is not None:
            acc.out[:, self.rows] = self.rout.to(acc.out.dtype)
            acc.lse[:, :, self.rows] = self.rlse.transpose(1, 2)
        return acc.result()


class GradSum:
    """dQ, dK or dV of a rank: pieces over row ranges summed as the ring's
    (:class:`RowSums`: a full-size first piece is the accumulator, no zero
    fill; float32 where a row gets more than two), the rows ``rows`` also
    summed apart in float32 with the row pieces (:meth:`add_rows`)."""

    def __init__(self, like: torch.Tensor, rows: torch.Tensor, pieces: int):
        self.like, self.rows = like, rows
        self.dtype = like.dtype if pieces <= 2 else torch.promote_types(like.dtype, torch.float32)
        self.sums = self.racc = None

    def _racc(self, x):
        if self.racc is None:
            self.racc = torch.zeros((x.shape[0], len(self.rows), *x.shape[2:]), dtype=torch.float32, device=x.device)
        return self.racc

    def add(self, x: torch.Tensor, r0: int, at: tuple) -> None:
        """A piece of the rows [r0, r0 + n); ``at`` as :meth:`OutSum.add`'s."""
        if len(at[0]) == len(self.rows) and len(at[0]):
            # the piece covers every row (positions ascending, so 0, 1, ...): a gather and an add, not index_add_'s
            # atomics; the first such piece is the accumulator (no zero fill)
            rows = x.index_select(1, at[1])
            if self.racc is None:
                self.racc = rows.float()
            else:
                self.racc.add_(rows)
        elif len(at[0]):
            self._racc(x).index_add_(1, at[0], x[:, at[1]].float())
        r1 = r0 + x.shape[1]
        if self.sums is None and (r0, r1) == (0, self.like.shape[1]):
            self.sums = RowSums(x.to(self.dtype), [(r0, r1)])
            return
        if self.sums is None:
            self.sums = RowSums.empty(self.like, self.dtype)
        self.sums.add(r0, r1, x)

    def add_rows(self, pos: torch.Tensor, x: torch.Tensor) -> None:
        if len(pos):
            self._racc(x).index_add_(1, pos, x.float())

    def result(self) -> torch.Tensor:
        acc = torch.zeros_like(self.like, dtype=self.dtype) if self.sums is None else self.sums.zero_unwritten()
        if self.racc is not None:
            acc[:, self.rows] = self.racc.to(acc.dtype)
        return acc.to(self.like.dtype)


class Side:
    """Where the pieces other than the own one run: a side stream on CUDA
    (``concurrent``), made once per device, started after the current
    stream's work so far; else the current stream. :meth:`join` makes the
    current stream wait for it and marks the tensors it made that the current
    stream uses (the allocator then keeps them until that use is done);
    :meth:`close` orders the side stream's next work after the current one's."""

    def __init__(self, device: torch.device, concurrent: bool):
        self.main = self.side = None
        if concurrent and device.type == "cuda" and not (
                torch.cuda.is_current_stream_capturing() and not has_side_stream(device, "flex exchange")):
            self.main = torch.cuda.current_stream(device)
            self.side = side_stream(device, "flex exchange")
            self.side.wait_stream(self.main)

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def join(self, tensors) -> None:
        if self.side is None:
            return
        self.main.wait_stream(self.side)
        for t in tensors:
            t.record_stream(self.main)

    def close(self) -> None:
        if self.side is not None:
            self.side.wait_stream(self.main)


def _tensors(xs) -> list:
    """The tensors in nested lists / tuples."""
    if isinstance(xs, torch.Tensor):
        return [xs]
    return [t for x in (xs or ()) if x is not None for t in _tensors(x)]


def _cat0(xs: list) -> torch.Tensor:
    """Per-peer index lists in rank order, as the rows a transfer delivers them."""
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _overlap(spans: list) -> bool:
    """Any two of the [a, b) spans share an index."""
    spans = sorted(spans)
    return any(a[1] > b[0] for a, b in zip(spans, spans[1:]))


def _per_peer(x: torch.Tensor, counts: list) -> list:
    """Rows of ``x`` (B, sum(counts), ...) split in rank order: [[rows of peer p]]."""
    offs = [sum(counts[:p]) for p in range(len(counts) + 1)]
    return [[x[:, offs[p]:offs[p + 1]]] for p in range(len(counts))]


class ExchangeFlex(torch.autograd.Function):
    """(out, lse) of the exchange over ``plan`` (see the module docstring).
    ``graphed``: each pass replayed from a CUDA graph per shape
    (:data:`PASS_GRAPHS`; every rank makes the same calls, so every rank
    captures and replays the same passes and their collectives)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, group, graphed: bool = False):
        ctx.set_materialize_grads(False)
        if graphed:
            out, lse, buf = PASS_GRAPHS.run(("fwd", plan, group), lambda *x: _forward(*x, plan, group), (q, k, v))
        else:
            out, lse, buf = _forward(q, k, v, plan, group)
        ctx.save_for_backward(q, k, v, out, lse, buf)
        ctx.plan, ctx.group, ctx.graphed = plan, group, graphed
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, buf = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        xs = (dout, q, k, v, out, lse, buf, dlse)
        if ctx.graphed:
            grads = PASS_GRAPHS.run(("bwd", plan, group), lambda *x: _backward(*x, plan, group), xs)
        else:
            grads = _backward(*xs, plan, group)
        return (*grads, None, None, None)


PASS_GRAPHS = graphs.GraphCache(graphs.MAX_GRAPHS)
"""The exchange's passes replayed from CUDA graphs (``FlexExchangeTuning.graph_max_tokens``), keyed by plan,
group and pass."""


def _layout(plan, q, k, v) -> list:
    """The forward transfer's layout (:class:`Transfer`'s): (rows from each peer, specs) of the halo K/V and of
    the shipped rows; the backward's :func:`unpack` reads the received bytes with it."""
    return [(_n(plan.halo_in), [_spec(k), _spec(v)]), (_n(plan.q_in), [_spec(q)])]


def _forward(q, k, v, plan, group):
    """(out, lse, the received bytes) of the exchange over ``plan``."""
    b, length, h, _ = q.shape
    dev, hv = q.device, v.shape[-1]
    (kv_in, kv_specs), (q_in, q_specs) = _layout(plan, q, k, v)
    sent = Transfer([([[(k, r), (v, r)] for r in plan.halo_send], kv_in, kv_specs),
                     ([[(q, r)] for r in plan.ship], q_in, q_specs)],
                    b, group, plan.moves_kv or plan.moves_q, dev)
    # the own piece first: the GPU runs it while the host issues the rest and the halos and shipped rows
    # arrive; the other pieces run beside it on the side stream. Joined to the halo keys, it waits for them
    # (the side stream's pieces then start after the transfer, not after the own piece)
    got = sent.wait() if plan.joined else None
    side = Side(dev, plan.concurrent)
    if plan.joined:
        (kh, vh), _ = got
        own = plan.own.forward(q, kh, k, vh, v)
    else:
        own = plan.own.forward(q, k, v) if plan.own is not None else None
    with side:
        (kh, vh), (qs,) = got or sent.wait()
        if plan.serve is not None:
            o, l_ = plan.serve.forward(qs, k, v)
        else:
            o = qs.new_zeros(*qs.shape[:3], hv)
            l_ = torch.full((b, h, qs.shape[1]), float("-inf"), device=dev)
        parts = [[x[0], y[0]] for x, y in zip(_per_peer(o.to(q.dtype), _n(plan.q_in)),
                                              _per_peer(l_.float().transpose(1, 2), _n(plan.q_in)))]
        back = Transfer([(parts, _n(plan.ship), [((h, hv), q.dtype), ((h,), torch.float32)])], b, group,
                        plan.moves_q, dev)
        pieces = [(x.run.forward(q[:, x.r0:x.r1], kh[:, x.k0:x.k1], vh[:, x.k0:x.k1]), x) for x in plan.halo]
    acc = OutSum(q, plan.heavy, plan.out_pieces)
    if own is not None:
        acc.add(*own, 0, plan.own_at)
    side.join(_tensors([p[0] for p in pieces]) + [back.buf])
    for res, x in pieces:
        acc.add(*res, x.r0, x.at)
    for x in plan.few:  # after the join: the main stream has the halo keys
        acc.merge_in(x, q, kh, vh)
    # a row shipped to several peers (global tokens): where every peer took the same rows, their partials merge
    # at once; else peer by peer, each into the last merge's result (the gradients' index_add_ below takes every
    # peer's rows at once)
    o, l_ = back.wait()[0]
    if plan.ship_same:  # the same rows from c peers, in rank order: their partials merged in one pass
        c = sum(1 for x in plan.ship if len(x))
        pos = next(x for x in plan.heavy_pos if len(x))
        acc.add_rows(pos, *merge_stack(o.unflatten(1, (c, -1)).movedim(1, 0),
                                       l_.unflatten(1, (c, -1)).movedim(1, 0)))
    else:
        for pos, (o_p,), (l_p,) in zip(plan.heavy_pos, _per_peer(o, _n(plan.ship)),
                                       _per_peer(l_, _n(plan.ship))):
            acc.add_rows(pos, o_p, l_p)
    out, lse = acc.result()
    side.close()
    return out, lse, sent.buf


def _backward(dout, q, k, v, out, lse, buf, dlse, plan, group):
    """(dq, dk, dv) of the exchange over ``plan`` from its forward's out, lse
    and received bytes ``buf``."""
    layout = _layout(plan, q, k, v)
    b, dev = q.shape[0], q.device
    # no lse gradient (the usual case): None to this rank's own executors, so FA4 skips its dlse path (the
    # shipped rows' calls take the owner's, zeros or not: another rank may have one)
    has_dlse = dlse is not None
    dlse = dlse.float() if has_dlse else None
    stats = torch.stack([lse, dlse if has_dlse else torch.zeros_like(lse)], -1).transpose(1, 2)  # (B, L, H, 2)
    rows_out = Transfer([([[(dout, r), (out, r), (stats, r)] for r in plan.ship], _n(plan.q_in),
                          [_spec(dout), _spec(out), _spec(stats)])], b, group, plan.moves_q, dev)
    (kh, vh), (qs,) = unpack(buf, layout, b)  # before the side stream starts: its pieces read them
    side = Side(dev, plan.concurrent)
    own = None

    def own_grads():
        if plan.own is None:
            return None
        if plan.joined:  # (dq, dk, dv, the halo's dk, dv)
            return plan.own.backward(dout, q, kh, k, vh, v, out, lse, dlse)
        return plan.own.backward(dout, q, k, v, out, lse, dlse)

    def few_grads(dq_acc):
        """The few-keys pieces' (piece, dK, dV, dQ): dQ added into ``dq_acc`` (the own piece's, None: dQ of
        their own, a piece of the sum)."""
        res = []
        for x in plan.few:
            rows, keys = slice(x.r0, x.r1), slice(x.k0, x.k1)
            dq_x = torch.zeros_like(q[:, rows]) if dq_acc is None else dq_acc[:, rows]
            g = x.run.backward_into(dout[:, rows], q[:, rows], kh[:, keys], vh[:, keys], out[:, rows],
                                    lse[:, :, rows], None if dlse is None else dlse[:, :, rows], dq_x)
            res.append((x, *g, None if dq_acc is not None else dq_x))
        return res
    # first, beside the rest; serially last, while the gradients travel back (joined: first, its halo dK/dV
    # travel back)
    few = []
    if side.side is not None or plan.joined:
        own = own_grads()
        # the few-keys pieces add into the own piece's dQ: on this stream, after it
        few = few_grads(own[0] if own is not None else None)
    with side:
        if plan.few and not few:  # serially: before the transfer
            few = few_grads(None)
        halo_dq = [(g[3], g[0]) for g in few if g[3] is not None]  # dQ of their own: pieces of the sum
        whole = len(plan.halo) == 1 and not plan.few and (plan.halo[0].k0, plan.halo[0].k1) == (0, kh.shape[1])
        if plan.joined:
            gk, gv = own[3], own[4]
        elif not whole:  # halo keys no piece covers (none, where no halo piece runs) return zeros
            # pieces that share keys (a few-keys piece and the rows around it, a halo's rows apart before and
            # after those) add in float32, rounded once when packed
            shared = plan.few or _overlap([(x.k0, x.k1) for x in plan.halo])
            gk, gv = (torch.zeros_like(x, dtype=torch.float32 if shared else x.dtype) for x in (kh, vh))
        for x in plan.halo:
            rows, keys = slice(x.r0, x.r1), slice(x.k0, x.k1)
            dl = None if dlse is None else dlse[:, :, rows].contiguous()
            g = x.run.backward(dout[:, rows], q[:, rows], kh[:, keys], vh[:, keys], out[:, rows],
                               lse[:, :, rows].contiguous(), dl)
            halo_dq.append((g[0], x))
            if whole:
                gk, gv = g[1].to(k.dtype), g[2].to(v.dtype)
            else:
                gk[:, keys] += g[1]
                gv[:, keys] += g[2]
        do, o, st = rows_out.wait()[0]
        served = None
        if plan.serve is not None:
            ls, dls = (st[..., i].transpose(1, 2).contiguous() for i in range(2))
            g = plan.serve.backward(do, qs, k, v, o, ls, dls)
            served, dq_s = g[1:], g[0].to(q.dtype)
        else:
            dq_s = torch.zeros_like(qs)
        if (plan.joined or few) and side.side is not None:  # the halo's dK/dV made on the main stream
            side.side.wait_stream(side.main)
            for t in _tensors([g[1:3] for g in few]):
                t.record_stream(side.side)
        for x, fk, fv, _ in few:
            gk[:, x.k0:x.k1] += fk
            gv[:, x.k0:x.k1] += fv
        counts = _n(plan.halo_in)
        halo_grads = [[a[0], c[0]] for a, c in zip(_per_peer(gk, counts), _per_peer(gv, counts))]
        back = Transfer([(halo_grads, _n(plan.halo_send), [_spec(k), _spec(v)]),
                         (_per_peer(dq_s, _n(plan.q_in)), _n(plan.ship), [_spec(q)])],
                        b, group, plan.moves_kv or plan.moves_q, dev)
    if side.side is None and not plan.joined:
        own = own_grads()
    dq = GradSum(q, plan.heavy, plan.out_pieces)
    dk, dv = (GradSum(x, plan.sent, plan.kv_pieces) for x in (k, v))
    if own is not None:  # first: its outputs (made on this stream) become the sums
        dq.add(own[0], 0, plan.own_at)
        dk.add(own[1], 0, plan.kv_at)
        dv.add(own[2], 0, plan.kv_at)
    side.join(_tensors([x[0] for x in halo_dq]) + _tensors(served) + [back.buf])
    for g, x in halo_dq:
        dq.add(g, x.r0, x.at)
    if served is not None:
        dk.add(served[0], 0, plan.kv_at)
        dv.add(served[1], 0, plan.kv_at)
    (gk_, gv_), (g,) = back.wait()
    dk.add_rows(_cat0(plan.sent_pos), gk_)
    dv.add_rows(_cat0(plan.sent_pos), gv_)
    dq.add_rows(_cat0(plan.heavy_pos), g)
    res = dq.result(), dk.result(), dv.result()
    side.close()
    return res
