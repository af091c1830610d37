"""Dense decoding where a query sees only its recent keys: chunked attention
(Llama 4's ``attention_chunk_size``: a query at position p sees the keys of
its chunk up to it, from ``p - p % chunk_size``) and sliding windows (from
``p - left``), over a cache on one device or a rank's part of a sharded one.

A rank's slots hold increasing global positions (runs in slot order, see
:class:`longattn.distributed.cache.CacheLayout`), so the keys a query sees
are one contiguous range of local slots ``[s, e)``. Consecutive queries whose
ranges keep ``s`` and ``e``, or move ``e`` (causal) or both (causal with a
window) by one per query, are one backend call on a view of the cache; rows
whose calls are the same go in one call. The result merges by lse like any
part (no key: 0 and -inf)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import backends as bk
from .. import tuning as _tuning
from .._merge import empty_state
from .._validation import check_chunk_size, check_window


def check_bounds(chunk_size, window_size) -> tuple[Optional[int], int]:
    """``chunk_size`` (None or a positive int) and ``window_size`` ((left,
    right): left -1 or >= 0; right has no effect on a causal query); returns
    (chunk, left)."""
    chunk = check_chunk_size(chunk_size)
    return chunk or None, check_window(window_size)[0]


def first_seen(p: int, chunk: Optional[int], left: int) -> int:
    """The first position a causal query at ``p`` sees."""
    lo = 0 if chunk is None else p - p % chunk
    return max(lo, p - left) if left >= 0 else lo


def _before(runs, x: int) -> int:
    """Slots of ``runs`` (``(global_start, local_start, length)``, tiling the
    slots in order) whose positions are below ``x``."""
    return sum(min(max(x - g, 0), n) for g, _, n in runs)


def _ranges(runs, q_pos: int, lq: int, chunk, left) -> list[tuple[int, int]]:
    """Local ``[s, e)`` of each query ``q_pos + i``."""
    return [(_before(runs, first_seen(p, chunk, left)), _before(runs, p + 1)) for p in range(q_pos, q_pos + lq)]


def _calls(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int, int, str]]:
    """Consecutive queries as block calls ``(i0, i1, s, e, kind)``: keys ``[s, e)``;
    kind "all" (every query sees them all), "causal" (bottom-right) or
    "window" (bottom-right, each query ``e - s - (i1 - i0)`` keys back)."""
    calls, i = [], 0
    while i < len(ranges):
        s0, e0 = ranges[i]
        j, kind = i + 1, "all"
        while j < len(ranges):
            s, e = ranges[j]
            step = (s - s0 == j - i, e - e0 == j - i)
            want = {"all": (s == s0, e == e0), "causal": (s == s0, step[1]), "window": step}
            k = kind if j > i + 1 else next((n for n in ("all", "causal", "window") if all(want[n])), None)
            if k is None or not all(want[k]) or e0 <= s0:
                break
            kind, j = k, j + 1
        calls.append((i, j, s0, ranges[j - 1][1], kind))
        i = j
    return calls


def bounded_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs,
                 q_pos: Sequence[int], chunk: Optional[int], left: int, scale: float, softcap: float, backend: str,
                 tuning: _tuning.DecodeTuning = _tuning.DECODE) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q ``(B, Lq, H, D)`` (query i of row b at global
    position ``q_pos[b] + i``) over the slots of each row, ``runs[b]``
    (``(global_start, local_start, length)`` in slot order; one device: one
    run ``(0, 0, length)``), each query seeing only from :func:`first_seen` on. Returns out in q's dtype
    ``(B, Lq, H, D)`` and lse ``(B, H, Lq)`` float32; no key: 0 and -inf."""
    b, lq = q.shape[:2]
    out, lse = empty_state(q, q.dtype)
    per_row = [_calls(_ranges(runs[r], q_pos[r], lq, chunk, left)) for r in range(b)]
    groups = [range(b)] if all(c == per_row[0] for c in per_row) else [range(r, r + 1) for r in range(b)]
    for rows in groups:
        r0, r1 = rows[0], rows[-1] + 1
        for i0, i1, s, e, kind in per_row[r0]:
            if e <= s:
                continue  # no key: the empty state
            n = i1 - i0
            if kind == "all":
                spec = bk.BlockSpec(scale, softcap=softcap)
            else:
                window = (e - s - n, -1) if kind == "window" else (-1, -1)
                spec = bk.BlockSpec(scale, True, window, e - s - n, softcap)
            qs, k, v = q[r0:r1, i0:i1], k_cache[r0:r1, s:e], v_cache[r0:r1, s:e]
            o, l = bk.select_backend(qs, k, spec, backend, exclude=tuning.auto_excludes).forward(qs, k, v, spec)
            out[r0:r1, i0:i1], lse[r0:r1, :, i0:i1] = o, l
    return out, lse
