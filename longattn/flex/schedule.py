"""The executors of a flex call, built once per (shape, pattern) and cached:
the one step of a single-device call, and the ring schedule of
``ring_flex_attention`` (each step's block mask, the empty steps, and the
step count every rank agrees on)."""
from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from ..distributed import checks
from ..distributed.plan import Call
from ..distributed.ring import RingSchedule
from . import fa4
from . import plan as fp
from .checks import plan_outside_capture
from .step import FlexStep, compile_backend


class _LRU(collections.OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make, x: Optional[torch.Tensor] = None, what: str = "a flex call"):
        """The plan of ``key``, made by ``make()`` on a miss; a miss under CUDA
        graph capture raises (:func:`.checks.plan_outside_capture`, ``x`` the
        call's query tensor)."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        if x is not None:
            plan_outside_capture(x, what)
        val = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return val


PLANS = _LRU(64)
"""Block masks and executors of one-device calls per (shape, pattern), FlexAttention's and FA4's
(:func:`longattn.flex.pieces.single_executor`): a training loop builds them once."""

RING_PLANS = _LRU(64)
"""Plans of calls across ranks (the ring's schedules, the exchange's plans),
whose building runs collectives: kept apart from :data:`PLANS`, so that
one-device calls on one rank alone (an evaluation on rank 0) never evict a
plan on that rank only, which would then plan again, with collectives the
other ranks skip. Every rank makes the same distributed calls in the same
order, so this cache evicts alike on every rank."""


def pattern_key(fn):
    """A mask or score function as a cache key: its pattern_key (longattn.masks), else itself."""
    return None if fn is None else getattr(fn, "pattern_key", None) or fn


def signature(fn) -> str:
    """What ranks compare: the pattern key, or the function's qualified name."""
    if fn is None:
        return "none"
    key = getattr(fn, "pattern_key", None)
    return repr(key) if key is not None else getattr(fn, "__qualname__", type(fn).__name__)


def _make_step(table, mask_mod, score_mod, scale, qmap, kmap, q, k) -> FlexStep:
    return FlexStep(fp.block_mask(table, mask_mod, qmap, kmap, (q.shape[1], k.shape[1])),
                    fp.localize_score(score_mod, qmap, kmap), scale, compile_backend(q.device),
                    (pattern_key(mask_mod), pattern_key(score_mod)))


def single_step(q, k, mask_mod, score_mod, scale) -> Optional[FlexStep]:
    """The executor of a single-device call (cached); None where no query sees any key."""
    def make():
        qpos = torch.arange(q.shape[1], dtype=torch.int32, device=q.device)
        kpos = torch.arange(k.shape[1], dtype=torch.int32, device=q.device)
        table = fp.block_table(mask_mod, q.shape[0], q.shape[2], qpos, kpos)
        if table.empty:
            return None
        ident = fp.position_map("contiguous", 0, 1, q.shape[1], q.device)  # local index = global position
        kmap = fp.position_map("contiguous", 0, 1, k.shape[1], k.device)
        return _make_step(table, mask_mod, score_mod, scale, ident, kmap, q, k)
    key = ("single", pattern_key(mask_mod), pattern_key(score_mod), scale, tuple(q.shape), tuple(k.shape), q.dtype,
           str(q.device))
    return PLANS.get_or(key, make, q, "flex_attention")


def _ring_steps(need: int, group, device) -> int:
    """The ring's step count: the most steps any rank needs."""
    t = torch.tensor([need], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def ring_schedule(q, k, *, mask_mod=None, score_mod=None, layout: str = "zigzag", scale: float, group=None,
                  kernel: str = "auto") -> RingSchedule:
    """The ring schedule ``ring_flex_attention`` runs (cached per shape,
    pattern and group): ``steps`` (the same on every rank) and
    ``calls(src)``, one call with its executor (:class:`FlexStep`, or
    :class:`longattn.flex.fa4.RingStep` where FA4 runs the pattern) or none where the step
    is empty. On first use of a pattern, two small collectives: every rank's
    planning agreed (a mask that fails on one rank raises on every rank) and
    the step count."""
    group = checks.resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, length, h, _ = q.shape

    def make():
        problem, need, runs = None, 0, []
        try:
            tables = fp.rank_tables(mask_mod, layout, rank, world, length, b, h, device=q.device)
            need = fp.steps_needed(tables)
            # each rank computes only its own queries, so the ranks need not agree on the kernel; the executors are
            # built here, before the agreement, so one failing on one rank raises on every rank, not in the ring
            use_fa4 = fa4.choose(q, k, k, mask_mod, score_mod, kernel) == "fa4"
            qmap = fp.position_map(layout, rank, world, length, q.device)
            for s in range(need):
                if tables[s].empty:  # nothing visible: no compute at this step (the block still passes on)
                    step = None
                elif use_fa4:  # the pattern's FA4 form at this step's global positions
                    step = fa4.ring_executor(mask_mod, fp.global_positions(layout, rank, world, length, q.device),
                                             fp.global_positions(layout, (rank - s) % world, world, length,
                                                                 q.device), b, h, scale)
                else:
                    kmap = fp.position_map(layout, (rank - s) % world, world, length, q.device)
                    step = _make_step(tables[s], mask_mod, score_mod, scale, qmap, kmap, q, k)
                runs.append(step)
        except Exception as e:  # noqa: BLE001 - raised by agree, on this rank; the others name it
            problem = e
        checks.agree(group, "ring_flex_attention (planning the mask's blocks)", problem)
        steps = _ring_steps(need, group, q.device)
        calls = [(Call(0, length, 0, length, bk.BlockSpec(scale), run=runs[s]),)
                 if s < need and runs[s] is not None else () for s in range(steps)]
        return RingSchedule(steps, lambda src: calls[(rank - src) % world])
    key = ("ring", pattern_key(mask_mod), pattern_key(score_mod), scale, tuple(q.shape), tuple(k.shape), q.dtype,
           str(q.device), layout, checks.group_name(group), dist.get_world_size(group), dist.get_rank(group), kernel)
    return RING_PLANS.get_or(key, make, q, "ring_flex_attention")
