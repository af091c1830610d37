"""Flash-attention kernels in Triton for dense blocks, packed documents and dilated branches.

One family of kernels covers both:

* dense mode (``DILATED=False``): query row i at position ``i + q_offset``,
  key row j at j; causal and sliding-window masks; GQA without expansion.
* dilated mode (``DILATED=True``): one launch per branch (w, r). Program
  (block, head, segment) reads rows ``seg*w + c + i*r`` with ``c = head % r``
  straight from the (B, S, H, D) tensors by strided addressing (no gathered
  copies), and merges into the running float32 output and lse of earlier
  branches. Within one launch every (row, head) belongs to one program, so
  the read-merge-write needs no atomics; launches of successive branches are
  ordered on the stream.

Backward: a preprocess kernel computes ``delta = rowsum(dO * O) - dlse`` from
the merged output; the dK/dV kernel gives each (key block, kv head, offset
class, segment) to one program that loops over the query heads of its group
that read those keys; the dQ kernel gives each (query block, head, segment)
to one program. Both add into float32 accumulators across branches.

Inner loops are split into masked and unmasked ranges (as in the Triton
fused-attention tutorial) so the mask costs only on boundary blocks.
"""
from __future__ import annotations

from ._common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    # The geometry helpers live in ranges_jit; imported here so the kernels below resolve them as globals.
    from .ranges_jit import (_geometry, _split_ranges, _key_ranges, _query_ranges, _visible,
                             _levels, _dedup_ranges, _query_block_parts)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _online_step(acc, l_i, m_i, qk, v, wt, WEIGHTED: tl.constexpr, IEEE: tl.constexpr):
        """One key tile into the running (acc, row sum, row max) of an online
        softmax in base 2; rows whose scores are all -inf so far stay 0.
        ``WEIGHTED``: each pair counts ``wt`` times (a tile of multiplicities)."""
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        if WEIGHTED:
            p = p * wt
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        return acc, l_i, m_new

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs, start, end, offs_m, offs_n, offs_d,
                   dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, wrow, hq, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                   IEEE: tl.constexpr, HR: tl.constexpr, NH: tl.constexpr):
        """Key tiles [start, end) into the online softmax; ``NH`` > 0: pairs
        weighted by their multiplicity (``wrow``: the query rows' levels)."""
        for start_n in range(start, end, BLOCK_N):
            cols = start_n + offs_n
            rows = (kbase + cols.to(tl.int64) * RS)
            kv_mask = (cols < MK)[:, None] & dmask[None, :]
            k = tl.load(k_ptr + rows[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + rows[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = _dot(q, tl.trans(k), IEEE) * qk_scale
            if MASKED:
                ok = _visible(offs_m, cols, MQ, MK, Q_OFF, LEFT, RIGHT, CAUSAL, HAS_LEFT, HAS_RIGHT)
                qk = tl.where(ok, qk, float("-inf"))
            if NH > 0:
                wt = tl.minimum(wrow[:, None], _levels(rows, hq, HR, NH)[None, :])
                acc, l_i, m_i = _online_step(acc, l_i, m_i, qk, v, wt, True, IEEE)
            else:
                acc, l_i, m_i = _online_step(acc, l_i, m_i, qk, v, qk, False, IEEE)
        return acc, l_i, m_i

    @triton.jit
    def _lse_merge(o_old, l_old, o_new, l_new):
        """Rows (BLOCK, D) of two partial results merged by their lse, in float32;
        rows where neither side saw a key keep output 0 and lse -inf."""
        top = tl.maximum(l_old, l_new)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w_old = tl.exp(l_old - top_safe)
        w_new = tl.exp(l_new - top_safe)
        tot = w_old + w_new
        tot_safe = tl.where(tot == 0.0, 1.0, tot)
        out = (o_old.to(tl.float32) * w_old[:, None] + o_new.to(tl.float32) * w_new[:, None]) / tot_safe[:, None]
        return out, tl.where(tot == 0.0, float("-inf"), top_safe + tl.log(tot_safe))

    @triton.jit
    def _query_block(CU, H, G, SQ, SK, W, R, NFULL, TAIL, D: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DILATED: tl.constexpr,
                     VARLEN: tl.constexpr):
        """A query-block program's coordinates: batch, head, kv head, the geometry of its rows
        (see _geometry), the block's first row and offsets, and its rows' positions in memory."""
        pid_m = tl.program_id(0)
        if CAUSAL:  # the last query blocks see the most keys: start them first, so the tail wave is short
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        qbase, kbase, MQ, MK, RS = _geometry(tl.program_id(2), h % R, W, R, NFULL, TAIL, SQ, SK, CU, DILATED, VARLEN)
        i0 = pid_m * BLOCK_M
        offs_m = i0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        qrows = qbase + offs_m.to(tl.int64) * RS
        return b, h, h // G, kbase, MQ, MK, RS, i0, offs_m, tl.arange(0, BLOCK_N), offs_d, offs_d < D, qrows

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                    H, G, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, qk_scale, INNER,
                    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    DILATED: tl.constexpr, VARLEN: tl.constexpr, MERGE: tl.constexpr, IEEE: tl.constexpr,
                    HR: tl.constexpr, NH: tl.constexpr, DEDUP: tl.constexpr):
        # torch.compile's launcher may pass Python floats as float64 scalars
        qk_scale = tl.full([], qk_scale, tl.float32)
        b, h, kh, kbase, MQ, MK, RS, i0, offs_m, offs_n, offs_d, dmask, qrows = _query_block(
            CU, H, G, SQ, SK, W, R, NFULL, TAIL, D, D_PAD, BLOCK_M, BLOCK_N, CAUSAL, DILATED, VARLEN)
        row_ok = offs_m < MQ
        q = tl.load(Q + b * sqb + h * sqh + qrows[:, None] * sqs + offs_d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        k_ptr = K + b * skb + kh * skh
        v_ptr = V + b * svb + kh * svh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        wrow = _levels(qrows, h, HR, NH)
        s0, e0, s1, e1, s2, e2 = _query_block_parts(i0, MQ, MK, Q_OFF, LEFT, RIGHT, INNER, BLOCK_M, BLOCK_N,
                                                    CAUSAL, HAS_LEFT, HAS_RIGHT, DEDUP)
        # the mask costs only on boundary blocks: part 1 (and part 0 when deduplicated) runs unmasked
        for part in tl.static_range(3):
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs,
                                       s0 if part == 0 else (s1 if part == 1 else s2),
                                       e0 if part == 0 else (e1 if part == 1 else e2), offs_m, offs_n, offs_d, dmask,
                                       MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, wrow, h,
                                       (part == 2) if DEDUP else (part != 1), CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N,
                                       IEEE, HR, NH)
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        # natural-log lse from the base-2 running max
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
        o_ptrs = O + b * sob + h * soh + qrows[:, None] * sos + offs_d[None, :]
        l_ptrs = LSE + b * slb + h * slh + qrows
        st_mask = row_ok[:, None] & dmask[None, :]
        if MERGE:
            out, lse = _lse_merge(tl.load(o_ptrs, mask=st_mask, other=0.0),
                                  tl.load(l_ptrs, mask=row_ok, other=float("-inf")), out, lse)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=st_mask)
        tl.store(l_ptrs, lse, mask=row_ok)

    @triton.jit
    def _bwd_preprocess(O, DO, DLSE, DELTA, sob, sos, soh, sdb, sds, sdh, slb, slh, H, S,
                        D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
        pid = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D_PAD)
        msk = (rows < S)[:, None] & (offs_d < D)[None, :]
        r64 = rows.to(tl.int64)
        o = tl.load(O + b * sob + h * soh + r64[:, None] * sos + offs_d[None, :], mask=msk, other=0.0).to(tl.float32)
        do = tl.load(DO + b * sdb + h * sdh + r64[:, None] * sds + offs_d[None, :], mask=msk, other=0.0).to(tl.float32)
        delta = tl.sum(o * do, 1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + b * slb + h * slh + r64, mask=rows < S, other=0.0)
        tl.store(DELTA + b * slb + h * slh + r64, delta, mask=rows < S)

    @triton.jit
    def _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qbase, RS, sqs, sdos, start, end, offs_m,
                    cols, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, wkey, hq, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    BLOCK_M: tl.constexpr, IEEE: tl.constexpr, HR: tl.constexpr, NH: tl.constexpr):
        """Query tiles [start, end) into a key block's dK/dV; ``NH`` > 0: pairs
        weighted by their multiplicity (``wkey``: the key rows' levels)."""
        for start_m in range(start, end, BLOCK_M):
            rows_i = start_m + offs_m
            rows = qbase + rows_i.to(tl.int64) * RS
            rmask = rows_i < MQ
            q = tl.load(q_ptr + rows[:, None] * sqs + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            do = tl.load(do_ptr + rows[:, None] * sdos + offs_d[None, :], mask=rmask[:, None] & dmask[None, :],
                         other=0.0)
            lse2 = tl.load(lse_ptr + rows, mask=rmask, other=float("inf")) * 1.4426950408889634
            lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
            delta = tl.load(delta_ptr + rows, mask=rmask, other=0.0)
            # scores transposed: (BLOCK_N keys, BLOCK_M queries)
            qkT = _dot(k, tl.trans(q), IEEE) * qk_scale
            pT = tl.math.exp2(qkT - lse2[None, :])
            if MASKED:
                ok = _visible(rows_i, cols, MQ, MK, Q_OFF, LEFT, RIGHT, CAUSAL, HAS_LEFT, HAS_RIGHT)
                pT = tl.where(tl.trans(ok), pT, 0.0)
            if NH > 0:
                pT = pT * tl.minimum(wkey[:, None], _levels(rows, hq, HR, NH)[None, :])
            dv += _dot(pT.to(do.dtype), do, IEEE)
            dpT = _dot(v, tl.trans(do), IEEE)
            dsT = pT * (dpT - delta[None, :])
            dk += _dot(dsT.to(q.dtype), q, IEEE)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                     sdob, sdos, sdoh, slb, slh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                     H, HKV, G, NCLS, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, scale, qk_scale, INNER,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     DILATED: tl.constexpr, VARLEN: tl.constexpr, ACCUM: tl.constexpr, IEEE: tl.constexpr,
                     HR: tl.constexpr, NH: tl.constexpr, DEDUP: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        scale = tl.full([], scale, tl.float32)
        pid_n = tl.program_id(0)
        pid = tl.program_id(1)
        seg = tl.program_id(2)
        c = pid % NCLS
        kh = (pid // NCLS) % HKV
        b = (pid // (NCLS * HKV)).to(tl.int64)
        qbase, kbase, MQ, MK, RS = _geometry(seg, c, W, R, NFULL, TAIL, SQ, SK, CU, DILATED, VARLEN)
        n0 = pid_n * BLOCK_N
        cols = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        krows = kbase + cols.to(tl.int64) * RS
        kmask = (cols < MK)[:, None] & dmask[None, :]
        k = tl.load(K + b * skb + kh * skh + krows[:, None] * sks + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(V + b * svb + kh * svh + krows[:, None] * svs + offs_d[None, :], mask=kmask, other=0.0)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        if DEDUP:  # queries outside the block's sub-block: after it (causal), or before and after it
            a1, b0, b1, b2 = _dedup_ranges(n0, MK, MQ, INNER, not CAUSAL, True, BLOCK_M)
            s0, e0, s1, e1, s2, e2 = a1 * 0, a1, b0, b1, b1, b2
        else:
            lo, u0, u1, hi = _query_ranges(n0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT,
                                           HAS_RIGHT)
            s0, e0, s1, e1, s2, e2 = lo, u0, u0, u1, u1, hi
        # the query heads of this kv head's group whose offset class is c
        h_first = kh * G + (c - kh * G % R + R) % R
        for h in range(h_first, kh * G + G, R):
            q_ptr = Q + b * sqb + h * sqh
            do_ptr = DO + b * sdob + h * sdoh
            lse_ptr = LSE + b * slb + h * slh
            delta_ptr = DELTA + b * slb + h * slh
            wkey = _levels(krows, h, HR, NH)
            for part in tl.static_range(3):  # masked, unmasked, masked query ranges (see _fwd_kernel)
                dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qbase, RS, sqs, sdos,
                                     s0 if part == 0 else (s1 if part == 1 else s2),
                                     e0 if part == 0 else (e1 if part == 1 else e2), offs_m, cols, offs_d, dmask, MQ,
                                     MK, Q_OFF, LEFT, RIGHT, qk_scale, wkey, h,
                                     (part == 2) if DEDUP else (part != 1), CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_M,
                                     IEEE, HR, NH)
        dk = dk * scale
        dk_ptrs = DK + b * sdkb + kh * sdkh + krows[:, None] * sdks + offs_d[None, :]
        dv_ptrs = DV + b * sdvb + kh * sdvh + krows[:, None] * sdvs + offs_d[None, :]
        if ACCUM:
            dk += tl.load(dk_ptrs, mask=kmask, other=0.0)
            dv += tl.load(dv_ptrs, mask=kmask, other=0.0)
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kmask)
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kmask)

    @triton.jit
    def _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kbase, RS, sks, svs, start, end, offs_m, offs_n, offs_d,
                  dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, wrow, hq, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, HR: tl.constexpr, NH: tl.constexpr):
        for start_n in range(start, end, BLOCK_N):
            cols = start_n + offs_n
            rows = kbase + cols.to(tl.int64) * RS
            kv_mask = (cols < MK)[:, None] & dmask[None, :]
            k = tl.load(k_ptr + rows[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + rows[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = _dot(q, tl.trans(k), IEEE) * qk_scale
            p = tl.math.exp2(qk - lse2[:, None])
            if MASKED:
                ok = _visible(offs_m, cols, MQ, MK, Q_OFF, LEFT, RIGHT, CAUSAL, HAS_LEFT, HAS_RIGHT)
                p = tl.where(ok, p, 0.0)
            if NH > 0:
                p = p * tl.minimum(wrow[:, None], _levels(rows, hq, HR, NH)[None, :])
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
        return dq

    @triton.jit
    def _dq_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, sqs, sdos, offs_d, rmask, qmask):
        """A dQ program's rows: q, dO, the base-2 lse (rows that saw no key at +inf, so P = 0) and delta."""
        q = tl.load(q_ptr + rows[:, None] * sqs + offs_d[None, :], mask=qmask, other=0.0)
        do = tl.load(do_ptr + rows[:, None] * sdos + offs_d[None, :], mask=qmask, other=0.0)
        lse2 = tl.load(lse_ptr + rows, mask=rmask, other=float("inf")) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        return q, do, lse2, tl.load(delta_ptr + rows, mask=rmask, other=0.0)

    @triton.jit
    def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                   sdob, sdos, sdoh, slb, slh, sdqb, sdqs, sdqh,
                   H, G, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, scale, qk_scale, INNER,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   DILATED: tl.constexpr, VARLEN: tl.constexpr, ACCUM: tl.constexpr, IEEE: tl.constexpr,
                   HR: tl.constexpr, NH: tl.constexpr, DEDUP: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        scale = tl.full([], scale, tl.float32)
        b, h, kh, kbase, MQ, MK, RS, i0, offs_m, offs_n, offs_d, dmask, qrows = _query_block(
            CU, H, G, SQ, SK, W, R, NFULL, TAIL, D, D_PAD, BLOCK_M, BLOCK_N, CAUSAL, DILATED, VARLEN)
        rmask = offs_m < MQ
        qmask = rmask[:, None] & dmask[None, :]
        q, do, lse2, delta = _dq_rows(Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh, LSE + b * slb + h * slh,
                                      DELTA + b * slb + h * slh, qrows, sqs, sdos, offs_d, rmask, qmask)
        k_ptr = K + b * skb + kh * skh
        v_ptr = V + b * svb + kh * svh
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        wrow = _levels(qrows, h, HR, NH)
        s0, e0, s1, e1, s2, e2 = _query_block_parts(i0, MQ, MK, Q_OFF, LEFT, RIGHT, INNER, BLOCK_M, BLOCK_N,
                                                    CAUSAL, HAS_LEFT, HAS_RIGHT, DEDUP)
        for part in tl.static_range(3):  # masked, unmasked, masked key ranges
            dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kbase, RS, sks, svs,
                           s0 if part == 0 else (s1 if part == 1 else s2),
                           e0 if part == 0 else (e1 if part == 1 else e2),
                           offs_m, offs_n, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, wrow, h,
                           (part == 2) if DEDUP else (part != 1), CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N, IEEE, HR, NH)
        dq = dq * scale
        dq_ptrs = DQ + b * sdqb + h * sdqh + qrows[:, None] * sdqs + offs_d[None, :]
        if ACCUM:
            dq += tl.load(dq_ptrs, mask=qmask, other=0.0)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=qmask)
