"""Packed variable-length documents sharded over ranks: the layouts and the
helpers that shard and unshard a packed stream.

* ``"zigzag"``: every document is padded to a multiple of 2p and cut into 2p
  chunks; rank r holds chunks r and 2p-1-r of every document (balanced causal
  work per document). Padding is never a key and its query rows are dropped
  by ``unshard_varlen``.
* ``"contiguous"``: the packed stream (padded at the end to a multiple of p)
  cut into p equal parts; documents may straddle ranks.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .._validation import check_cu_seqlens
from .checks import resolve_group
from .layout import check_layout
from .plan import pieces


def global_index(cu: tuple, layout: str, world: int, rank: int) -> torch.Tensor:
    """Global packed index of each local token, -1 for padding."""
    parts, length = pieces(cu, layout, world, rank)
    idx = torch.full((length,), -1, dtype=torch.long, device="cpu")
    for d, g, l0, n, valid in parts:
        idx[l0:l0 + valid] = cu[d] + g + torch.arange(valid, device="cpu")
    return idx


@dataclasses.dataclass(frozen=True)
class VarlenShard:
    """Metadata of a rank's varlen shard."""

    layout: str
    world: int
    rank: int
    local_tokens: int
    global_index: torch.Tensor
    """(local_tokens,) int64: global packed position of each local token, -1 for padding."""
    position_ids: torch.Tensor
    """(local_tokens,) int64: position of each local token inside its document (0 for padding), for RoPE."""

    @property
    def valid(self) -> torch.Tensor:
        return self.global_index >= 0


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str = "zigzag", group=None):
    """This rank's tokens of a packed tensor ``x`` (total_tokens, ...) present on
    every rank, and their :class:`VarlenShard` metadata."""
    check_layout(layout)
    check_cu_seqlens(cu_seqlens, x.shape[0])
    g = resolve_group(group)
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    idx = global_index(cu, layout, world, rank)
    pos = torch.zeros_like(idx)
    starts = torch.tensor(cu[:-1], device="cpu")
    valid = idx >= 0
    doc = torch.searchsorted(torch.tensor(cu, device="cpu"), idx[valid], right=True) - 1
    pos[valid] = idx[valid] - starts[doc]
    local = x.new_zeros((idx.numel(), *x.shape[1:]))
    local[valid.to(x.device)] = x[idx[valid].to(x.device)]
    return local, VarlenShard(layout, world, rank, idx.numel(), idx, pos)


class _GatherVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cu, layout):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = x.new_zeros((cu[-1], *x.shape[1:]))
        ctx.idx = []
        for r, p in enumerate(parts):
            idx = global_index(cu, layout, world, r).to(x.device)
            keep = idx >= 0
            out[idx[keep]] = p[keep]
            ctx.idx.append(idx)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        idx = ctx.idx[dist.get_rank(ctx.group)]
        keep = idx >= 0
        out = grad.new_zeros((idx.numel(), *grad.shape[1:]))
        out[keep] = grad[idx[keep]]
        return out, None, None, None


def unshard_varlen(x_local: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str = "zigzag", group=None):
    """The packed (total_tokens, ...) tensor from every rank's shard, padding
    dropped (differentiable: a shard's gradient is the sum over ranks)."""
    check_layout(layout)
    g = resolve_group(group)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    return _GatherVarlen.apply(x_local, g, cu, layout)
