"""Ulysses head parallelism (the all-to-all of DeepSpeed-Ulysses) and the
layout of the Ulysses x ring hybrid over a 2-D mesh.

Ulysses: every rank holds a shard of the sequence with every head. One
all-to-all gives each rank the whole sequence (every rank's shard, put back in
sequence order) for nheads/p query heads and the kv heads they read; the local
attention runs on that; a second all-to-all returns each rank its shard of the
output for every head. Each all-to-all moves (p-1)/p of the local q (or out)
and k/v per rank, whatever p is; the backward is the same exchanges transposed
(autograd of ``all_to_all_single_autograd``), so gradients go back the way the
inputs came. Query, key and value travel in one exchange.

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
def _a2a(x: torch.Tensor, out_rows, in_rows, group) -> torch.Tensor:
    from torch.distributed._functional_collectives import (AsyncCollectiveTensor, all_to_all_single_autograd,
                                                           wait_tensor)

    out = all_to_all_single_autograd(x, out_rows, in_rows, group)
    # Eager gives an AsyncCollectiveTensor that waits at its first use that is not a view: a result that
    # is a view of it would leave the op unwaited (its stream not joined), so wait here. Traced, it is waited.
    return wait_tensor(out) if isinstance(out, AsyncCollectiveTensor) else out


def _chunk_order(layout: str, world: int) -> list[tuple[int, int]]:
    """(rank, piece) holding each chunk of the sequence, in sequence order (layout.chunks)."""
    first = [(r, 0) for r in range(world)]
    return first if layout == "contiguous" else first + [(r, 1) for r in reversed(range(world))]


def _to_sequence(x: torch.Tensor, layout: str) -> torch.Tensor:
    """(p, h, B, s, D): rank i's shard in x[i] -> (B, p*s, h, D) in sequence order."""
    p, h, b, s, d = x.shape
    c = 1 if layout == "contiguous" else 2
    # view, not unflatten: dynamo cannot trace Tensor.unflatten under a torch-function mode (set_default_device)
    t = x.view(p, h, b, c, s // c, d).permute(2, 0, 3, 4, 1, 5)  # (B, p, c, s/c, h, D)
    if layout == "contiguous":
        return t.reshape(b, p * s, h, d)
    # cat, not advanced indexing: its output is contiguous in eager and traced alike
    return torch.cat([t[:, src, piece] for src, piece in _chunk_order(layout, p)], dim=1).view(b, p * s, h, d)


def seq_to_heads(q, k, v, heads: HeadPlan, layout: str, group):
    """This rank's shards (B, s, H, D), (B, s, Hkv, D) -> the whole sequence
    (B, p*s, ., D) in sequence order for the heads this rank attends with."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return q, k, v
    b, s, _, d = q.shape
    ranges = [[heads.q_heads(j) for j in range(world)], [heads.kv_heads(j) for j in range(world)]]
    ranges.append(ranges[1])
    by_head = [x.permute(2, 0, 1, 3) for x in (q, k, v)]  # (heads, B, s, D) views: a head range is a block
    send = torch.cat([x[rg[j][0]:rg[j][1]] for j in range(world) for x, rg in zip(by_head, ranges)])
    rows = [sum(rg[j][1] - rg[j][0] for rg in ranges) for j in range(world)]
    even = len(set(rows)) == 1
    recv = _a2a(send, None if even else [rows[rank]] * world, None if even else rows, group)
    recv = recv.view(world, rows[rank], b, s, d)
    outs, at = [], 0
    for rg in ranges:
        n = rg[rank][1] - rg[rank][0]
        outs.append(_to_sequence(recv[:, at:at + n], layout))
        at += n
    qf, kf, vf = outs
    idx = heads.local_kv_index(rank)
    if idx is not None:
        sel = torch.tensor(idx, device=q.device)
        kf, vf = kf.index_select(2, sel), vf.index_select(2, sel)
    return qf, kf, vf


def heads_to_seq(x: torch.Tensor, layout: str, group) -> torch.Tensor:
    """(B, p*s, h, D) of this rank's heads over the whole sequence -> (B, s, p*h, D):
    this rank's shard (in ``layout``) of every rank's heads."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    b, total, h, d = x.shape
    c, s = (1 if layout == "contiguous" else 2), total // world
    t = x.view(b, world * c, s // c, h, d).permute(1, 3, 0, 2, 4)  # (chunks, h, B, s/c, D)
    if layout == "contiguous":
        send = t.contiguous()
    else:  # rank j's pieces, in its local order: chunks j and 2p-1-j
        send = torch.stack([t[j if piece == 0 else 2 * world - 1 - j] for j in range(world) for piece in range(c)])
    recv = _a2a(send, None, None, group).view(world, c, h, b, s // c, d)
    return recv.permute(3, 1, 4, 0, 2, 5).reshape(b, s, world * h, d)


def lse_to_seq(lse: torch.Tensor, layout: str, group) -> torch.Tensor:
    """(B, h, p*s) float32 -> (B, p*h, s), as :func:`heads_to_seq`."""
    out = heads_to_seq(lse.transpose(1, 2).unsqueeze(-1), layout, group)
    return out.squeeze(-1).transpose(1, 2).contiguous()


# ------------------------------------------------------------------ packed documents
@functools.lru_cache(maxsize=64)
def _packed_rows(cu: tuple, layout: str, world: int, device: str) -> torch.Tensor:
    """Row of each packed token in the concatenation of every rank's shard."""
    gidx = torch.cat([global_index(cu, layout, world, r) for r in range(world)])
    rows = torch.empty(cu[-1], dtype=torch.long)
    keep = gidx >= 0
    rows[gidx[keep]] = torch.arange(gidx.numel())[keep]
    return rows.to(device)


def to_packed(x: torch.Tensor, cu: tuple, layout: str, world: int) -> torch.Tensor:
    """(p*L, ...): every rank's shard of ``shard_varlen(layout)``, concatenated ->
    the packed tokens (total, ...)."""
    if layout == "contiguous":  # the packed stream, padded at its end
        return x[:cu[-1]]
    return x.index_select(0, _packed_rows(cu, layout, world, str(x.device)))


def from_packed(y: torch.Tensor, cu: tuple, layout: str, world: int, fill: float) -> torch.Tensor:
    """Inverse of :func:`to_packed`; padding rows hold ``fill``."""
    rows = world * local_length(cu, layout, world)
    if layout == "contiguous":
        return torch.cat([y, y.new_full((rows - y.shape[0], *y.shape[1:]), fill)])
    return y.new_full((rows, *y.shape[1:]), fill).index_copy(0, _packed_rows(cu, layout, world, str(y.device)), y)


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
