"""Document-aware sharding of a packed batch: which rank holds which tokens.

Packed documents attend only within themselves, so a document held whole by
one rank needs nothing from the others. :func:`plan_documents` places the
documents longest first (longest-processing-time) on the rank with the least
causal work (about ``len**2 / 2`` per document) among those with room: a rank
takes at most ``(1 + imbalance) * total / world`` tokens and
``(1 + imbalance)`` times the mean work. A document that fits on no rank is
*split*: cut into ``2 * world`` chunks, rank r holding chunks r and
``2 * world - 1 - r`` (zigzag per document: every rank gets the same causal
work from it). Only the split documents' K/V travel
(:mod:`longattn.ops.packed_cp`).

Each rank's local tokens: its whole documents (in document order), then its
pieces of the split documents (head chunk, tail chunk, per split document in
document order), then padding up to ``local_tokens``, the same on every rank
(the largest rank's count). The plan is a pure function of the global
``cu_seqlens`` and the world size: every rank computes the same one without
communication.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

from .. import tuning as _tuning
from .._validation import check_cu_seqlens
from . import checks

__all__ = ["DocumentShard", "plan_documents", "shard_documents", "IMBALANCE"]

# Allowed excess of a rank's tokens and causal work over the mean before a
# document is split instead: the measured value and its reason live in tuning.
IMBALANCE = _tuning.DOC_SHARD.imbalance


@functools.lru_cache(maxsize=64)
def _assign(cu: tuple, world: int, imbalance: float) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(documents held whole by each rank, in document order; split documents, in order)."""
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    total, work_total = sum(lens), sum(n * n for n in lens)
    cap_tokens = (1 + imbalance) * total / world
    cap_work = (1 + imbalance) * work_total / world
    tokens, work = [0.0] * world, [0.0] * world
    whole: list[list[int]] = [[] for _ in range(world)]
    split = []
    for d in sorted(range(len(lens)), key=lambda d: (-lens[d], d)):
        n = lens[d]
        if n == 0:  # an empty document: no token, nowhere
            continue
        room = [r for r in range(world) if tokens[r] + n <= cap_tokens and work[r] + n * n <= cap_work]
        if room:
            r = min(room, key=lambda r: (work[r], tokens[r], r))
            whole[r].append(d)
            tokens[r] += n
            work[r] += n * n
        else:
            split.append(d)
            for r in range(world):
                tokens[r] += n / world
                work[r] += n * n / world
    return tuple(tuple(sorted(w)) for w in whole), tuple(sorted(split))


def _chunks(n: int, world: int) -> list[int]:
    """Boundaries of a split document's 2 * world chunks (sizes differ by at most one)."""
    return [(i * n) // (2 * world) for i in range(2 * world + 1)]


def _pieces(cu: tuple, world: int, whole, split, rank: int) -> list[tuple[int, int, int]]:
    """(document, first position in it, length) of each local run of tokens, in local order."""
    runs = [(d, 0, cu[d + 1] - cu[d]) for d in whole[rank]]
    for d in split:
        b = _chunks(cu[d + 1] - cu[d], world)
        runs += [(d, b[c], b[c + 1] - b[c]) for c in (rank, 2 * world - 1 - rank)]
    return runs


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentShard:
    """One rank's share of a packed batch under document-aware sharding
    (see the module docstring); made by :func:`shard_documents`.

    ``runs[r]``: (document, first position in it, length) of each run of rank
    r's local tokens, in local order (whole documents, then split pieces).
    ``whole_tokens``: how many local tokens belong to documents held whole
    here (they come first); ``split_tokens[r]``: rank r's tokens of split
    documents, which follow them."""

    cu: tuple
    world: int
    rank: int
    imbalance: float
    whole: tuple
    split: tuple
    runs: tuple
    local_tokens: int

    @property
    def whole_tokens(self) -> int:
        return sum(n for d, _, n in self.runs[self.rank] if d not in self.split)

    @property
    def split_tokens(self) -> tuple[int, ...]:
        return tuple(sum(n for d, _, n in rr if d in self.split) for rr in self.runs)

    @functools.cached_property
    def global_index(self) -> torch.Tensor:
        """(local_tokens,) int64: packed position of each local token, -1 for padding.
        Shift labels before sharding, then take them at these positions."""
        return _index(self.cu, self.runs[self.rank], self.local_tokens, global_pos=True)

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        """(local_tokens,) int64: each token's position inside its document (0 for padding), for RoPE."""
        return _index(self.cu, self.runs[self.rank], self.local_tokens, global_pos=False).clamp_min(0)

    @property
    def valid(self) -> torch.Tensor:
        return self.global_index >= 0

    @functools.cached_property
    def cu_seqlens_local(self) -> torch.Tensor:
        """int32 boundaries of the documents held whole here, over the first
        ``whole_tokens`` local tokens (``attention_varlen`` of those rows needs no other rank)."""
        lens = [n for d, _, n in self.runs[self.rank] if d not in self.split]
        return torch.tensor([0] + lens, dtype=torch.int64, device="cpu").cumsum(0).to(torch.int32)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``(local_tokens, ...)`` of a packed ``(total_tokens, ...)``
        tensor (padding rows 0)."""
        if x.shape[0] != self.cu[-1]:
            raise ValueError(f"x has {x.shape[0]} rows but cu_seqlens ends at {self.cu[-1]}")
        idx, keep = self.global_index.to(x.device), self.valid.to(x.device)
        out = x.new_zeros((self.local_tokens, *x.shape[1:]))
        out[keep] = x[idx[keep]]
        return out

    def unshard(self, x_local: torch.Tensor, group=None) -> torch.Tensor:
        """The packed ``(total_tokens, ...)`` tensor from every rank's rows, padding
        dropped; differentiable (a shard's gradient is the sum over ranks)."""
        return _Unshard.apply(x_local, self, checks.resolve_group(group))

    def digest(self) -> int:
        """Equal on ranks whose plans are the same problem (for the cross-rank checks)."""
        return checks.digest(dict(cu=self.cu, world=self.world, imbalance=self.imbalance))


def _index(cu: tuple, runs, length: int, global_pos: bool) -> torch.Tensor:
    idx = torch.full((length,), -1, dtype=torch.long, device="cpu")  # plan tables live on the host
    at = 0
    for d, p0, n in runs:
        idx[at:at + n] = torch.arange(n, device="cpu") + p0 + (cu[d] if global_pos else 0)
        at += n
    return idx


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan, group):
        parts = [torch.empty_like(x) for _ in range(plan.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = x.new_zeros((plan.cu[-1], *x.shape[1:]))
        for r, part in enumerate(parts):
            idx = _index(plan.cu, plan.runs[r], plan.local_tokens, True).to(x.device)
            out[idx[idx >= 0]] = part[idx >= 0]
        ctx.plan, ctx.group = plan, group
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return ctx.plan.shard(grad), None, None


@functools.lru_cache(maxsize=256)
def plan_documents(cu: tuple, world: int, rank: int, imbalance: float = IMBALANCE) -> DocumentShard:
    """The :class:`DocumentShard` of ``rank`` for the packed documents of
    boundaries ``cu`` (a tuple of ints) over ``world`` ranks: pure, no
    collectives, cached (the ops rebuild it from these values in both passes)."""
    whole, split = _assign(cu, world, imbalance)
    runs = tuple(tuple(_pieces(cu, world, whole, split, r)) for r in range(world))
    local = max(1, max(sum(n for _, _, n in rr) for rr in runs))
    return DocumentShard(cu, world, rank, imbalance, whole, split, runs, local)


def _problem(cu_seqlens, world, rank, imbalance) -> Optional[Exception]:
    try:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel():
            check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
            if int(cu_seqlens[-1]) == 0:
                raise ValueError("cu_seqlens describes no token (it ends at 0)")
        else:
            check_cu_seqlens(cu_seqlens, 0)
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ValueError(f"world ({world!r}) must be an int >= 1 and rank ({rank!r}) one of 0 .. world - 1")
        if not (isinstance(imbalance, (int, float)) and imbalance >= 0):
            raise ValueError(f"imbalance must be a number >= 0, got {imbalance!r}")
    except (TypeError, ValueError) as e:
        return e
    return None


def shard_documents(cu_seqlens: torch.Tensor, world: Optional[int] = None, rank: Optional[int] = None, *,
                    group=None, imbalance: float = IMBALANCE) -> DocumentShard:
    """The document-aware sharding of a packed batch for this rank (see the module docstring).

    Args:
        cu_seqlens: the global int32 ``(ndocs + 1,)`` cumulative document lengths.
        world, rank: the ranks to plan for and this one: a pure computation, no
            collectives (errors raise on this rank alone). Without them, those of
            ``group`` (default WORLD), and the ranks check (one small all-gather)
            that they passed the same valid ``cu_seqlens``: an error on one rank
            raises on every rank.
        imbalance: allowed excess of a rank's tokens and causal work over the
            mean before a document is split (:data:`IMBALANCE`).

    Returns:
        A :class:`DocumentShard`: ``shard(x)`` / ``unshard(x_local)``,
        ``global_index`` (labels), ``position_ids`` (RoPE), ``cu_seqlens_local``,
        ``split`` (documents whose K/V travel); the plan of
        :func:`longattn.packed_attention`.

    Equivalent plain loop::

        for d in sorted(docs, key=len, reverse=True):   # longest first
            r = least-loaded rank with room for d       # tokens and len**2 work
            if r: place d whole on r
            else: split d into 2*world chunks; rank r takes chunks r and 2*world-1-r
    """
    collective = world is None
    if collective:
        if rank is not None:
            raise ValueError("pass world and rank together (a pure plan), or neither (those of group)")
        g = checks.resolve_group(group)
        world, rank = dist.get_world_size(g), dist.get_rank(g)
    problem = _problem(cu_seqlens, world, rank, imbalance)
    if collective:
        cu_fields = None if problem else tuple(cu_seqlens.tolist())
        checks.agree(g, "shard_documents", problem, cu=checks.digest(dict(cu=cu_fields)), imbalance=imbalance)
    elif problem is not None:
        raise problem
    return plan_documents(tuple(int(x) for x in cu_seqlens.tolist()), world, rank, float(imbalance))
