"""Ulysses' head plans: which query and kv heads each rank attends with
after the all-to-all (GQA/MQA included)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


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
