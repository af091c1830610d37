"""Which rows a Triton attention program reads and which of its key (query)
blocks need a mask: program geometry (dense, packed documents, dilated
branches), the masked/unmasked split of an inner loop's range, visibility,
and the dedup schedule's per-pair multiplicity ranges. Shared by the kernels
of :mod:`.attention_jit` and :mod:`.grouped_jit`."""
from __future__ import annotations

from ._common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _geometry(seg, c, W, R, NFULL, TAIL, SQ, SK, CU, DILATED: tl.constexpr, VARLEN: tl.constexpr):
        """(first q row, first k row, #q rows, #k rows, row stride) of a program."""
        if VARLEN:  # program z is document z of cu_seqlens
            start = tl.load(CU + seg)
            n = tl.load(CU + seg + 1) - start
            return start, start, n, n, 1 + seg * 0
        elif DILATED:
            seg_len = tl.where(seg < NFULL, W, TAIL)
            m = (seg_len - c + R - 1) // R
            base = seg * W + c
            return base, base, m, m, R
        else:
            return seg * 0, seg * 0, SQ + seg * 0, SK + seg * 0, 1 + seg * 0

    @triton.jit
    def _split_ranges(lo, hi, flo, fhi, BLOCK: tl.constexpr):
        """Rows [lo, hi) that may be visible, of which [flo, fhi) are fully visible, as
        BLOCK-aligned [lo, u0) masked, [u0, u1) unmasked, [u1, hi) masked."""
        hi = tl.maximum(hi, 0)
        lo = tl.minimum(tl.maximum(lo, 0), hi)
        lo = (lo // BLOCK) * BLOCK
        hi_r = ((hi + BLOCK - 1) // BLOCK) * BLOCK
        u0 = tl.minimum(tl.maximum(((flo + BLOCK - 1) // BLOCK) * BLOCK, lo), hi_r)
        u1 = tl.maximum(tl.minimum((tl.maximum(fhi, 0) // BLOCK) * BLOCK, hi_r), u0)
        return lo, u0, u1, hi

    @triton.jit
    def _key_ranges(i0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Key blocks rows [i0, i0+BLOCK_M) may see: [lo, u0) masked, [u0, u1) unmasked, [u1, hi) masked.

        A block past the program's last row (documents shorter than
        max_seqlen, a partial last segment) sees nothing: without this it
        would run the whole key loop for rows it never stores."""
        lo = i0 * 0
        hi = tl.where(i0 < MQ, MK, 0)
        flo = i0 * 0
        fhi = MK + i0 * 0
        if CAUSAL:
            hi = tl.minimum(hi, i0 + BLOCK_M + Q_OFF)
            fhi = tl.minimum(fhi, i0 + Q_OFF + 1)
        if HAS_RIGHT:
            hi = tl.minimum(hi, i0 + BLOCK_M + Q_OFF + RIGHT)
            fhi = tl.minimum(fhi, i0 + Q_OFF + RIGHT + 1)
        if HAS_LEFT:
            lo = tl.maximum(lo, i0 + Q_OFF - LEFT)
            flo = tl.maximum(flo, i0 + BLOCK_M - 1 + Q_OFF - LEFT)
        return _split_ranges(lo, hi, flo, fhi, BLOCK_N)

    @triton.jit
    def _query_ranges(n0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
        """Query blocks that may see keys [n0, n0+BLOCK_N): masked/unmasked split as above (none past MK)."""
        lo = n0 * 0
        hi = tl.where(n0 < MK, MQ, 0)
        flo = n0 * 0
        fhi = MQ + n0 * 0
        if CAUSAL:  # i + Q_OFF >= n
            lo = tl.maximum(lo, n0 - Q_OFF)
            flo = tl.maximum(flo, n0 + BLOCK_N - 1 - Q_OFF)
        if HAS_RIGHT:  # n - i - Q_OFF <= RIGHT
            lo = tl.maximum(lo, n0 - Q_OFF - RIGHT)
            flo = tl.maximum(flo, n0 + BLOCK_N - 1 - Q_OFF - RIGHT)
        if HAS_LEFT:  # i + Q_OFF - n <= LEFT
            hi = tl.minimum(hi, n0 + BLOCK_N + LEFT - Q_OFF)
            fhi = tl.minimum(fhi, n0 + LEFT - Q_OFF + 1)
        return _split_ranges(lo, hi, flo, fhi, BLOCK_M)

    @triton.jit
    def _visible(offs_m, offs_n, MQ, MK, Q_OFF, LEFT, RIGHT, CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr):
        pos = offs_m[:, None] + Q_OFF
        n = offs_n[None, :]
        ok = (n < MK) & (offs_m[:, None] < MQ)
        if CAUSAL:
            ok = ok & (n <= pos)
        if HAS_LEFT:
            ok = ok & (pos - n <= LEFT)
        if HAS_RIGHT:
            ok = ok & (n - pos <= RIGHT)
        return ok

    @triton.jit
    def _levels(pos, h, HR: tl.constexpr, NH: tl.constexpr):
        """1 + how many of the NH rates packed in HR (15 bits each, see
        Geometry.flags) select positions ``pos`` for head h.

        Deduplicated branches (see longattn.kernels.geometry.dedup_chain): a
        pair of branch i is also given by each later branch that selects both
        its query and its key; the later rates select prefixes of one another
        (each divides the next), so the pair counts min(levels(query),
        levels(key)) times. The rates are compile-time constants: a modulo by
        a runtime rate per key tile halved the forward's speed (one H200)."""
        p = pos.to(tl.int32) - h
        lv = (p * 0 + 1).to(tl.float32)
        for t in tl.static_range(NH):
            r = (HR >> (15 * t)) & 32767
            lv += tl.where(p % r == 0, 1.0, 0.0)
        return lv

    @triton.jit
    def _dedup_ranges(x0, MSELF, MOTHER, INNER, BEFORE: tl.constexpr, AFTER: tl.constexpr, BLOCK: tl.constexpr):
        """Deduplicated branch: the rows x0.. of a block (all in one sub-block of
        INNER class indices: the previous branch's segment) see the other side's
        rows outside that sub-block: before it ([0, a1), unmasked) if BEFORE, after
        it ([b0, b1) unmasked, [b1, b2) masked up to MOTHER) if AFTER; a block past
        the program's last row sees nothing."""
        live = x0 < MSELF
        sb0 = (x0 // INNER) * INNER
        a1 = x0 * 0
        b0 = x0 * 0
        b1 = x0 * 0
        b2 = x0 * 0
        if BEFORE:
            a1 = tl.where(live, tl.minimum(sb0, MOTHER), 0)
        if AFTER:
            b0 = tl.where(live, tl.minimum(sb0 + INNER, MOTHER), 0)
            b1 = tl.maximum((MOTHER // BLOCK) * BLOCK, b0)
            b2 = tl.where(b0 < MOTHER, tl.maximum(((MOTHER + BLOCK - 1) // BLOCK) * BLOCK, b1), b1)
            b1 = tl.minimum(b1, b2)
        return a1, b0, b1, b2

    @triton.jit
    def _query_block_parts(i0, MQ, MK, Q_OFF, LEFT, RIGHT, INNER, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                           DEDUP: tl.constexpr):
        """The three key ranges (start, end of each) a query block loops over: masked
        [lo, u0), unmasked [u0, u1), masked [u1, hi) (see _key_ranges); deduplicated,
        the keys outside the block's sub-block: [0, a1) and [b0, b1) unmasked, [b1, b2)
        masked (before it when causal, before and after it otherwise)."""
        if DEDUP:
            a1, b0, b1, b2 = _dedup_ranges(i0, MQ, MK, INNER, True, not CAUSAL, BLOCK_N)
            return a1 * 0, a1, b0, b1, b1, b2
        else:
            lo, u0, u1, hi = _key_ranges(i0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT,
                                         HAS_RIGHT)
            return lo, u0, u0, u1, u1, hi
