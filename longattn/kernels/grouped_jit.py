"""Triton kernels of the grouped dilated schedule.

Where branches nest (every rate divides R0 = the largest rate, R0 divides
W0 = the shortest segment, W0 divides every segment), the rows of offset
class j (position = j mod R0) of one W0-segment are selected by the same
branches (those with j % r == h % r) and, per branch, see the same keys.
One program owns a block of such rows of one head and runs every branch's
keys through one online softmax: the branch merge is the softmax itself,
so there is one launch per kernel, no read-merge-write of the output and
no accumulation of gradients across launches. In branch i's geometry the
block's rows have class indices (pos - kb) / r (kb: the branch segment's
first selected row), strided by R0 / r; causal masks compare those.
"""
from __future__ import annotations

from ._common import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .attention_jit import _dkdv_inner, _dq_inner, _dq_rows, _fwd_inner

    @triton.jit
    def _grouped_branch(BR, i, h, start0, S):
        """(w, r, first selected row kb, #selected rows mk) of branch i for head h
        in the branch segment holding position start0."""
        w = tl.load(BR + 2 * i)
        r = tl.load(BR + 2 * i + 1)
        seg_start = (start0 // w) * w
        c = h % r
        return r, seg_start + c, (tl.minimum(w, S - seg_start) - c + r - 1) // r

    @triton.jit
    def _grouped_rows(BR, NB: tl.constexpr, pid_z, h, R0, W0, NSEG, S, t0, BLOCK: tl.constexpr):
        """Positions of rows t0.. of the program's class j in its W0-segment, and their
        count. Classes run in the order of BR[2 NB:] (offsets from the head's own
        class, most branches first), all segments of a class together, so the
        heaviest programs start first and the last wave is short."""
        start0 = (pid_z % NSEG) * W0
        j = (h + tl.load(BR + 2 * NB + pid_z // NSEG)) % R0
        m0 = (tl.minimum(W0, S - start0) - j + R0 - 1) // R0
        t = t0 + tl.arange(0, BLOCK)
        return start0, j, m0, start0 + j + t * R0, t < m0

    @triton.jit
    def _grouped_keys(BR, i, h, j, start0, S, i0, m0, R0, pos, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr):
        """Branch i for a query block (rows i0.. of class j): whether it selects
        the block, its keys' (r, kb, mk), the rows' class indices in its
        geometry, and the key tiles [0, u1) unmasked, [u1, hi) masked."""
        r, kb, mk = _grouped_branch(BR, i, h, start0, S)
        full, hi = mk, mk
        if CAUSAL:  # the block's first row sees `full` keys, its last row `hi`
            full = tl.minimum((start0 + j + i0 * R0 - kb) // r + 1, mk)
            hi = tl.minimum((start0 + j + (tl.minimum(i0 + BLOCK_M, m0) - 1) * R0 - kb) // r + 1, mk)
        sel = (j % r == h % r) & (i0 < m0)
        return sel, r, kb, mk, (pos - kb) // r, (full // BLOCK_N) * BLOCK_N, hi

    @triton.jit
    def _grouped_block(BR, NB: tl.constexpr, H, R0, W0, NSEG, S, D: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A query-block program of the grouped schedule: batch, head, first class row, its rows (see
        _grouped_rows) and the key / head-dim offsets."""
        pid_bh = tl.program_id(1)
        h = pid_bh % H
        i0 = tl.program_id(0) * BLOCK_M
        start0, j, m0, pos, row_ok = _grouped_rows(BR, NB, tl.program_id(2), h, R0, W0, NSEG, S, i0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        return (pid_bh // H).to(tl.int64), h, i0, start0, j, m0, pos, row_ok, tl.arange(0, BLOCK_N), offs_d, offs_d < D

    @triton.jit
    def _grouped_fwd_kernel(Q, K, V, O, LSE, BR, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                            slb, slh, H, G, S, W0, R0, NSEG, qk_scale, NB: tl.constexpr, D: tl.constexpr,
                            D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        b, h, i0, start0, j, m0, pos, row_ok, offs_n, offs_d, dmask = _grouped_block(BR, NB, H, R0, W0, NSEG, S, D,
                                                                                     D_PAD, BLOCK_M, BLOCK_N)
        q = tl.load(Q + b * sqb + h * sqh + pos.to(tl.int64)[:, None] * sqs + offs_d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        k_ptr = K + b * skb + (h // G) * skh
        v_ptr = V + b * svb + (h // G) * svh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for i in tl.static_range(NB):
            sel, r, kb, mk, idx, u1, hi = _grouped_keys(BR, i, h, j, start0, S, i0, m0, R0, pos, BLOCK_M, BLOCK_N,
                                                        CAUSAL)
            if sel:
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kb, r, sks, svs, 0, u1, idx, offs_n,
                                           offs_d, dmask, mk, mk, 0, 0, 0, qk_scale, l_i, h, False, CAUSAL, False,
                                           False, BLOCK_N, IEEE, 0, 0)
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kb, r, sks, svs, u1, hi, idx, offs_n,
                                           offs_d, dmask, mk, mk, 0, 0, 0, qk_scale, l_i, h, True, CAUSAL, False,
                                           False, BLOCK_N, IEEE, 0, 0)
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
        p64 = pos.to(tl.int64)
        tl.store(O + b * sob + h * soh + p64[:, None] * sos + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & dmask[None, :])
        tl.store(LSE + b * slb + h * slh + p64, lse, mask=row_ok)

    @triton.jit
    def _grouped_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, BR, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                           sdob, sdos, sdoh, slb, slh, sdqb, sdqs, sdqh, H, G, S, W0, R0, NSEG, scale, qk_scale,
                           NB: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        scale = tl.full([], scale, tl.float32)
        b, h, i0, start0, j, m0, pos, rmask, offs_n, offs_d, dmask = _grouped_block(BR, NB, H, R0, W0, NSEG, S, D,
                                                                                    D_PAD, BLOCK_M, BLOCK_N)
        p64 = pos.to(tl.int64)
        qmask = rmask[:, None] & dmask[None, :]
        q, do, lse2, delta = _dq_rows(Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh, LSE + b * slb + h * slh,
                                      DELTA + b * slb + h * slh, p64, sqs, sdos, offs_d, rmask, qmask)
        k_ptr = K + b * skb + (h // G) * skh
        v_ptr = V + b * svb + (h // G) * svh
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for i in tl.static_range(NB):
            sel, r, kb, mk, idx, u1, hi = _grouped_keys(BR, i, h, j, start0, S, i0, m0, R0, pos, BLOCK_M, BLOCK_N,
                                                        CAUSAL)
            if sel:
                dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kb, r, sks, svs, 0, u1, idx, offs_n, offs_d,
                               dmask, mk, mk, 0, 0, 0, qk_scale, lse2, h, False, CAUSAL, False, False, BLOCK_N,
                               IEEE, 0, 0)
                dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kb, r, sks, svs, u1, hi, idx, offs_n, offs_d,
                               dmask, mk, mk, 0, 0, 0, qk_scale, lse2, h, True, CAUSAL, False, False, BLOCK_N,
                               IEEE, 0, 0)
        dq = dq * scale
        tl.store(DQ + b * sdqb + h * sdqh + p64[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=qmask)

    @triton.jit
    def _grouped_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, BR, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                             sdob, sdos, sdoh, slb, slh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, H, HKV, G, S, W0, R0,
                             NSEG, scale, qk_scale, NB: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                             IEEE: tl.constexpr):
        """Program: a block of class-j key rows of one kv head; every query head
        of its group and every branch that selects those keys add into one dK/dV."""
        qk_scale = tl.full([], qk_scale, tl.float32)
        scale = tl.full([], scale, tl.float32)
        pid = tl.program_id(1)
        b = (pid // HKV).to(tl.int64)
        kh = pid % HKV
        n0 = tl.program_id(0) * BLOCK_N
        start0, j, m0, kpos, kok = _grouped_rows(BR, NB, tl.program_id(2), kh * G, R0, W0, NSEG, S, n0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        k64 = kpos.to(tl.int64)
        kmask = kok[:, None] & dmask[None, :]
        k = tl.load(K + b * skb + kh * skh + k64[:, None] * sks + offs_d[None, :], mask=kmask, other=0.0)
        v = tl.load(V + b * svb + kh * svh + k64[:, None] * svs + offs_d[None, :], mask=kmask, other=0.0)
        dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
        k_first = start0 + j + n0 * R0
        k_last = start0 + j + (tl.minimum(n0 + BLOCK_N, m0) - 1) * R0
        for h in range(kh * G, kh * G + G):
            q_ptr = Q + b * sqb + h * sqh
            do_ptr = DO + b * sdob + h * sdoh
            lse_ptr = LSE + b * slb + h * slh
            delta_ptr = DELTA + b * slb + h * slh
            for i in tl.static_range(NB):
                r, qb, mq = _grouped_branch(BR, i, h, start0, S)
                if (j % r == h % r) & (n0 < m0):
                    cols = (kpos - qb) // r
                    # queries u see key n when n <= u (causal): none below the first
                    # key's index, all from the last key's index on
                    lo, u0 = 0, 0
                    if CAUSAL:
                        lo = ((k_first - qb) // r // BLOCK_M) * BLOCK_M
                        u0 = tl.minimum((((k_last - qb) // r + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, mq)
                    u1 = tl.maximum((mq // BLOCK_M) * BLOCK_M, u0)
                    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, r, sqs, sdos, lo, u0,
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, kpos, h, True,
                                         CAUSAL, False, False, BLOCK_M, IEEE, 0, 0)
                    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, r, sqs, sdos, u0, u1,
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, kpos, h, False,
                                         CAUSAL, False, False, BLOCK_M, IEEE, 0, 0)
                    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, r, sqs, sdos, u1, mq,
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, kpos, h, True,
                                         CAUSAL, False, False, BLOCK_M, IEEE, 0, 0)
        dk = dk * scale
        tl.store(DK + b * sdkb + kh * sdkh + k64[:, None] * sdks + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=kmask)
        tl.store(DV + b * sdvb + kh * sdvh + k64[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=kmask)
