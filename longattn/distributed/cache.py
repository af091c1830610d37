"""Where each token of a sharded KV cache lives: pure bookkeeping, no
communication. Every rank holds the same :class:`CacheLayout` and updates it
the same way, so every rank knows every rank's part without asking.

A rank's part of row ``b`` is a list of *runs* ``(global_start, local_start,
length)``: the tokens at global positions ``global_start + i`` sit in local
slots ``local_start + i``. Runs are in increasing position and slot order and
cover the local slots ``0 .. local_len - 1`` without gaps, so the slots of a
part are always sorted by position.

* After a context-parallel prefill a rank holds the positions of its shard
  (``contiguous``: one piece; ``zigzag``: pieces r and 2p-1-r), cut to each
  row's real length (right padding is never stored).
* Decoding appends each call's tokens (every row) to one rank: the current
  *block* continues on the rank that received the previous call's tokens
  until ``block`` tokens went there; the next block goes to the rank with the
  fewest stored tokens (largest row, then total, then lowest rank). Parts stay
  within a block of each other, and a part gains one run per block (dilated
  decoding reads a run as strided views; few runs, few calls).
"""
from __future__ import annotations

from typing import Optional, Sequence

from . import checks
from .layout import check_layout


def prefill_pieces(layout: str, rank: int, world: int, seqlen: int) -> list[tuple[int, int]]:
    """(global start, length) of the pieces of a ``seqlen``-token sequence that
    ``rank`` holds, in local order. Equal to :func:`longattn.shard` when
    ``seqlen`` divides (2 x) world; otherwise the boundaries are
    ``seqlen * i // n`` (pieces differ by at most one token)."""
    check_layout(layout)
    n = world if layout == "contiguous" else 2 * world
    bound = [seqlen * i // n for i in range(n + 1)]
    ids = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    return [(bound[i], bound[i + 1] - bound[i]) for i in ids]


class CacheLayout:
    """The placement of a KV cache's tokens over ``world`` ranks (world 1: one
    device), for ``batch`` rows.

    Attributes (read them; change them only through the methods):
        seqlens: tokens of each row, all ranks together.
        local: ``local[rank][row]``, tokens of each part.
        runs: ``runs[rank][row]``, the runs of each part (see the module docstring).
        last_owner, last_count: the rank that received the latest :meth:`place` and
            how many tokens per row it got (the queries that follow sit there);
            None and 0 before the first.

    Its arguments are checked by its user (:class:`longattn.KVCache`: positive
    ``batch`` and ``block``, ``seqlens`` in range) before the ranks agree on
    them; a layout is bookkeeping and checks nothing again.
    """

    def __init__(self, world: int, batch: int, block: int = 256):
        self.world, self.batch, self.block = world, batch, block
        self.seqlens = [0] * batch
        self.local = [[0] * batch for _ in range(world)]
        self.runs: list[list[list[tuple[int, int, int]]]] = [[[] for _ in range(batch)] for _ in range(world)]
        self.last_owner: Optional[int] = None
        self.last_count = 0
        self._owner, self._block_left = 0, 0
        # the placement is a function of the start and of the counts placed since:
        # a running hash of those counts tells two ranks' placements apart
        self._placed = 0

    @classmethod
    def from_prefill(cls, seqlens: Sequence[int], padded_len: int, *, layout: str = "contiguous", world: int = 1,
                     block: int = 256) -> "CacheLayout":
        """The placement after a prefill of ``padded_len`` tokens per row split
        by ``layout`` (:func:`prefill_pieces`), row ``b`` holding
        ``seqlens[b]`` (in ``[0, padded_len]``) real tokens followed by
        padding. A part keeps its real tokens only; they come first in its
        slots (a later piece has real tokens only when the earlier one is
        full)."""
        lay = cls(world, len(seqlens), block)
        for b, n_real in enumerate(seqlens):
            lay.seqlens[b] = int(n_real)
            for r in range(world):
                slot = 0
                for g, n in prefill_pieces(layout, r, world, padded_len):
                    cnt = max(0, min(n, n_real - g))
                    if cnt:
                        lay.runs[r][b].append((g, slot, cnt))
                        slot += cnt
                lay.local[r][b] = slot
        return lay

    def fullest(self) -> list[int]:
        """Per rank: its largest row (the slots a rectangular buffer needs)."""
        return [max(row) if row else 0 for row in self.local]

    def choose_owner(self) -> int:
        """The rank a new block goes to: fewest tokens in its largest row, then in
        all rows, then the lowest rank."""
        return min(range(self.world), key=lambda r: (max(self.local[r]), sum(self.local[r]), r))

    def place(self, n: int) -> int:
        """Record that every row gains ``n`` tokens (positions ``seqlens[b] ..
        seqlens[b] + n - 1``) and return the rank that stores them, at local slots
        ``local[owner][b] ..`` (read before the call)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        if self._block_left < n:
            self._owner = self.choose_owner()
            self._block_left = max(self.block, n)
        owner = self._owner
        self._block_left -= n
        for b in range(self.batch):
            g, slot = self.seqlens[b], self.local[owner][b]
            runs = self.runs[owner][b]
            if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((g, slot, n))
            self.local[owner][b] += n
            self.seqlens[b] += n
        self.last_owner, self.last_count = owner, n
        self._placed = (self._placed * 1000003 + n) % (1 << 61)
        return owner

    def state(self) -> tuple:
        """A copy of the placement, for :meth:`restore`."""
        return (list(self.seqlens), [list(r) for r in self.local],
                [[list(row) for row in r] for r in self.runs], self.last_owner, self.last_count, self._owner,
                self._block_left, self._placed)

    def restore(self, state: tuple) -> None:
        """Back to a placement :meth:`state` returned (the appends since undone)."""
        seqlens, local, runs, self.last_owner, self.last_count, self._owner, self._block_left, self._placed = state
        self.seqlens, self.local = list(seqlens), [list(r) for r in local]
        self.runs = [[list(row) for row in r] for r in runs]

    def digest(self) -> int:
        """A 56-bit digest of what every rank's copy must hold alike (the ranks
        compare it to find appends that differed)."""
        return checks.digest(dict(s=tuple(self.seqlens), p=self._placed, c=self.last_count, o=self._owner,
                                  b=self._block_left))

    def positions(self, rank: int, row: int) -> list[int]:
        """Global position of each local slot (tests and debugging; O(tokens))."""
        return [g + i for g, _, n in self.runs[rank][row] for i in range(n)]
