"""Ulysses head parallelism (the all-to-all of DeepSpeed-Ulysses) and the
layout of the Ulysses x ring hybrid over a 2-D mesh.

Ulysses: every rank holds a shard of the sequence with every head. One
all-to-all gives each rank the whole sequence (every rank's shard, put back in
sequence order) for nheads/p query heads and the kv heads they read; the local
attention runs on that; a second all-to-all returns each rank its shard of the
output for every head. Each all-to-all moves (p-1)/p of the local q (or out)
and k/v per rank, whatever p is; the backward is the same exchanges
transposed, so gradients go back the way the inputs came.

Per tensor and pass: one copy lays the send buffer out (rank j's block of
its heads contiguous), one all-to-all (PyTorch's functional collective, so
``torch.compile`` traces it), and on the receiving side a view of the whole
sequence (one contiguous shard per rank, batch 1) or one copy; the outputs
go back into their heads with one copy. The backward is written out (an
autograd Function), not derived by autograd through views, which would
zero-fill and sum a full-size buffer per slice. :func:`ulysses` pipelines a
call over groups of heads (:class:`longattn.tuning.UlyssesTuning`): group c's attention runs
while group c+1's inputs and group c-1's outputs travel, never more groups
at once, and every buffer goes as soon as it has served (send buffers at
their wait, received inputs once the local call has them or saved them,
received outputs once in place): what lives through the backward is what
the local call saves, the head-split inputs and its out and lse.

GQA/MQA (:class:`HeadPlan`): rank r attends with query heads [r m, (r+1) m),
m = nheads/p, and receives exactly the kv heads those read (kv head of query
head h: h // (nheads/nheads_kv)): nheads_kv/p each when p divides nheads_kv;
one each when nheads_kv divides p (a kv head goes to the p/nheads_kv ranks
that read it); otherwise a kv head read by two ranks' query heads goes to both.
Where the received kv heads do not serve the local query heads as plain GQA
(the last case), they are expanded locally after the exchange, never before.

The hybrid over a mesh of u (ulysses) x r (ring) ranks: the sequence is split
by the ring layout over the r ring ranks (:mod:`longattn.distributed.layout`),
and each ring shard cut into u contiguous pieces over its ulysses group. The
all-to-all inside the ulysses group rebuilds the ring shard for nheads/u
heads, the ring runs across the ring group, and the all-to-all returns the
pieces. Packed documents likewise: the ring shard of ``shard_varlen``, padded
at its end to a multiple of u, cut into u pieces.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import checks
from .layout import check_layout, shard, unshard
from .plan import local_length
from .varlen_layout import VarlenShard, global_index, shard_varlen, unshard_varlen

MESH_DIMS = ("ulysses", "ring")


# ------------------------------------------------------------------ groups and meshes
def as_group(group, what: str = "group") -> dist.ProcessGroup:
    """A ProcessGroup from None (WORLD), a ProcessGroup or a 1-D DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise TypeError(f"{what}: a {group.ndim}-D DeviceMesh where one dimension is needed; pass one dim "
                            f"(e.g. mesh['ulysses']) or use context_parallel_attention(..., mesh=mesh) for the "
                            f"Ulysses x ring hybrid")
        return group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what} must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")
    return checks.resolve_group(group)


def mesh_groups(mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ulysses group, ring group) of ``mesh``: a 2-D DeviceMesh whose
    mesh_dim_names are "ulysses" and "ring" (either order), or a pair
    (ulysses, ring) of ProcessGroups / 1-D DeviceMeshes."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or sorted(names) != sorted(MESH_DIMS):
            raise ValueError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names 'ulysses' and 'ring', got "
                             f"{mesh.ndim}-D with names {names}; e.g. init_device_mesh('cuda', (nodes, "
                             f"gpus_per_node), mesh_dim_names=('ring', 'ulysses')) (Ulysses inside a node)")
        return mesh.get_group("ulysses"), mesh.get_group("ring")
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2:
        return as_group(mesh[0], "mesh[0] (the ulysses dim)"), as_group(mesh[1], "mesh[1] (the ring dim)")
    raise TypeError(f"mesh must be a 2-D DeviceMesh (dims named 'ulysses' and 'ring') or a pair (ulysses, ring) "
                    f"of ProcessGroups / 1-D DeviceMeshes, got {type(mesh).__name__}")


def check_consistent_mesh(ulysses_group, ring_group, what: str, **fields) -> None:
    """``checks.check_consistent`` over a mesh: every rank raises when any
    rank's fields differ. A group that raised would leave the other ulysses
    groups waiting in the ring group's check, so the ulysses verdict is one of
    the ring check's fields: a row that disagrees inside makes every ring
    group it meets disagree, and rows that differ from each other do too."""
    err = None
    try:
        checks.check_consistent(ulysses_group, what, **fields)
    except ValueError as e:
        err = e
    checks.check_consistent(ring_group, what, ulysses_dim_agrees=err is None, **fields)
    if err is not None:
        raise err


# ------------------------------------------------------------------ heads
def check_heads(nheads: int, world: int, what: str) -> None:
    if nheads % world:
        fits = [d for d in range(1, world + 1) if nheads % d == 0]
        raise ValueError(f"nheads ({nheads}) must be divisible by the size of {what} ({world}): each rank "
                         f"attends with nheads/size heads. Use a Ulysses size that divides nheads ({fits}), "
                         f"e.g. a mesh with that many ulysses ranks and the ring over the rest "
                         f"(context_parallel_attention), or ring_attention")


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The heads each of ``world`` ranks attends with after the all-to-all."""

    nheads: int
    nheads_kv: int
    world: int

    def q_heads(self, rank: int) -> tuple[int, int]:
        m = self.nheads // self.world
        return rank * m, (rank + 1) * m

    def kv_heads(self, rank: int) -> tuple[int, int]:
        """[lo, hi): the kv heads rank's query heads read (what it receives)."""
        g = self.nheads // self.nheads_kv
        a, b = self.q_heads(rank)
        return a // g, (b - 1) // g + 1

    @property
    def splits_kv(self) -> bool:
        """Whether the kv heads split over the ranks (each read by one rank only)."""
        return self.nheads_kv % self.world == 0

    def local_kv_index(self, rank: int) -> Optional[tuple[int, ...]]:
        """None when the received kv heads serve the local query heads as
        plain GQA; else, for each kv head of the local call, the received head
        it copies (groups of gcd(g, m) query heads, all reading one kv head)."""
        g, (a, b), (lo, hi) = self.nheads // self.nheads_kv, self.q_heads(rank), self.kv_heads(rank)
        m, n = b - a, hi - lo
        if m % n == 0 and all((a + i) // g - lo == i // (m // n) for i in range(m)):
            return None
        step = math.gcd(g, m)
        return tuple((a + t * step) // g - lo for t in range(m // step))




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
    """The all-to-all geometry of one Ulysses call on this rank."""

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
    return None if idx is None else torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)


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


# ------------------------------------------------------------------ the pipelined call
class Local:
    """What :func:`ulysses` runs on the whole sequence of a group of heads
    (the single-device kernel and the layout around it). Tensors are
    (B, S, heads, D) in the exchange's row order (every rank's rows
    concatenated); lse (B, heads, S) float32.

    ``send_rows``: rows of the outputs sent to each rank (None: S / p each);
    ``recv_rows``: rows received from each rank (this rank's rows that hold
    tokens; the rest are padding, filled with 0 and lse -inf)."""

    send_rows: Optional[Sequence[int]] = None
    recv_rows: Optional[int] = None

    def forward(self, q, k, v):
        """-> (out, lse, saved): out (B, R, h, D) and lse (B, h, R) in the rows
        ``send_rows`` says; ``saved`` the tensors backward needs."""
        raise NotImplementedError

    def backward(self, dout, dlse, saved):
        """dout (B, S, h, D), dlse (B, h, S) or None -> (dq, dk, dv) like forward's out."""
        raise NotImplementedError


def _start_back(y, ranges, ex: Exchange, local: "Local", b: int, s: int, rows: int, d: int):
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
    def forward(ctx, q, k, v, ex: Exchange, local: Local, return_lse: bool):
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
            o, lse, keep = local.forward(qf, kf, vf)
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
            g = list(local.backward(do, dl, saved[c * per:(c + 1) * per]))
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


def ulysses(q, k, v, ex: Exchange, local: Local, return_lse: bool):
    """Ulysses attention of this rank's shards q (B, s, H, D), k, v (B, s, Hkv, D)
    with ``local`` on the whole sequence, pipelined over ``ex.chunks`` head
    groups; returns out (B, s, H, D) (and lse (B, H, s)), this rank's rows."""
    return _Ulysses.apply(q, k, v, ex, local, return_lse)


# ------------------------------------------------------------------ packed documents
@functools.lru_cache(maxsize=64)
def packed_rows(cu: tuple, layout: str, world: int, device: torch.device) -> torch.Tensor:
    """Row of each packed token in the concatenation of every rank's shard
    (``shard_varlen(layout)``), on ``device``."""
    gidx = torch.cat([global_index(cu, layout, world, r) for r in range(world)])
    rows = torch.empty(cu[-1], dtype=torch.long)
    keep = gidx >= 0
    rows[gidx[keep]] = torch.arange(gidx.numel())[keep]
    # non_blocking from a fresh pageable tensor: staged at once, no wait for the device's queue
    return rows.to(device, non_blocking=True)


def pad_rows(x: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), fill)])


# ------------------------------------------------------------------ the hybrid's layout
def _sizes(mesh):
    ug, rg = mesh_groups(mesh)
    return ug, rg, dist.get_world_size(ug), dist.get_world_size(rg)


def shard_for_mesh(x: torch.Tensor, mesh, *, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """This rank's shard for :func:`longattn.context_parallel_attention`: the
    ring shard (``layout`` over the ring dim), cut into contiguous pieces over
    the ulysses dim. A copy of a full tensor present on every rank."""
    check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    ug, rg, u, r = _sizes(mesh)
    parts = u * r * (2 if layout == "zigzag" else 1)
    if x.shape[seq_dim] % parts:
        raise ValueError(f"seqlen {x.shape[seq_dim]} must be divisible by {parts} for layout={layout!r} over a "
                         f"{u} (ulysses) x {r} (ring) mesh; pad the sequence (or use the varlen form)")
    return shard(shard(x, layout=layout, group=rg, seq_dim=seq_dim), layout="contiguous", group=ug, seq_dim=seq_dim)


def unshard_for_mesh(x_local: torch.Tensor, mesh, *, layout: str = "zigzag", seq_dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's :func:`shard_for_mesh` shard
    (differentiable: a shard's gradient is the sum over ranks)."""
    check_layout(layout)
    ug, rg, _, _ = _sizes(mesh)
    ring_shard = unshard(x_local, layout="contiguous", group=ug, seq_dim=seq_dim)
    return unshard(ring_shard, layout=layout, group=rg, seq_dim=seq_dim)


def shard_positions_for_mesh(seqlen: int, mesh, *, layout: str = "zigzag", device=None) -> torch.Tensor:
    """Global position ids (int64) of this rank's :func:`shard_for_mesh` rows (for RoPE)."""
    return shard_for_mesh(torch.arange(seqlen, device=device), mesh, layout=layout, seq_dim=0)


def mesh_varlen_length(cu: Sequence[int], layout: str, u: int, r: int) -> int:
    """Local tokens per rank: the ring shard padded to a multiple of u, over u."""
    return -(-local_length(cu, layout, r) // u)


def shard_varlen_for_mesh(x: torch.Tensor, cu_seqlens: torch.Tensor, mesh, *, layout: str = "zigzag"):
    """This rank's tokens of a packed ``x`` (total_tokens, ...) for
    :func:`longattn.context_parallel_attention_varlen`, and their
    :class:`VarlenShard` (``world`` and ``rank`` count the u*r pieces in
    sequence order: rank = ring rank * u + ulysses rank; padding rows hold 0,
    global index -1, position 0)."""
    ug, rg, u, r = _sizes(mesh)
    ring_local, meta = shard_varlen(x, cu_seqlens, layout=layout, group=rg)
    n = mesh_varlen_length(cu_seqlens.tolist(), layout, u, r)
    ui, ri = dist.get_rank(ug), dist.get_rank(rg)
    piece = slice(ui * n, (ui + 1) * n)
    gidx = pad_rows(meta.global_index, u * n, -1)[piece]
    pos = pad_rows(meta.position_ids, u * n)[piece]
    return pad_rows(ring_local, u * n)[piece].clone(), VarlenShard(layout, u * r, ri * u + ui, n, gidx, pos)


def unshard_varlen_for_mesh(x_local: torch.Tensor, cu_seqlens: torch.Tensor, mesh, *, layout: str = "zigzag"):
    """The packed (total_tokens, ...) tensor from every rank's
    :func:`shard_varlen_for_mesh` shard (differentiable)."""
    ug, rg, _, r = _sizes(mesh)
    ring_local = unshard(x_local, layout="contiguous", group=ug, seq_dim=0)
    ring_local = ring_local[:local_length(cu_seqlens.tolist(), layout, r)]
    return unshard_varlen(ring_local, cu_seqlens, layout=layout, group=rg)
