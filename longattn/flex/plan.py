"""Block planning for a ring driven by a FlexAttention ``mask_mod``.

Pure functions of positions and the user's mask (no torch.distributed): a
rank holds queries at known global positions (``layout.chunks``); for the
K/V block visiting at each ring step, the mask is evaluated on (local
queries x visiting keys) in global positions and reduced to blocks of
``block`` x ``block`` (FlexAttention's) or query rows x keys (FA4's sparse
block, :mod:`.blocks`): a block is empty (skipped), full (no mask evaluation
in the kernel) or partial. A step with no visible key is skipped (its
exchange still runs); the ring needs 1 + the last step at which any rank
sees a key.

The mask is evaluated on broadcast index tensors (b ``(B,1,1,1)``, h
``(1,H,1,1)``, q ``(1,1,Lq,1)``, kv ``(1,1,1,Lk)``), in row chunks: the
shape it returns says whether it depends on the batch row or the head, so a
mask that does not gets one block table for all of them. A mask that cannot
run on broadcast tensors is evaluated with ``torch.vmap`` as FlexAttention's
``create_mask`` does, per batch row and head.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask, noop_mask

from ..distributed.layout import chunks

BLOCK_SIZE = 128
"""FlexAttention's sparse block (its kernels' default): the granularity of skipping."""

_CHUNK = 1 << 24
"""Mask entries evaluated at once (a few tens of MB of bool and int32 temporaries)."""


def global_positions(layout: str, rank: int, world: int, local_len: int, device=None) -> torch.Tensor:
    """int32 global position of each local row of ``rank`` (int32 as FlexAttention's indices)."""
    return torch.cat([torch.arange(g, g + n, dtype=torch.int32, device=device)
                      for g, _, n in chunks(layout, rank, world, local_len)])


def position_map(layout: str, rank: int, world: int, local_len: int, device=None) -> tuple:
    """``(split, lo, hi)``, 0-d int32 tensors: local row i of ``rank`` is at
    global position ``i + (lo if i < split else hi)`` (each layout gives a rank
    at most two chunks). Arithmetic, not a table lookup: the localized
    functions below index no tensor, which FlexAttention's compiled backward
    needs (and tensors, not ints, so one compiled kernel serves every step)."""
    ch = chunks(layout, rank, world, local_len)
    (g0, _, n0), (g1, l1, _) = ch[0], ch[-1]
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return t(n0), t(g0), t(g1 - l1)


def to_global(idx: torch.Tensor, pmap: tuple) -> torch.Tensor:
    split, lo, hi = pmap
    return idx + torch.where(idx < split, lo, hi)


def localize_mask(mask_mod: Optional[Callable], qmap: tuple, kmap: tuple) -> Callable:
    """The mask on local indices (what FlexAttention calls on a shard): the
    user's mask at the global positions of those rows (``position_map``)."""
    if mask_mod is None:
        return noop_mask

    def local_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, to_global(q_idx, qmap), to_global(kv_idx, kmap))
    return local_mask


def localize_score(score_mod: Optional[Callable], qmap: tuple, kmap: tuple) -> Optional[Callable]:
    if score_mod is None:
        return None

    def local_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, to_global(q_idx, qmap), to_global(kv_idx, kmap))
    return local_score


def _at(mask_mod, qpos, kpos):
    """The mask on indices into position tables (for torch's vmap evaluation)."""
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, qpos[q_idx], kpos[kv_idx])


def _broadcast_eval(mask_mod, bm: int, hm: int, qpos, kpos) -> torch.Tensor:
    dev = qpos.device
    b = torch.arange(bm, dtype=torch.int32, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(hm, dtype=torch.int32, device=dev).view(1, -1, 1, 1)
    return mask_mod(b, h, qpos.view(1, 1, -1, 1), kpos.view(1, 1, 1, -1))


def _check_result(r, what: str) -> torch.Tensor:
    if not isinstance(r, torch.Tensor) or r.dtype != torch.bool:
        got = r.dtype if isinstance(r, torch.Tensor) else type(r).__name__
        raise TypeError(f"mask_mod must return a bool tensor (comparisons combined with & and |), got {got} "
                        f"{what}")
    return r


def mask_dims(mask_mod: Callable, batch: int, heads: int, qpos, kpos) -> tuple[int, int, bool]:
    """(Bm, Hm, broadcast): the batch and head extents the mask depends on (1
    where it does not), and whether it runs on broadcast index tensors."""
    try:
        r = _broadcast_eval(mask_mod, batch, heads, qpos[:2], kpos[:2])  # 2 x 2: query and key shapes differ
        shape = torch.broadcast_shapes(tuple(r.shape), (1, 1, 1, 1))
        ok = isinstance(r, torch.Tensor) and len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads)
    except Exception:  # noqa: BLE001 - a mask that runs on scalars only: vmap it
        ok = False
    if not ok:
        return _vmap_dims(mask_mod, batch, heads, qpos, kpos)
    _check_result(r, "(evaluated on broadcast index tensors)")
    return shape[0], shape[1], True


def _vmap_dims(mask_mod, batch, heads, qpos, kpos) -> tuple[int, int, bool]:
    probe = create_mask(_at(mask_mod, qpos[:1], kpos[:1]), 1, 1, 1, 1, qpos.device)
    _check_result(probe, "(evaluated with torch.vmap)")
    return batch, heads, False


def evaluate(mask_mod: Callable, dims: tuple[int, int, bool], qpos, kpos) -> torch.Tensor:
    """The mask, ``(Bm, Hm, len(qpos), len(kpos))`` bool, at these global positions."""
    bm, hm, broadcast = dims
    if broadcast:
        return _broadcast_eval(mask_mod, bm, hm, qpos, kpos).expand(bm, hm, len(qpos), len(kpos))
    return create_mask(_at(mask_mod, qpos, kpos), bm, hm, len(qpos), len(kpos), qpos.device)


@dataclasses.dataclass(frozen=True)
class BlockTable:
    """Per (Bm, Hm, query block, key block): ``partial`` (some keys visible,
    the kernel applies the mask) and ``full`` (all visible); neither: empty."""

    partial: torch.Tensor
    full: torch.Tensor

    @property
    def empty(self) -> bool:
        return not bool(self.partial.any() or self.full.any())


def _sizes(n: int, block: int, device) -> torch.Tensor:
    s = torch.full(((n + block - 1) // block,), block, dtype=torch.int32, device=device)
    s[-1] = n - block * (len(s) - 1)
    return s


def _pair(block) -> tuple[int, int]:
    """``block`` as (query rows, keys): an int is a square block."""
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def block_table(mask_mod: Optional[Callable], batch: int, heads: int, qpos: torch.Tensor, kpos: torch.Tensor,
                block=BLOCK_SIZE) -> BlockTable:
    """Which blocks of (queries at ``qpos``) x (keys at ``kpos``) hold visible
    keys; ``block``: an int (square) or (query rows, keys). The last block of
    each axis holds the remainder (its area, not the block's, makes it full)."""
    bq, bk = _pair(block)
    lq, lk, dev = len(qpos), len(kpos), qpos.device
    nqb, nkb = (lq + bq - 1) // bq, (lk + bk - 1) // bk
    if mask_mod is None:
        full = torch.ones(1, 1, nqb, nkb, dtype=torch.bool, device=dev)
        return BlockTable(torch.zeros_like(full), full)
    dims = mask_dims(mask_mod, batch, heads, qpos, kpos)
    if dims[2]:
        try:
            return _table(mask_mod, dims, qpos, kpos, bq, bk)
        except Exception:  # noqa: BLE001 - ran on the probe, not on larger broadcast shapes: vmap it
            dims = _vmap_dims(mask_mod, batch, heads, qpos, kpos)
    return _table(mask_mod, dims, qpos, kpos, bq, bk)


def _table(mask_mod, dims, qpos, kpos, bq, bk) -> BlockTable:
    lq, lk, dev = len(qpos), len(kpos), qpos.device
    nqb, nkb = (lq + bq - 1) // bq, (lk + bk - 1) // bk
    bm, hm, _ = dims
    count = torch.empty(bm, hm, nqb, nkb, dtype=torch.int32, device=dev)
    rows = max(bq, _CHUNK // max(1, bm * hm * lk) // bq * bq)
    for r0 in range(0, lq, rows):
        m = evaluate(mask_mod, dims, qpos[r0:r0 + rows], kpos)
        rq = m.shape[2]
        pad_q, pad_k = -rq % bq, -lk % bk
        if pad_q or pad_k:
            m = torch.nn.functional.pad(m, (0, pad_k, 0, pad_q), value=False)
        cnt = m.view(bm, hm, (rq + pad_q) // bq, bq, nkb, bk).sum((3, 5), dtype=torch.int32)
        count[:, :, r0 // bq:r0 // bq + cnt.shape[2]] = cnt
    area = _sizes(lq, bq, dev)[:, None] * _sizes(lk, bk, dev)[None, :]
    full = count == area
    return BlockTable((count > 0) & ~full, full)


def rank_tables(mask_mod: Optional[Callable], layout: str, rank: int, world: int, local_len: int, batch: int,
                heads: int, block: int = BLOCK_SIZE, device=None) -> list[BlockTable]:
    """``tables[s]``: this rank's queries against the K/V block it holds at
    ring step s (the block of rank ``(rank - s) % world``)."""
    qpos = global_positions(layout, rank, world, local_len, device)
    return [block_table(mask_mod, batch, heads, qpos,
                        global_positions(layout, (rank - s) % world, world, local_len, device), block)
            for s in range(world)]


def steps_needed(tables: list[BlockTable]) -> int:
    """Ring steps this rank needs: 1 + the last step with a visible key (1 when none)."""
    return 1 + max((s for s, t in enumerate(tables) if not t.empty), default=0)


def ordered_blocks(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's block format: per query block, the count of listed key
    blocks and their indices first (``torch.nn.attention.flex_attention``'s own
    conversion)."""
    d = dense.to(torch.int32)
    idx = torch.argsort(d, dim=-1, descending=True, stable=True)
    return default_strides(d.sum(-1, dtype=torch.int32)), default_strides(idx.to(torch.int32))


def default_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its shape's default strides at offset 0: ``contiguous()`` keeps any stride of a
    size-1 dim (a transposed table with one query block; one head's transposed lse) and a view's offset, while
    FA4 checks the last dim's stride is 1 whatever its size and ``view(dtype)`` needs both."""
    return t.clone(memory_format=torch.contiguous_format)


def block_mask(table: BlockTable, mask_mod: Optional[Callable], qmap: tuple, kmap: tuple, lengths: tuple,
               block: int = BLOCK_SIZE) -> BlockMask:
    """The FlexAttention BlockMask of one step: local indices (``lengths`` =
    (queries, keys)), the mask at global positions (``position_map``)."""
    pn, pi = ordered_blocks(table.partial)
    fn, fi = ordered_blocks(table.full)
    return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=(block, block),
                                    mask_mod=localize_mask(mask_mod, qmap, kmap), seq_lengths=tuple(lengths))
