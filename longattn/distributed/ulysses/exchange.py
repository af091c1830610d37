"""Ulysses' all-to-all exchanges: the wire format, sequence <-> heads and
back (forward and transposed), as functions and as autograd Functions."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .. import checks
from .heads import HeadPlan


# ------------------------------------------------------------------ the all-to-alls
# Wire format: a flat buffer holding, for each rank j in order, a block
# (pieces, B, s/pieces, heads, D) of the sender's rows (pieces: 1 for a
# contiguous shard, 2 for zigzag's two chunks) and of the heads exchanged with
# j. The sender lays it out with one copy; the receiver's view of the whole
# sequence is then a view (one contiguous shard, batch 1) or one copy. Each
# tensor travels in its own all-to-all: packed together, the receiver's views
# of q, k and v would each need a copy, which costs more than two launches.
@dataclasses.dataclass(frozen=True)
class Exchange:
    """The all-to-all geometry of one Ulysses call on this rank: the call's
    plan, made once at the public call (the head groups from
    :class:`longattn.tuning.UlyssesTuning`) and kept by the autograd
    Function for its backward, with the local op (its backend resolved)."""

    group_name: str
    world: int
    rank: int
    heads: HeadPlan
    pieces: int = 1  # the local shard's pieces in sequence order: 1 contiguous, 2 zigzag
    chunks: int = 1  # head groups, pipelined (UlyssesTuning)

    @staticmethod
    def of(group, heads: HeadPlan, layout: str = "contiguous", chunks: int = 1) -> "Exchange":
        return Exchange(checks.group_name(group), dist.get_world_size(group), dist.get_rank(group), heads,
                        1 if layout == "contiguous" else 2, chunks)

    @property
    def q_ranges(self) -> list[tuple[int, int]]:
        return [self.heads.q_heads(j) for j in range(self.world)]

    @property
    def kv_ranges(self) -> list[tuple[int, int]]:
        return [self.heads.kv_heads(j) for j in range(self.world)]


def _split(ranges, world: int, total: int) -> bool:
    """Whether ``ranges`` cut ``total`` heads into equal consecutive blocks, one per rank."""
    w = total // world
    return total % world == 0 and all(r == (j * w, (j + 1) * w) for j, r in enumerate(ranges))


def _start(x: torch.Tensor, out_elems: list, in_elems: list, ex: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """Start the all-to-all of the flat ``x`` (elements per rank): a transfer
    (result, send buffer). The result may be read only after :func:`_wait`
    (eager: the GPU waits there, not the host)."""
    return torch.ops._c10d_functional.all_to_all_single(x, out_elems, in_elems, ex.group_name), x


def _wait(transfer: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The result of a started transfer. Callers drop the transfer right
    after, so that the send buffer is freed at the wait by the calling thread
    (NCCL's work releases its own reference there too; gloo's worker thread,
    were it the last holder, would free it later, unseen by the profiler's
    allocation events)."""
    return torch.ops._c10d_functional.wait_tensor(transfer[0])


def _pack(x: torch.Tensor, ranges, ex: Exchange, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """x (B, s, Hx, D): this rank's rows of every head -> the flat send buffer
    of head group ``chunk`` of ``chunks`` in the wire format, rank j's block
    holding the chunk-th of ``chunks`` equal parts of heads ``ranges[j]``. One
    copy where the ranges split the heads; one per rank where heads go to
    several ranks. One group at a time: a buffer lives only while its group travels."""
    b, s, hx, d = x.shape
    p, c = ex.world, ex.pieces
    if _split(ranges, p, hx):
        w = hx // p
        t = x.view(b, c, s // c, p, chunks, w // chunks, d)[:, :, :, :, chunk].permute(3, 1, 0, 2, 4, 5)
        return t.contiguous().view(-1)
    assert chunks == 1, "pipelined exchanges need heads split over the ranks"
    parts = [x[:, :, lo:hi].view(b, c, s // c, hi - lo, d).transpose(0, 1) for lo, hi in ranges]
    buf = x.new_empty(sum(t.numel() for t in parts))
    at = 0
    for t in parts:
        buf[at:at + t.numel()].view(t.shape).copy_(t)
        at += t.numel()
    return buf


def _to_full(recv: torch.Tensor, ex: Exchange, b: int, s: int, w: int, d: int) -> torch.Tensor:
    """Every rank's rows of w heads as received -> (B, p*s, w, D) in sequence
    order: a view of one contiguous shard per rank at batch 1, else one copy."""
    p, c = ex.world, ex.pieces
    t = recv.view(p, c, b, s // c, w, d)
    if c == 1:
        return t.view(b, p * s, w, d) if b == 1 else t[:, 0].transpose(0, 1).reshape(b, p * s, w, d)
    # cat, not advanced indexing: its output is contiguous in eager and traced alike
    return torch.cat([t[r, piece] for r, piece in _chunk_order("zigzag", p)], dim=1)


def _from_full(y: torch.Tensor, ex: Exchange, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """(B, R, w, D) in sequence order, any strides -> the flat send buffer of
    rank j's rows (R = p * s; or ``rows[j]`` each, consecutive, batch 1 and one
    piece: packed documents whose padding is not sent). No copy for one
    contiguous shard per rank at batch 1 and a contiguous y."""
    b, total, w, d = y.shape
    p, c = ex.world, ex.pieces
    if rows is not None:
        return y.contiguous().view(-1)
    if c == 1:
        return y.view(b, p, total // p, w, d).transpose(0, 1).contiguous().view(-1)
    t = y.view(b, 2 * p, total // (2 * p), w, d)
    return torch.stack([t[:, r if piece == 0 else 2 * p - 1 - r] for r in range(p) for piece in range(2)]).view(-1)


def _place(dst: torch.Tensor, recv: torch.Tensor, ranges, ex: Exchange, chunk: int = 0, chunks: int = 1) -> None:
    """Write what every rank i sent back (this rank's rows of heads
    ``ranges[i]``, group ``chunk``) into dst (B, s, H, D), any strides. Heads
    that several ranks send are summed: dst must then hold zeros."""
    b, s, h, d = dst.shape
    p, c = ex.world, ex.pieces
    if _split(ranges, p, h):
        w = h // p // chunks
        dst.view(b, c, s // c, p, chunks, w, d)[:, :, :, :, chunk].copy_(
            recv.view(p, c, b, s // c, w, d).permute(2, 1, 3, 0, 4, 5))
        return
    at = 0
    for lo, hi in ranges:
        n = b * s * (hi - lo) * d
        dst[:, :, lo:hi].view(b, c, s // c, hi - lo, d).add_(recv[at:at + n].view(c, b, s // c, hi - lo, d)
                                                              .transpose(0, 1))
        at += n


def _elems(ranges, per_head: int, chunks: int = 1) -> list[int]:
    return [(hi - lo) // chunks * per_head for lo, hi in ranges]


def _chunk_order(layout: str, world: int) -> list[tuple[int, int]]:
    """(rank, piece) holding each chunk of the sequence, in sequence order (layout.chunks)."""
    first = [(r, 0) for r in range(world)]
    return first if layout == "contiguous" else first + [(r, 1) for r in reversed(range(world))]


def _kv_index(ex: Exchange, device) -> Optional[torch.Tensor]:
    """The received kv head each local kv head copies (HeadPlan.local_kv_index), or None."""
    idx = ex.heads.local_kv_index(ex.rank)
    # non_blocking from a fresh pageable tensor: staged at once, no wait for the device
    return None if idx is None else torch.tensor(idx, dtype=torch.long, device="cpu").to(device, non_blocking=True)


def _start_group(tensors, ex: Exchange, chunk: int, chunks: int) -> list:
    """Start the inbound all-to-alls of head group ``chunk`` of (x (B, s, ., D),
    head ranges, width per group): one transfer per tensor."""
    started = []
    for x, rg, w in tensors:
        b, s, _, d = x.shape
        per = b * s * d
        started.append(_start(_pack(x, rg, ex, chunk, chunks), [per * w] * ex.world, _elems(rg, per, chunks), ex))
    return started


def _group_widths(ex: Exchange) -> tuple[int, int]:
    """Query and kv heads of one group on this rank."""
    (a, e), (lo, hi) = ex.heads.q_heads(ex.rank), ex.heads.kv_heads(ex.rank)
    return (e - a) // ex.chunks, (hi - lo) // ex.chunks


def _gather_heads(q, k, v, ex: Exchange):
    """seq_to_heads without autograd: (qf, kf, vf) on the whole sequence."""
    b, s, _, d = q.shape
    wq, wk = _group_widths(ex)
    started = _start_group([(q, ex.q_ranges, wq), (k, ex.kv_ranges, wk), (v, ex.kv_ranges, wk)], ex, 0, 1)
    qf, kf, vf = (_to_full(_wait(started.pop(0)), ex, b, s, w, d) for w in (wq, wk, wk))
    idx = _kv_index(ex, q.device)
    if idx is not None:
        kf, vf = kf.index_select(2, idx), vf.index_select(2, idx)
    return qf, kf, vf


def _kv_received(g: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """Gradient of the local kv heads -> of the received ones (the transpose of the expansion)."""
    idx = _kv_index(ex, g.device)
    if idx is None:
        return g
    lo, hi = ex.heads.kv_heads(ex.rank)
    return g.new_zeros(*g.shape[:2], hi - lo, g.shape[3]).index_add_(2, idx, g)


def _scatter_heads(grads, shapes, ex: Exchange):
    """The transpose of :func:`_gather_heads`: (dqf, dkf, dvf) -> (dq, dk, dv) on this rank's rows."""
    me, p = ex.rank, ex.world
    ranges = (ex.q_ranges, ex.kv_ranges, ex.kv_ranges)
    pending = []
    for i, (g, shape, rg) in enumerate(zip(grads, shapes, ranges)):
        b, s, h, d = shape
        g = _kv_received(g, ex) if i else g
        w = rg[me][1] - rg[me][0]
        pending.append(_start(_from_full(g, ex), _elems(rg, b * s * d), [b * s * w * d] * p, ex))
    res = []
    for shape, rg in zip(shapes, ranges):
        t = pending.pop(0)
        dst = t[0].new_empty(shape) if _split(rg, p, shape[2]) else t[0].new_zeros(shape)
        _place(dst, _wait(t), rg, ex)
        del t
        res.append(dst)
    return res


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ex):
        ctx.ex, ctx.shapes = ex, (q.shape, k.shape, v.shape)
        return _gather_heads(q, k, v, ex)

    @staticmethod
    @once_differentiable
    def backward(ctx, dq, dk, dv):
        return (*_scatter_heads((dq, dk, dv), ctx.shapes, ctx.ex), None)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ex):
        b, total, h, d = x.shape
        p = ex.world
        ctx.ex, ctx.shape = ex, x.shape
        t = _start(_from_full(x, ex), [b * (total // p) * h * d] * p, [b * (total // p) * h * d] * p, ex)
        ranges = [(j * h, (j + 1) * h) for j in range(p)]
        out = x.new_empty(b, total // p, p * h, d)
        _place(out, _wait(t), ranges, ex)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        ex = ctx.ex
        b, total, h, d = ctx.shape
        s, p = total // ex.world, ex.world
        ranges = [(j * h, (j + 1) * h) for j in range(p)]
        t = _start(_pack(dout, ranges, ex), [b * s * h * d] * p, [b * s * h * d] * p, ex)
        return _to_full(_wait(t), ex, b, s, h, d), None


def seq_to_heads(q, k, v, heads: HeadPlan, layout: str, group):
    """This rank's shards (B, s, H, D), (B, s, Hkv, D) -> the whole sequence
    (B, p*s, ., D) in sequence order for the heads this rank attends with.
    Differentiable (the backward is the transposed exchange; gradients of kv
    heads sent to several ranks are summed)."""
    if dist.get_world_size(group) == 1:
        return q, k, v
    return _SeqToHeads.apply(q, k, v, Exchange.of(group, heads, layout))


def heads_to_seq(x: torch.Tensor, layout: str, group) -> torch.Tensor:
    """(B, p*s, h, D) of this rank's heads over the whole sequence -> (B, s, p*h, D):
    this rank's shard (in ``layout``) of every rank's heads."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    return _HeadsToSeq.apply(x, Exchange.of(group, HeadPlan(world * x.shape[2], world * x.shape[2], world), layout))


def lse_to_seq(lse: torch.Tensor, layout: str, group) -> torch.Tensor:
    """(B, h, p*s) float32 -> (B, p*h, s), as :func:`heads_to_seq`."""
    out = heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), layout, group)
    return out.squeeze(-1).transpose(1, 2).contiguous()
