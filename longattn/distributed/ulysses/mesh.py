"""Where the tokens of a Ulysses or hybrid call live: packed documents'
rows, and the Ulysses x ring hybrid's layout over a 2-D mesh."""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from .. import checks
from ..layout import check_layout, shard, unshard
from ..plan import local_length
from ..varlen_layout import VarlenShard, global_index, shard_varlen, unshard_varlen

MESH_DIMS = ("ulysses", "ring")


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
        return (checks.resolve_group(mesh[0], what="mesh[0] (the ulysses dim)"),
                checks.resolve_group(mesh[1], what="mesh[1] (the ring dim)"))
    raise TypeError(f"mesh must be a 2-D DeviceMesh (dims named 'ulysses' and 'ring') or a pair (ulysses, ring) "
                    f"of ProcessGroups / 1-D DeviceMeshes, got {type(mesh).__name__}")


# ------------------------------------------------------------------ packed documents
@functools.lru_cache(maxsize=64)
def packed_rows(cu: tuple, layout: str, world: int, device: torch.device) -> torch.Tensor:
    """Row of each packed token in the concatenation of every rank's shard
    (``shard_varlen(layout)``), on ``device``."""
    gidx = torch.cat([global_index(cu, layout, world, r) for r in range(world)])
    rows = torch.empty(cu[-1], dtype=torch.long, device="cpu")
    keep = gidx >= 0
    rows[gidx[keep]] = torch.arange(gidx.numel(), device="cpu")[keep]
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
