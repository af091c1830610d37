"""The dilated schedule: which (row, head) pairs each branch selects, as
strided views of the (B, S, H, D) tensors.

Semantics (pinned by tests/reference.py):
  branch i has segment length w_i and dilation rate r_i; for query head h it
  selects position p when ``(p % w_i) % r_i == h % r_i``. A selected query
  attends to the selected keys of its own segment ``p // w_i`` (with
  ``causal``, keys at positions <= p). The branches merge as one softmax over
  the union of the keys each branch gives (merge by lse). GQA: query head h
  reads kv head ``h // (H // Hkv)`` at the positions its own offset selects.

The schedule cuts every branch into *parts*: for each offset class
``c = h % r`` the full segments (batched as one dense call) and the partial
last segment. A part's rows are ``c, c + r, ...`` inside each segment, which
are plain strided views of (B, S, H, D) tensors. :class:`Unit` stacks the
offset classes of a branch into few views where their addresses allow it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

@dataclasses.dataclass(frozen=True)
class Part:
    """Rows ``start + s*seg_len + c + i*r`` for s < nseg, i < m, query heads c::r."""

    w: int
    r: int
    c: int
    start: int
    nseg: int
    seg_len: int

    def nheads(self, h: int) -> int:
        """Query heads of this part's offset class among ``h``: c, c + r, ..."""
        return len(range(self.c, h, self.r))

    @property
    def m(self) -> int:
        return -(-(self.seg_len - self.c) // self.r)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H, D) -> strided view (B, nseg, m, H, D)."""
        b, _, h, d = x.shape
        span = x[:, self.start : self.start + self.nseg * self.seg_len]
        return span.view(b, self.nseg, self.seg_len, h, d)[:, :, self.c :: self.r]

    def q_view(self, x: torch.Tensor, bi: Optional[int] = None) -> torch.Tensor:
        """(B, S, H, D) -> strided view (B, nseg, m, Hc, D) of the part's rows and
        heads, or (nseg, m, Hc, D) of batch element ``bi``. One ``as_strided``
        call: the views path makes these for every tensor of every call, and
        short sequences are bound by host time."""
        sb, ss, sh, sd = x.stride()
        size = (self.nseg, self.m, self.nheads(x.shape[2]), x.shape[3])
        stride = (self.seg_len * ss, self.r * ss, self.r * sh, sd)
        return self._view(x, sb, ss, sh, size, stride, bi)

    def lse_view(self, lse: torch.Tensor, bi: Optional[int] = None) -> torch.Tensor:
        """(B, H, S) -> strided view (B, nseg, m, Hc) aligned with q_view (or
        (nseg, m, Hc) of batch element ``bi``)."""
        sb, sh, ss = lse.stride()
        size = (self.nseg, self.m, self.nheads(lse.shape[1]))
        stride = (self.seg_len * ss, self.r * ss, self.r * sh)
        return self._view(lse, sb, ss, sh, size, stride, bi)

    def kv_view(self, x: torch.Tensor, nheads: int, bi: Optional[int] = None) -> torch.Tensor:
        """(B, S, Hkv, D) -> strided view (B, nseg, m, Hk, D) of the part's rows
        and the kv heads its query heads (c::r of ``nheads``) read, or
        (nseg, m, Hk, D) of batch element ``bi``. With g = nheads / Hkv:
        r % g == 0: kv heads c // g, c // g + r / g, ... one per query head
        (an MHA call); g % r == 0: every kv head, each for g / r consecutive
        query heads of the class (a GQA call). See :func:`kv_views_ok`."""
        hkv = x.shape[2]
        g = nheads // hkv
        if g == 1:
            return self.q_view(x, bi)
        sb, ss, sh, sd = x.stride()
        if _class_steps_kv(self.r, g):
            head0, step, count = self.c // g, self.r // g, self.nheads(nheads)
        else:
            head0, step, count = 0, 1, hkv
        size = (self.nseg, self.m, count, x.shape[3])
        stride = (self.seg_len * ss, self.r * ss, step * sh, sd)
        first = x.storage_offset() + (self.start + self.c) * ss + head0 * sh
        if bi is None:
            return x.as_strided((x.shape[0], *size), (sb, *stride), first)
        return x.as_strided(size, stride, first + bi * sb)

    def _view(self, x, sb, ss, sh, size, stride, bi):
        first = x.storage_offset() + (self.start + self.c) * ss + self.c * sh  # row start + c, head c
        if bi is None:
            return x.as_strided((x.shape[0], *size), (sb, *stride), first)
        return x.as_strided(size, stride, first + bi * sb)


def schedule(seqlen: int, segment_lengths, dilation_rates, nheads: int) -> list[Part]:
    parts = []
    for w, r in zip(segment_lengths, dilation_rates):
        # A segment longer than the sequence is the sequence (p % w == p, p // w == 0): as one full
        # segment its classes stack into few calls instead of one partial part each (LongNet at 8K:
        # 83 launches per forward against 18)
        w = min(w, seqlen)
        nfull = seqlen // w
        tail = seqlen - nfull * w
        for c in range(min(r, nheads)):
            if nfull and c < w:
                parts.append(Part(w, r, c, 0, nfull, w))
            if tail and c < tail:
                parts.append(Part(w, r, c, nfull * w, 1, tail))
    return parts


def _class_steps_kv(r: int, g: int) -> bool:
    """True where rate ``r`` is a multiple of the group size ``g`` (class c
    reads kv heads c // g, c // g + r / g, ...: one per query head), False
    where r divides g (every kv head); ValueError where neither (no view: see
    :func:`kv_views_ok`)."""
    if r % g == 0:
        return True
    if g % r == 0:
        return False
    raise ValueError(f"rate {r} and group size {g}: neither divides the other (see kv_views_ok)")


def kv_views_ok(dilation_rates, nheads: int, nheads_kv: int) -> bool:
    """Every part's kv heads are a strided view (see :meth:`Part.kv_view`):
    with g = nheads / nheads_kv, each rate is a multiple or a divisor of g
    (always for MHA; for powers of two always)."""
    g = nheads // nheads_kv
    return all(r % g == 0 or g % r == 0 for r in dilation_rates)


def kv_heads_for(part: Part, nheads: int, nheads_kv: int) -> tuple[list[int], bool]:
    """The kv heads the part's query heads read, and whether they form a
    regular GQA grouping (each listed kv head serving an equal run of
    consecutive query heads) so the backend can read them without expansion."""
    g = nheads // nheads_kv
    per_q = [h // g for h in range(part.c, nheads, part.r)]
    uniq = list(dict.fromkeys(per_q))
    run = len(per_q) // len(uniq)
    regular = len(per_q) % len(uniq) == 0 and per_q == [u for u in uniq for _ in range(run)]
    return (uniq if regular else per_q), regular



@dataclasses.dataclass(frozen=True)
class Unit:
    """One local-backend call of the views path: a (N, M, Hc, D) strided
    view of every (B, S, H, D) tensor and (N, M, Hc) of every (B, H, S) one.

    ``part`` set: the part's (nseg, m, Hc, D) rows. Otherwise the full segments
    of a whole branch (w, r) whose offset classes share m = w / r and Hc = H / r:
    class c reads rows ``s*w + c + i*r`` of heads ``c + j*r``, an address linear
    in (s, c, i, j), so the classes stack into one view with the class as a
    batch (``seg`` = s: one call per segment, (r, m, Hc)) or, with one head per
    class, as the head dim (``seg`` = -1: (nseg, m, r)). Fewer, larger calls
    than one per class: the high-rate branches are tiny per class. Where
    neither fits and the branch is small (``gathered``: at most ``gather_max_rows``
    (row, head) pairs, see :class:`longattn.tuning.DilatedTuning`),
    its rows are copied into dense (nseg * r, m, Hc, D) blocks, one call: on
    short sequences a call's host time (100-300 us on the H200 hosts) outweighs
    copying 1/r of q, k and v. GQA branches never stack as views (their
    classes' kv heads do not step with the class); a small one is gathered
    (:meth:`kv_view`).
    """

    part: Optional[Part] = None
    w: int = 0
    r: int = 0
    nseg: int = 0
    seg: int = -1
    gathered: bool = False

    @property
    def n(self) -> int:
        if self.part is not None:
            return self.part.nseg
        if self.gathered:
            return self.nseg * self.r
        return self.nseg if self.seg < 0 else self.r

    def _five(self, x: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        """(B, S, H, D) -> (nseg, r, m, Hc, D); (B, H, S) -> (nseg, r, m, Hc)."""
        w, r, m, hc = self.w, self.r, self.w // self.r, h // self.r
        if x.dim() == 4:
            sb, ss, sh, sd = x.stride()
            return x.as_strided((self.nseg, r, m, hc, x.shape[3]), (w * ss, ss + sh, r * ss, r * sh, sd),
                                x.storage_offset() + bi * sb)
        sb, sh, ss = x.stride()
        return x.as_strided((self.nseg, r, m, hc), (w * ss, ss + sh, r * ss, r * sh), x.storage_offset() + bi * sb)

    def kv_view(self, x: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        """A gathered GQA branch's keys or values (B, S, Hkv, D): the rows and
        kv heads each class reads (as :meth:`Part.kv_view`), stacked in the
        classes' order so their dense copy lines up with the queries'. With
        g = h / Hkv: g % r == 0, every class reads every kv head: (nseg, r, m,
        Hkv, D); r % g == 0, class c = g*a + b reads kv heads a, a + r/g, ...
        at rows b + g*a + i*r, linear in (a, b) but not in c: (nseg, r/g, g, m,
        Hc, D)."""
        w, r, m, hkv = self.w, self.r, self.w // self.r, x.shape[2]
        g = h // hkv
        sb, ss, sh, sd = x.stride()
        first = x.storage_offset() + bi * sb
        if g % r == 0 or not _class_steps_kv(r, g):  # r == g: both forms are this one
            return x.as_strided((self.nseg, r, m, hkv, x.shape[3]), (w * ss, ss, r * ss, sh, sd), first)
        a = r // g
        return x.as_strided((self.nseg, a, g, m, h // r, x.shape[3]), (w * ss, g * ss + sh, ss, r * ss, a * sh, sd),
                            first)

    def view(self, x: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        """The call's (N, M, Hc, D) / (N, M, Hc) view; a gathered unit's is the
        5-D (nseg, r, m, Hc, D) / (nseg, r, m, Hc) one its copies are made from
        (GQA keys and values: :meth:`kv_view`)."""
        if self.part is not None:
            if x.dim() == 3:
                return self.part.lse_view(x, bi)
            return self.part.q_view(x, bi) if x.shape[2] == h else self.part.kv_view(x, h, bi)
        if x.dim() == 4 and x.shape[2] != h:
            return self.kv_view(x, bi, h)
        v = self._five(x, bi, h)
        if self.gathered:
            return v
        if self.seg >= 0:
            return v[self.seg]
        return v[:, :, :, 0].transpose(1, 2)  # one head per class: the classes are the heads


def units(seqlen: int, segment_lengths, dilation_rates, nheads: int, gather_max_rows: int = 0,
          mha: bool = True) -> list[Unit]:
    """The views path's calls: each branch's full segments as few stacked views
    as its shape allows (see :class:`Unit`), other parts (partial last
    segments, classes of unequal size) one call each. GQA (``mha`` False):
    a small branch gathered as MHA's (the same ``gather_max_rows``: a class
    reads as many kv as query (row, head) pairs where r % g == 0, fewer where
    g % r == 0), else one call per part (a class's kv heads do not step with
    the class, so classes do not stack as views)."""
    out = []
    for part in schedule(seqlen, segment_lengths, dilation_rates, nheads):
        w, r = part.w, part.r
        full = part.start == 0 and part.seg_len == w and w % r == 0 and nheads % r == 0 and r > 1
        small = full and part.nseg * w * (nheads // r) <= gather_max_rows
        if not (mha and full or small):
            out.append(Unit(part))
        elif part.c == 0:  # the branch's first class stands for all of them
            nseg = part.nseg
            if mha and nheads == r:
                out.append(Unit(w=w, r=r, nseg=nseg))
            elif small:
                out.append(Unit(w=w, r=r, nseg=nseg, gathered=True))
            elif nseg < r:
                out += [Unit(w=w, r=r, nseg=nseg, seg=i) for i in range(nseg)]
            else:
                out += [Unit(p) for p in schedule(seqlen, [w], [r], nheads) if p.start == 0]
    return out


def ordered_units(seqlen: int, segment_lengths, dilation_rates, nheads: int, gather_max_rows: int = 0,
                  mha: bool = True) -> tuple[tuple[Unit, ...], int]:
    """The views path's units with the first rate-1 branch's parts first, and
    their count. Those parts cover every (row, head) exactly once, so their
    results are copied into the output (or become it) instead of merging with
    an empty one: no zero-fill pass, no read of it. Cached: planning is host
    time on every call."""
    return _ordered_units_cached(seqlen, tuple(segment_lengths), tuple(dilation_rates), nheads, gather_max_rows,
                                 mha)


@functools.lru_cache(maxsize=256)
def _ordered_units_cached(seqlen: int, segment_lengths: tuple, dilation_rates: tuple, nheads: int,
                          gather_max_rows: int, mha: bool):
    us = units(seqlen, segment_lengths, dilation_rates, nheads, gather_max_rows, mha)
    if 1 not in dilation_rates:
        return tuple(us), 0
    w = segment_lengths[dilation_rates.index(1)]
    base = [Unit(p) for p in schedule(seqlen, [w], [1], nheads)]
    for u in base:
        us.remove(u)  # its first occurrence: a repeated (w, 1) branch still merges
    return tuple(base + us), len(base)


def pair_count(seqlen: int, segment_lengths, dilation_rates, nheads: int, causal: bool) -> int:
    """(query, key) pairs computed, summed over heads and branches: the
    'useful' work FLOP counts are based on (x 4 x headdim for a forward)."""
    total = 0
    for part in schedule(seqlen, segment_lengths, dilation_rates, nheads):
        hc = part.nheads(nheads)
        m = part.m
        per_seg = m * (m + 1) // 2 if causal else m * m
        total += per_seg * part.nseg * hc
    return total
