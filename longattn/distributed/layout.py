"""How a global sequence is split over ranks, and the helpers that do it.

* ``contiguous``: the sequence cut into p equal chunks; rank r holds chunk r.
* ``zigzag``: the sequence cut into 2p equal chunks; rank r holds chunks r
  and 2p-1-r (in that order), which gives every rank the same causal work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import resolve_group

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose 'contiguous' or 'zigzag'")


def chunks(layout: str, rank: int, world: int, local_len: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of each piece a rank holds."""
    if layout == "contiguous":
        return [(rank * local_len, 0, local_len)]
    c = local_len // 2
    return [(rank * c, 0, c), ((2 * world - 1 - rank) * c, c, c)]


def _parts(seqlen: int, layout: str, world: int) -> int:
    n = world if layout == "contiguous" else 2 * world
    if seqlen % n:
        raise ValueError(f"seqlen {seqlen} must be divisible by {n} for layout={layout!r} over {world} ranks; "
                         f"pad the sequence (or use attention_varlen / shard_varlen for ragged lengths)")
    return n


def local_positions(seqlen: int, layout: str, rank: int, world: int, device=None) -> torch.Tensor:
    _parts(seqlen, layout, world)
    local = seqlen // world
    return torch.cat([torch.arange(g, g + n, device=device) for g, _, n in chunks(layout, rank, world, local)])


def shard_positions(seqlen: int, *, layout: str = "contiguous", group=None, device=None) -> torch.Tensor:
    """Global position ids of this rank's shard (int64, ``(seqlen // world,)``):
    use them for RoPE so rotated q/k match the unsharded sequence."""
    check_layout(layout)
    g = resolve_group(group)
    return local_positions(seqlen, layout, dist.get_rank(g), dist.get_world_size(g), device)


def shard(x: torch.Tensor, *, layout: str = "contiguous", group=None, seq_dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor present on every rank (a copy)."""
    check_layout(layout)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    g = resolve_group(group)
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    n = _parts(x.shape[seq_dim], layout, world)
    pieces = x.chunk(n, dim=seq_dim)
    if layout == "contiguous":
        # clone: with batch 1 the slice is already contiguous, and a view would keep the full tensor alive
        return pieces[rank].clone(memory_format=torch.contiguous_format)
    return torch.cat([pieces[rank], pieces[2 * world - 1 - rank]], dim=seq_dim).contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        world = dist.get_world_size(group)
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out, dim=seq_dim)

    @staticmethod
    def backward(ctx, grad):
        # Each rank's loss may use the whole gathered tensor: the gradient of
        # a shard is the sum over ranks of their gradients at its rows.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=ctx.seq_dim)[rank], None, None


def unshard(x_local: torch.Tensor, *, layout: str = "contiguous", group=None, seq_dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (differentiable: the gradient
    of a shard is the sum over ranks of the gradients at its rows)."""
    check_layout(layout)
    g = resolve_group(group)
    world = dist.get_world_size(g)
    full = _AllGather.apply(x_local, g, seq_dim)
    if layout == "contiguous":
        return full
    pieces = full.chunk(2 * world, dim=seq_dim)  # rank r contributed pieces 2r (chunk r), 2r+1 (chunk 2p-1-r)
    order = [None] * (2 * world)
    for r in range(world):
        order[r] = pieces[2 * r]
        order[2 * world - 1 - r] = pieces[2 * r + 1]
    return torch.cat(order, dim=seq_dim)
