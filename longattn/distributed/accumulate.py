"""Accumulators of the ring: partial results over row ranges of a local shard.

A ring step contributes to some rows (a query chunk, a key block); buffers
are allocated with ``torch.empty`` and the first piece a row receives is
copied, not added, so no buffer needs a zero-fill pass. Rows merged or summed
at most twice keep the input dtype (the one merge or add runs in float32
arithmetic and rounds once, as a float32 accumulator's final cast would);
more pieces accumulate in float32.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .._merge import empty_state, merge_into


def gaps(written: Sequence[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Sub-ranges of rows [a, b) that no range in ``written`` covers."""
    out, pos = [], a
    for lo, hi in sorted(written):
        if hi <= pos or lo >= b:
            continue
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < b:
        out.append((pos, b))
    return out


def max_cover(plans) -> int:
    """Most pieces any query row receives over a list of per-step call lists."""
    return most_cover([(c.q0, c.q1) for calls in plans for c in calls])


def most_cover(spans) -> int:
    """Most of the row ranges ``spans`` ([a, b)) covering one row."""
    ev = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = depth = 0
    for _, d in ev:  # at equal positions ends (-1) sort before starts
        depth += d
        most = max(most, depth)
    return most


class RowSums:
    """A (B, L, ...) sum of pieces over row ranges ``[a, b)`` of dim 1.

    ``written`` are the ranges that already hold a sum; rows outside them
    count as 0 (they are zeroed only when read)."""

    def __init__(self, buf: torch.Tensor, written: Sequence[tuple[int, int]] = ()):
        self.buf, self.written = buf, list(written)

    @staticmethod
    def empty(like: torch.Tensor, dtype: torch.dtype) -> "RowSums":
        return RowSums(torch.empty(like.shape, dtype=dtype, device=like.device))

    def add(self, a: int, b: int, x: torch.Tensor) -> None:
        """buf[:, a:b] += x (rows no earlier piece wrote are copied)."""
        holes = gaps(self.written, a, b)
        if holes == [(a, b)]:
            self.buf[:, a:b] = x
        else:
            for lo, hi in holes:
                self.buf[:, lo:hi] = 0
            self.buf[:, a:b] += x
        self.written.append((a, b))

    def zero_unwritten(self) -> torch.Tensor:
        for lo, hi in gaps(self.written, 0, self.buf.shape[1]):
            self.buf[:, lo:hi] = 0
        return self.buf

    def result(self, dtype: torch.dtype, last: Sequence[tuple[int, int, torch.Tensor]] = ()) -> torch.Tensor:
        """The sum in ``dtype`` with the pieces ``last = [(a, b, x)]`` added. A
        piece over rows that already hold sums and that no other piece
        overlaps is added in the cast's pass (float32 arithmetic, one
        rounding); the others are accumulated first."""
        alone = [(a, b, x) for i, (a, b, x) in enumerate(last)
                 if not gaps(self.written, a, b)
                 and all(b <= a2 or b2 <= a for j, (a2, b2, _) in enumerate(last) if j != i)]
        for a, b, x in last:
            if all(x is not y for _, _, y in alone):
                self.add(a, b, x)
        acc = self.zero_unwritten()
        if not alone:
            return acc.to(dtype)
        res = torch.empty(acc.shape, dtype=dtype, device=acc.device)
        for a, b, x in alone:
            torch.add(acc[:, a:b], x, out=res[:, a:b])
        for lo, hi in gaps([(a, b) for a, b, _ in alone], 0, acc.shape[1]):
            res[:, lo:hi] = acc[:, lo:hi]
        return res


class MergedRows:
    """The running (out, lse) of a ring forward: partial results of row ranges
    merged by lse (float32 arithmetic), in ``dtype`` (see the module docstring)."""

    def __init__(self, q: torch.Tensor, dtype: torch.dtype):
        self.q, self.dtype = q, dtype
        self.triton = q.is_cuda  # one fused merge pass per block; CPU keeps torch's (the interpreter is slow)
        self.out = self.lse = None
        self.written: list = []

    def add(self, q0: int, q1: int, ob: torch.Tensor, lb: torch.Tensor) -> None:
        if self.out is None and (q0, q1) == (0, self.q.shape[1]):
            # the first block covers every row: it becomes the accumulator (no zero-fill, no copy where the
            # dtype agrees)
            self.out, self.lse = ob.to(self.dtype), lb.contiguous()
            self.written.append((q0, q1))
            return
        if self.out is None:
            self.out, self.lse = empty_state(self.q, self.dtype)
        if any(w0 < q1 and q0 < w1 for w0, w1 in self.written):
            # rows of [q0, q1) no block wrote yet hold the empty state (0, -inf): merged, they take this block's
            merge_into(self.out[:, q0:q1], self.lse[:, :, q0:q1].transpose(1, 2), ob, lb.transpose(1, 2),
                       use_triton=self.triton)
        else:  # first result for these rows: a copy, not a merge with the empty state
            self.out[:, q0:q1] = ob
            self.lse[:, :, q0:q1] = lb
        self.written.append((q0, q1))  # a later block over any of these rows merges, never copies over them

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:  # no block had a visible key: every row is empty
            return empty_state(self.q, self.q.dtype)
        return self.out.to(self.q.dtype), self.lse


def disjoint(grads: list) -> bool:
    """Pieces (k0, k1, dK, dV) over distinct key rows, one dtype: they assemble without arithmetic."""
    spans = sorted((k0, k1) for k0, k1, _, _ in grads)
    return (all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            and len({g[i].dtype for g in grads for i in (2, 3)}) <= 1)


def assemble(grads: list, i: int, like: torch.Tensor) -> torch.Tensor:
    """The pieces ``grads[*][i]`` (key-disjoint) as one tensor shaped like
    ``like``, in their own dtype: no arithmetic, so nothing is rounded."""
    pieces = [(g[0], g[1], g[i]) for g in grads]
    if len(pieces) == 1 and pieces[0][:2] == (0, like.shape[1]):
        return pieces[0][2]
    res = torch.empty(like.shape, dtype=pieces[0][2].dtype if pieces else like.dtype, device=like.device)
    for k0, k1, x in pieces:
        res[:, k0:k1] = x
    return RowSums(res, [(k0, k1) for k0, k1, _ in pieces]).zero_unwritten()


def kv_sums(k: torch.Tensor, v: torch.Tensor, grads: list, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (dK, dV) sums of pieces (k0, k1, dK, dV): new ones (rows no
    piece covers are 0), or the ``sums`` (every row valid) that arrived from
    another rank, added to."""
    if sums is None:
        dk, dv = RowSums.empty(k, torch.float32), RowSums.empty(v, torch.float32)
    else:
        dk, dv = (RowSums(x, [(0, x.shape[1])]) for x in sums)
    for k0, k1, dkb, dvb in grads:
        dk.add(k0, k1, dkb)
        dv.add(k0, k1, dvb)
    return dk.zero_unwritten(), dv.zero_unwritten()


def home(incoming: torch.Tensor, own: list, i: int, dtype: torch.dtype) -> torch.Tensor:
    """The owner's final dK (i=2) or dV (i=3) in ``dtype``: what came round the
    ring (float32 sums, or one contributor's pieces in the input dtype) plus
    its own pieces. Key-disjoint own pieces are added in the pass that writes
    the result (float32 arithmetic, one rounding); otherwise the incoming
    tensor is widened to float32 first, so no partial sum is rounded."""
    if incoming.dtype != torch.float32 and not disjoint(own):
        incoming = incoming.float()
    return RowSums(incoming, [(0, incoming.shape[1])]).result(dtype, [(g[0], g[1], g[i]) for g in own])
