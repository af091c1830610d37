"""Flash-attention kernels in Triton for dense blocks and dilated branches.

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

import hashlib
import json
import math
import os
import time
import warnings
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised on machines without triton
    HAS_TRITON = False

SUPPORTED_HEADDIMS = (16, 32, 64, 96, 128, 256)
LOG2E = 1.4426950408889634


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    return not unavailable_reason(device)


def unavailable_reason(device: torch.device) -> str:
    if not HAS_TRITON:
        return "triton is not installed"
    if device.type == "cpu" and not _interpret():
        return "Triton runs on CPU only under TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} unsupported"
    return ""


if HAS_TRITON:

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
        hi = tl.maximum(hi, 0)
        lo = tl.minimum(lo, hi)
        lo = (lo // BLOCK_N) * BLOCK_N
        hi_r = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        u0 = tl.minimum(tl.maximum(((flo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), hi_r)
        u1 = tl.maximum(tl.minimum((tl.maximum(fhi, 0) // BLOCK_N) * BLOCK_N, hi_r), u0)
        return lo, u0, u1, hi

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
        hi = tl.maximum(hi, 0)
        lo = tl.minimum(tl.maximum(lo, 0), hi)
        lo = (lo // BLOCK_M) * BLOCK_M
        hi_r = ((hi + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        u0 = tl.minimum(tl.maximum(((flo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, lo), hi_r)
        u1 = tl.maximum(tl.minimum((tl.maximum(fhi, 0) // BLOCK_M) * BLOCK_M, hi_r), u0)
        return lo, u0, u1, hi

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
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs, start, end, offs_m, offs_n, offs_d,
                   dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
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
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
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
    def _fwd_kernel(Q, K, V, O, LSE, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                    H, G, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, qk_scale,
                    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    DILATED: tl.constexpr, VARLEN: tl.constexpr, MERGE: tl.constexpr, IEEE: tl.constexpr):
        # torch.compile's launcher may pass Python floats as float64 scalars
        qk_scale = tl.full([], qk_scale, tl.float32)
        pid_m = tl.program_id(0)
        if CAUSAL:  # the last query blocks see the most keys: start them first, so the tail wave is short
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        seg = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        kh = h // G
        qbase, kbase, MQ, MK, RS = _geometry(seg, h % R, W, R, NFULL, TAIL, SQ, SK, CU, DILATED, VARLEN)
        i0 = pid_m * BLOCK_M
        offs_m = i0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        qrows = qbase + offs_m.to(tl.int64) * RS
        row_ok = offs_m < MQ
        q = tl.load(Q + b * sqb + h * sqh + qrows[:, None] * sqs + offs_d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        k_ptr = K + b * skb + kh * skh
        v_ptr = V + b * svb + kh * svh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        lo, u0, u1, hi = _key_ranges(i0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT, HAS_RIGHT)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs, lo, u0, offs_m, offs_n,
                                   offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL, HAS_LEFT,
                                   HAS_RIGHT, BLOCK_N, IEEE)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs, u0, u1, offs_m, offs_n,
                                   offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, False, CAUSAL, HAS_LEFT,
                                   HAS_RIGHT, BLOCK_N, IEEE)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kbase, RS, sks, svs, u1, hi, offs_m, offs_n,
                                   offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL, HAS_LEFT,
                                   HAS_RIGHT, BLOCK_N, IEEE)
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
                    cols, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, MASKED: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                    BLOCK_M: tl.constexpr, IEEE: tl.constexpr):
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
            dv += _dot(pT.to(do.dtype), do, IEEE)
            dpT = _dot(v, tl.trans(do), IEEE)
            dsT = pT * (dpT - delta[None, :])
            dk += _dot(dsT.to(q.dtype), q, IEEE)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                     sdob, sdos, sdoh, slb, slh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                     H, HKV, G, NCLS, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, scale, qk_scale,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     DILATED: tl.constexpr, VARLEN: tl.constexpr, ACCUM: tl.constexpr, IEEE: tl.constexpr):
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
        lo, u0, u1, hi = _query_ranges(n0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT, HAS_RIGHT)
        # the query heads of this kv head's group whose offset class is c
        h_first = kh * G + (c - kh * G % R + R) % R
        for h in range(h_first, kh * G + G, R):
            q_ptr = Q + b * sqb + h * sqh
            do_ptr = DO + b * sdob + h * sdoh
            lse_ptr = LSE + b * slb + h * slh
            delta_ptr = DELTA + b * slb + h * slh
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qbase, RS, sqs, sdos, lo, u0,
                                 offs_m, cols, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL,
                                 HAS_LEFT, HAS_RIGHT, BLOCK_M, IEEE)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qbase, RS, sqs, sdos, u0, u1,
                                 offs_m, cols, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, False, CAUSAL,
                                 HAS_LEFT, HAS_RIGHT, BLOCK_M, IEEE)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qbase, RS, sqs, sdos, u1, hi,
                                 offs_m, cols, offs_d, dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL,
                                 HAS_LEFT, HAS_RIGHT, BLOCK_M, IEEE)
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
                  dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
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
            dp = _dot(do, tl.trans(v), IEEE)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, IEEE)
        return dq

    @triton.jit
    def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                   sdob, sdos, sdoh, slb, slh, sdqb, sdqs, sdqh,
                   H, G, SQ, SK, W, R, NFULL, TAIL, Q_OFF, LEFT, RIGHT, scale, qk_scale,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   DILATED: tl.constexpr, VARLEN: tl.constexpr, ACCUM: tl.constexpr, IEEE: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        scale = tl.full([], scale, tl.float32)
        pid_m = tl.program_id(0)
        if CAUSAL:  # the last query blocks see the most keys: start them first, so the tail wave is short
            pid_m = tl.num_programs(0) - 1 - pid_m
        pid_bh = tl.program_id(1)
        seg = tl.program_id(2)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        kh = h // G
        qbase, kbase, MQ, MK, RS = _geometry(seg, h % R, W, R, NFULL, TAIL, SQ, SK, CU, DILATED, VARLEN)
        i0 = pid_m * BLOCK_M
        offs_m = i0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        qrows = qbase + offs_m.to(tl.int64) * RS
        rmask = offs_m < MQ
        qmask = rmask[:, None] & dmask[None, :]
        q = tl.load(Q + b * sqb + h * sqh + qrows[:, None] * sqs + offs_d[None, :], mask=qmask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + qrows[:, None] * sdos + offs_d[None, :], mask=qmask, other=0.0)
        lse2 = tl.load(LSE + b * slb + h * slh + qrows, mask=rmask, other=float("inf")) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(DELTA + b * slb + h * slh + qrows, mask=rmask, other=0.0)
        k_ptr = K + b * skb + kh * skh
        v_ptr = V + b * svb + kh * svh
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        lo, u0, u1, hi = _key_ranges(i0, MQ, MK, Q_OFF, LEFT, RIGHT, BLOCK_M, BLOCK_N, CAUSAL, HAS_LEFT, HAS_RIGHT)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kbase, RS, sks, svs, lo, u0, offs_m, offs_n, offs_d,
                       dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N, IEEE)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kbase, RS, sks, svs, u0, u1, offs_m, offs_n, offs_d,
                       dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, False, CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N, IEEE)
        dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kbase, RS, sks, svs, u1, hi, offs_m, offs_n, offs_d,
                       dmask, MQ, MK, Q_OFF, LEFT, RIGHT, qk_scale, True, CAUSAL, HAS_LEFT, HAS_RIGHT, BLOCK_N, IEEE)
        dq = dq * scale
        dq_ptrs = DQ + b * sdqb + h * sdqh + qrows[:, None] * sdqs + offs_d[None, :]
        if ACCUM:
            dq += tl.load(dq_ptrs, mask=qmask, other=0.0)
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=qmask)

    # ------------------------------------------------ grouped dilated schedule
    # Where branches nest (every rate divides R0 = the largest rate, R0 divides
    # W0 = the shortest segment, W0 divides every segment), the rows of offset
    # class j (position = j mod R0) of one W0-segment are selected by the same
    # branches (those with j % r == h % r) and, per branch, see the same keys.
    # One program owns a block of such rows of one head and runs every branch's
    # keys through one online softmax: the branch merge is the softmax itself,
    # so there is one launch per kernel, no read-merge-write of the output and
    # no accumulation of gradients across launches. In branch i's geometry the
    # block's rows have class indices (pos - kb) / r (kb: the branch segment's
    # first selected row), strided by R0 / r; causal masks compare those.

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
    def _grouped_fwd_kernel(Q, K, V, O, LSE, BR, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                            slb, slh, H, G, S, W0, R0, NSEG, qk_scale, NB: tl.constexpr, D: tl.constexpr,
                            D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        qk_scale = tl.full([], qk_scale, tl.float32)
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        i0 = tl.program_id(0) * BLOCK_M
        start0, j, m0, pos, row_ok = _grouped_rows(BR, NB, tl.program_id(2), h, R0, W0, NSEG, S, i0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
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
                                           offs_d, dmask, mk, mk, 0, 0, 0, qk_scale, False, CAUSAL, False, False,
                                           BLOCK_N, IEEE)
                acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, kb, r, sks, svs, u1, hi, idx, offs_n,
                                           offs_d, dmask, mk, mk, 0, 0, 0, qk_scale, True, CAUSAL, False, False,
                                           BLOCK_N, IEEE)
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
        pid_bh = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = pid_bh % H
        i0 = tl.program_id(0) * BLOCK_M
        start0, j, m0, pos, rmask = _grouped_rows(BR, NB, tl.program_id(2), h, R0, W0, NSEG, S, i0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        p64 = pos.to(tl.int64)
        qmask = rmask[:, None] & dmask[None, :]
        q = tl.load(Q + b * sqb + h * sqh + p64[:, None] * sqs + offs_d[None, :], mask=qmask, other=0.0)
        do = tl.load(DO + b * sdob + h * sdoh + p64[:, None] * sdos + offs_d[None, :], mask=qmask, other=0.0)
        lse2 = tl.load(LSE + b * slb + h * slh + p64, mask=rmask, other=float("inf")) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = tl.load(DELTA + b * slb + h * slh + p64, mask=rmask, other=0.0)
        k_ptr = K + b * skb + (h // G) * skh
        v_ptr = V + b * svb + (h // G) * svh
        dq = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for i in tl.static_range(NB):
            sel, r, kb, mk, idx, u1, hi = _grouped_keys(BR, i, h, j, start0, S, i0, m0, R0, pos, BLOCK_M, BLOCK_N,
                                                        CAUSAL)
            if sel:
                dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kb, r, sks, svs, 0, u1, idx, offs_n, offs_d,
                               dmask, mk, mk, 0, 0, 0, qk_scale, False, CAUSAL, False, False, BLOCK_N, IEEE)
                dq = _dq_inner(dq, q, do, lse2, delta, k_ptr, v_ptr, kb, r, sks, svs, u1, hi, idx, offs_n, offs_d,
                               dmask, mk, mk, 0, 0, 0, qk_scale, True, CAUSAL, False, False, BLOCK_N, IEEE)
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
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, True, CAUSAL,
                                         False, False, BLOCK_M, IEEE)
                    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, r, sqs, sdos, u0, u1,
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, False, CAUSAL,
                                         False, False, BLOCK_M, IEEE)
                    dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, qb, r, sqs, sdos, u1, mq,
                                         offs_m, cols, offs_d, dmask, mq, mq, 0, 0, 0, qk_scale, True, CAUSAL,
                                         False, False, BLOCK_M, IEEE)
        dk = dk * scale
        tl.store(DK + b * sdkb + kh * sdkh + k64[:, None] * sdks + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=kmask)
        tl.store(DV + b * sdvb + kh * sdvh + k64[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=kmask)


# ----------------------------------------------------------------------- launchers
def _blocks(d: int, device: torch.device, kind: str) -> dict:
    """Block sizes and warps: small tiles under the interpreter (speed of the
    tests), tuned tiles on GPU (docs/performance.md records the sweep)."""
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    kind = kind.removeprefix("grouped_")
    bucket = min((b for b in (32, 64, 96, 128, 256) if b >= d), default=256)
    return dict(_TUNED[(kind, bucket)])


# (kind, headdim bucket) -> launch config; kinds: fwd, dkdv (BLOCK_M query
# rows x BLOCK_N keys per program), dq. Starting points from the Triton
# fused-attention tutorial's Hopper settings, refined by
# benchmarks/tune_triton.py (docs/performance.md records the sweep).
_TUNED = {}
for _d in (32, 64, 96, 128, 256):
    _big = _d > 128
    # d <= 128: the H200 sweep of 2026-11-22 (benchmarks/results/tune_triton_h200.jsonl)
    _TUNED[("fwd", _d)] = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2) if _big else
                           dict(BLOCK_M=128, BLOCK_N=128 if _d > 64 else 64, num_warps=8, num_stages=3))
    _TUNED[("dkdv", _d)] = (dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1) if _big else
                            dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3))
    _TUNED[("dq", _d)] = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1) if _big else
                          dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))


def _d_pad(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


class Geometry:
    """Launch geometry of one dense call or one dilated branch."""

    def __init__(self, sq, sk, *, w=None, r=1, causal=False, window=(-1, -1), q_offset=0, cu_seqlens=None,
                 max_seqlen=None):
        self.dilated = w is not None
        self.varlen = cu_seqlens is not None
        self.cu = cu_seqlens
        self.causal, self.window, self.q_offset = causal, window, q_offset
        self.sq, self.sk = sq, sk
        if self.varlen:
            self.w, self.r, self.nfull, self.tail = sq, 1, 1, 0
            self.nseg = cu_seqlens.numel() - 1
            self.max_m = self.max_mk = max_seqlen
        elif self.dilated:
            self.w, self.r = w, r
            self.nfull, self.tail = sq // w, sq % w
            self.nseg = self.nfull + (1 if self.tail else 0)
            self.max_m = -(-min(w, sq) // r)
            self.max_mk = self.max_m
        else:
            self.w, self.r, self.nfull, self.tail, self.nseg = sq, 1, 1, 0, 1
            self.max_m, self.max_mk = sq, sk

    def scalars(self):
        left, right = self.window
        return (self.sq, self.sk, self.w, self.r, self.nfull, self.tail, self.q_offset, max(left, 0),
                max(right, 0))

    def flags(self):
        return dict(CAUSAL=self.causal, HAS_LEFT=self.window[0] >= 0, HAS_RIGHT=self.window[1] >= 0,
                    DILATED=self.dilated, VARLEN=self.varlen)

    def cu_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.cu if self.varlen else like


def _ieee(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32


def _kernel(kernel, x: torch.Tensor):
    """The kernel to launch: directly on real tensors; through ``wrap_triton``
    while make_fx / torch.compile trace a ``triton_op`` (fake or functional
    tensors), so the traced graph holds the kernel itself, not an opaque call."""
    if type(x) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def launch_forward(q, k, v, out, lse, geo: Geometry, scale: float, merge: bool):
    def trial(cfg, nseg):  # the autotuner's run: the first nseg segments into scratch
        o, l = _scratch(out, geo, nseg), _scratch_lse(lse, geo, nseg)
        # merging, as most branches do (its epilogue moves the best tile)
        _forward(q, k, v, o, l, geo, scale, True, cfg, nseg)

    _forward(q, k, v, out, lse, geo, scale, merge, _config("fwd", q, k, geo, trial), geo.nseg)


def _forward(q, k, v, out, lse, geo, scale, merge, cfg, nseg):
    b, _, h, d = q.shape
    grid = (triton.cdiv(geo.max_m, cfg["BLOCK_M"]), b * h, nseg)
    # CU is only read under VARLEN; otherwise any read-only tensor (never an
    # output: traced launches must not see an output passed twice)
    _kernel(_fwd_kernel, q)[grid](
        q, k, v, out, lse, geo.cu_arg(q), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), h, h // k.shape[2], *geo.scalars(), scale * LOG2E,
        D=d, D_PAD=_d_pad(d), MERGE=merge, IEEE=_ieee(q), **geo.flags(), **cfg)


def launch_preprocess(out, dout, dlse, delta):
    b, s, h, d = out.shape
    block = 16 if out.device.type == "cpu" else 64
    grid = (triton.cdiv(s, block), b * h)
    _kernel(_bwd_preprocess, out)[grid](
        out, dout, dlse if dlse is not None else out, delta, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), delta.stride(0), delta.stride(1), h, s, D=d,
        D_PAD=_d_pad(d), BLOCK=block, HAS_DLSE=dlse is not None)


def launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo: Geometry, scale: float, accum: bool):
    def trial_dkdv(cfg, nseg):
        _dkdv(q, k, v, dout, lse, delta, _scratch(dk, geo, nseg), _scratch(dv, geo, nseg), geo, scale, False,
              cfg, nseg)

    def trial_dq(cfg, nseg):
        _dq(q, k, v, dout, lse, delta, _scratch(dq, geo, nseg), geo, scale, False, cfg, nseg)

    _dkdv(q, k, v, dout, lse, delta, dk, dv, geo, scale, accum, _config("dkdv", q, k, geo, trial_dkdv), geo.nseg)
    _dq(q, k, v, dout, lse, delta, dq, geo, scale, accum, _config("dq", q, k, geo, trial_dq), geo.nseg)


def _dkdv(q, k, v, dout, lse, delta, dk, dv, geo, scale, accum, cfg, nseg):
    b, _, h, d = q.shape
    hkv = k.shape[2]
    ncls = geo.r if geo.dilated else 1
    _kernel(_dkdv_kernel, q)[(triton.cdiv(geo.max_mk, cfg["BLOCK_N"]), b * hkv * ncls, nseg)](
        q, k, v, dout, lse, delta, dk, dv, geo.cu_arg(q), q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), lse.stride(0), lse.stride(1), dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0),
        dv.stride(1), dv.stride(2), h, hkv, h // hkv, ncls, *geo.scalars(), scale, scale * LOG2E,
        D=d, D_PAD=_d_pad(d), ACCUM=accum, IEEE=_ieee(q), **geo.flags(), **cfg)


def _dq(q, k, v, dout, lse, delta, dq, geo, scale, accum, cfg, nseg):
    b, _, h, d = q.shape
    _kernel(_dq_kernel, q)[(triton.cdiv(geo.max_m, cfg["BLOCK_M"]), b * h, nseg)](
        q, k, v, dout, lse, delta, dq, geo.cu_arg(q), q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), lse.stride(0), lse.stride(1), dq.stride(0), dq.stride(1), dq.stride(2), h,
        h // k.shape[2], *geo.scalars(), scale, scale * LOG2E,
        D=d, D_PAD=_d_pad(d), ACCUM=accum, IEEE=_ieee(q), **geo.flags(), **cfg)


class GroupedPlan:
    """The grouped schedule of a dilated call (see the kernels' note), or
    ``None`` from :meth:`of` where branches do not nest. A branch whose segment
    covers the sequence is given the segment ``W0 * ceil(S / W0)`` (same
    selection: one segment)."""

    def __init__(self, seqlen, w0, r0, segs, rates, causal):
        self.sq, self.w, self.r0, self.causal = seqlen, w0, r0, causal
        self.segs, self.rates = segs, rates
        self.dilated, self.nseg, self.max_m = True, -(-seqlen // w0), w0 // r0

    @staticmethod
    def of(seqlen, segment_lengths, dilation_rates, causal):
        r0 = max(dilation_rates)
        finite = [w for w in segment_lengths if w < seqlen]
        w0 = min(finite) if finite else r0 * -(-seqlen // r0)
        whole = w0 * -(-seqlen // w0)
        segs = [w if w < seqlen else whole for w in segment_lengths]
        if any(r0 % r for r in dilation_rates) or w0 % r0 or any(w % w0 for w in segs):
            return None
        return GroupedPlan(seqlen, w0, r0, segs, list(dilation_rates), causal)

    def table(self, device) -> torch.Tensor:
        """int32: (w, r) per branch, then the class offsets from a head's own
        class, by decreasing number of branches that select them."""
        order = sorted(range(self.r0), key=lambda o: -sum(o % r == 0 for r in self.rates))
        return torch.tensor([x for wr in zip(self.segs, self.rates) for x in wr] + order, dtype=torch.int32,
                            device=device)


def launch_grouped_forward(q, k, v, out, lse, plan: GroupedPlan, scale: float):
    br = plan.table(q.device)

    def trial(cfg, nseg):
        _grouped_forward(q, k, v, _scratch(out, plan, nseg), _scratch_lse(lse, plan, nseg), br, plan, scale, cfg,
                         nseg)

    _grouped_forward(q, k, v, out, lse, br, plan, scale, _config("grouped_fwd", q, k, plan, trial), plan.nseg)


def _grouped_forward(q, k, v, out, lse, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    grid = (triton.cdiv(plan.max_m, cfg["BLOCK_M"]), b * h, nseg * plan.r0)
    _kernel(_grouped_fwd_kernel, q)[grid](
        q, k, v, out, lse, br, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), lse.stride(0),
        lse.stride(1), h, h // k.shape[2], plan.sq, plan.w, plan.r0, nseg, scale * LOG2E, NB=len(plan.segs), D=d,
        D_PAD=_d_pad(d), CAUSAL=plan.causal, IEEE=_ieee(q), **cfg)


def launch_grouped_backward(q, k, v, dout, lse, delta, dq, dk, dv, plan: GroupedPlan, scale: float):
    br = plan.table(q.device)

    def trial_dkdv(cfg, nseg):
        _grouped_dkdv(q, k, v, dout, lse, delta, _scratch(dk, plan, nseg), _scratch(dv, plan, nseg), br, plan,
                      scale, cfg, nseg)

    def trial_dq(cfg, nseg):
        _grouped_dq(q, k, v, dout, lse, delta, _scratch(dq, plan, nseg), br, plan, scale, cfg, nseg)

    _grouped_dkdv(q, k, v, dout, lse, delta, dk, dv, br, plan, scale, _config("grouped_dkdv", q, k, plan, trial_dkdv),
                  plan.nseg)
    _grouped_dq(q, k, v, dout, lse, delta, dq, br, plan, scale, _config("grouped_dq", q, k, plan, trial_dq),
                plan.nseg)


def _grouped_dkdv(q, k, v, dout, lse, delta, dk, dv, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    hkv = k.shape[2]
    _kernel(_grouped_dkdv_kernel, q)[(triton.cdiv(plan.max_m, cfg["BLOCK_N"]), b * hkv, nseg * plan.r0)](
        q, k, v, dout, lse, delta, dk, dv, br, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        lse.stride(0), lse.stride(1), dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1),
        dv.stride(2), h, hkv, h // hkv, plan.sq, plan.w, plan.r0, nseg, scale, scale * LOG2E, NB=len(plan.segs), D=d,
        D_PAD=_d_pad(d), CAUSAL=plan.causal, IEEE=_ieee(q), **cfg)


def _grouped_dq(q, k, v, dout, lse, delta, dq, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    _kernel(_grouped_dq_kernel, q)[(triton.cdiv(plan.max_m, cfg["BLOCK_M"]), b * h, nseg * plan.r0)](
        q, k, v, dout, lse, delta, dq, br, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        lse.stride(0), lse.stride(1), dq.stride(0), dq.stride(1), dq.stride(2), h, h // k.shape[2], plan.sq,
        plan.w, plan.r0, nseg, scale, scale * LOG2E, NB=len(plan.segs), D=d, D_PAD=_d_pad(d), CAUSAL=plan.causal,
        IEEE=_ieee(q), **cfg)

# ---------------------------------------------------------------------- autotuning
# Dilated launches pick their tiles per (kind, device, dtype, head dim, GQA group,
# rows per segment class and batch x heads x segments, each rounded up to a power
# of two, causal): the first call of a new shape times the candidates below on
# scratch buffers (the real outputs are accumulated in place, so a trial must
# not touch them) and keeps the fastest for the process. The grid's size is in
# the key because small grids fill the GPU only with small tiles (one H100: at
# 32K the LongNet branches of 1-2 segments ran faster with 64-row tiles, at 128K
# slower). A trial covers all segments up to _TUNE_SCRATCH_BYTES of scratch.
# Dense and varlen launches and LONGATTN_TRITON_AUTOTUNE=0 use the static
# table (_TUNED); calls under torch.compile tracing or CUDA-graph capture use a
# choice made before (in this process or saved), else the static table. Choices
# persist in $LONGATTN_CACHE_DIR/triton_tiles.json (default ~/.cache/longattn),
# keyed also by the GPU's name, the Triton version and a hash of this file:
# tuning compiles every candidate for every branch (one H100, five candidates
# per kind: 1.5 min for the LongNet branches' first fwd+bwd at 32K, 4-5x the
# untuned first call) and is paid once per machine.
_C = lambda m, n, w, s: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
_CANDIDATES = {  # head dims <= 128: the tiles the autotuner chose on one H100 over the LongNet,
    # GQA, D=64 and short-segment cases (triton_autotune_ab_h100_8da1ef7.json), out of the
    # H200 sweep's five per kind (benchmarks/tune_triton.py); fewer candidates, less tuning
    "fwd": [_C(128, 128, 8, 3), _C(128, 64, 8, 3), _C(64, 64, 4, 3), _C(128, 32, 4, 4)],
    "dkdv": [_C(32, 64, 4, 3), _C(32, 128, 4, 3), _C(64, 128, 8, 3)],
    "dq": [_C(128, 64, 8, 3), _C(128, 32, 4, 3), _C(64, 32, 4, 3)],
}
_CPU_CANDIDATES = [_C(16, 16, 4, 1), _C(32, 16, 4, 1), _C(16, 32, 4, 1)]  # the interpreter (tests)
_TUNE_SCRATCH_BYTES = 256 << 20
_by_shape: dict = {}
_on_disk: Optional[dict] = None  # the persisted choices, loaded on first need
_SOURCE = hashlib.sha1(open(__file__, "rb").read()).hexdigest()[:12]


def autotune_mode() -> str:
    """``LONGATTN_TRITON_AUTOTUNE``: ``0`` off, ``1`` on (also under the CPU
    interpreter: tests), unset: on for CUDA."""
    return os.environ.get("LONGATTN_TRITON_AUTOTUNE", "")


def _autotune_on(q: torch.Tensor) -> bool:
    mode = autotune_mode()
    return mode == "1" or (mode != "0" and q.is_cuda)


def _can_time(q: torch.Tensor) -> bool:
    """Real tensors, outside tracing and CUDA-graph capture."""
    if type(q) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return False
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _candidates(kind: str, d: int, device: torch.device, geo: Geometry) -> list[dict]:
    if device.type == "cpu":
        return list(_CPU_CANDIDATES)
    if d > 128:
        return [_blocks(d, device, kind)]
    rows = 1 << max(4, (max(geo.max_m, 1) - 1).bit_length())
    cands = _CANDIDATES[kind.removeprefix("grouped_")]
    fit = [c for c in cands if c["BLOCK_M"] <= rows and c["BLOCK_N"] <= rows]
    return fit or [min(cands, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"])]


def _tune_key(kind, q, k, geo):
    pow2 = lambda n: (max(n, 1) - 1).bit_length()
    return (kind, str(q.device), q.dtype, q.shape[-1], q.shape[2] // k.shape[2], pow2(geo.max_m),
            pow2(q.shape[0] * q.shape[2] * geo.nseg), geo.causal)


def _config(kind: str, q, k, geo: Geometry, trial) -> dict:
    """The launch config of a kernel (see the autotuning note above)."""
    static = _blocks(q.shape[-1], q.device, kind)
    if geo.dilated and max(static["BLOCK_M"], static["BLOCK_N"]) > 1 << max(4, (geo.max_m - 1).bit_length()):
        static = _candidates(kind, q.shape[-1], q.device, geo)[0]  # tiles no larger than the rows
    if not geo.dilated or not _autotune_on(q):
        return static
    key = _tune_key(kind, q, k, geo)
    cfg = _by_shape.get(key)
    if cfg is None:
        disk = _disk_key(key, q.device)
        cfg = _persisted().get(disk)
        if cfg is None and _can_time(q):
            _announce_tuning()
            cfg = _autotune(_candidates(kind, q.shape[-1], q.device, geo), trial, _trial_segments(q, geo),
                            q.device) or static
            _persist(disk, cfg)
        if cfg is not None:
            _by_shape[key] = cfg
    return cfg or static


_announced = False


def _announce_tuning() -> None:
    """Once per process: a first call that stalls for a minute says why."""
    global _announced
    if not _announced:
        _announced = True
        warnings.warn("longattn: autotuning the fused Triton dilated kernels' tiles for a new shape (a minute or "
                      f"two, once per machine: saved to {_cache_file()}); LONGATTN_TRITON_AUTOTUNE=0 skips it",
                      stacklevel=3)


def _cache_file() -> str:
    root = os.environ.get("LONGATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "longattn")
    return os.path.join(root, "triton_tiles.json")


def _disk_key(key, device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([name, triton.__version__, _SOURCE, key[0], str(key[2]), *key[3:]])


def _persisted() -> dict:
    global _on_disk
    if _on_disk is None:
        try:
            with open(_cache_file()) as fh:
                _on_disk = json.load(fh)
        except (OSError, ValueError):
            _on_disk = {}
    return _on_disk


def _persist(disk_key: str, cfg: dict) -> None:
    """Adds one choice to the cache file (re-read first: other processes may
    have added theirs), written atomically."""
    global _on_disk
    path = _cache_file()
    _on_disk = None
    merged = dict(_persisted(), **{disk_key: cfg})
    _on_disk = merged
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(merged, fh, indent=0)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"longattn: cannot save Triton tile choices to {path} ({e}); set LONGATTN_CACHE_DIR")


def _trial_segments(q, geo: Geometry) -> int:
    """Segments a trial runs: all of them (the real grid), or as many as
    _TUNE_SCRATCH_BYTES of output scratch hold (grids that large are many
    waves; the first segments stand for the rest)."""
    if q.device.type == "cpu":
        return 1
    per_seg = q.shape[0] * min(geo.w, geo.sq) * q.shape[2] * q.shape[3] * q.element_size()
    return max(1, min(geo.nseg, _TUNE_SCRATCH_BYTES // per_seg))


def _autotune(cands: list[dict], trial, nseg: int, device: torch.device) -> Optional[dict]:
    if len(cands) == 1:
        return cands[0]
    best = None
    for cfg in cands:
        try:
            t = _time(lambda: trial(cfg, nseg), device)
        except triton.runtime.errors.OutOfResources:  # this tile does not fit the device: not a candidate
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return None if best is None else best[1]


def _time(fn, device: torch.device) -> float:
    """Fastest of five runs after one warm-up (compiles) run, in ms."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return min(times)


def _trial_rows(geo: Geometry, nseg: int) -> int:
    return min(geo.sq, nseg * geo.w)


def _scratch(x: torch.Tensor, geo: Geometry, nseg: int) -> torch.Tensor:
    """(B, rows of the first nseg segments, H, D) buffer like x."""
    return torch.zeros((x.shape[0], _trial_rows(geo, nseg), *x.shape[2:]), dtype=x.dtype, device=x.device)


def _scratch_lse(lse: torch.Tensor, geo: Geometry, nseg: int) -> torch.Tensor:
    return torch.full((*lse.shape[:2], _trial_rows(geo, nseg)), float("-inf"), dtype=lse.dtype, device=lse.device)


def _contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


# -------------------------------------------------------------- dense block backend
def forward(q, k, v, spec):
    """Dense block forward for the ``triton`` backend (see longattn.backends)."""
    q, k, v = _contig(q), _contig(k), _contig(v)
    b, sq, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    geo = Geometry(sq, k.shape[1], causal=spec.causal, window=spec.window, q_offset=spec.q_offset)
    launch_forward(q, k, v, out, lse, geo, spec.scale, merge=False)
    return out, lse


def backward(dout, q, k, v, out, lse, spec, dlse=None):
    q, k, v, dout, out = (_contig(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    launch_preprocess(out, dout, None if dlse is None else dlse.float().contiguous(), delta)
    dq = torch.empty_like(q)
    # GQA: a kv head's program loops over its query heads, so dK/dV are
    # written once, in the input dtype, with no reduction pass.
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    geo = Geometry(q.shape[1], k.shape[1], causal=spec.causal, window=spec.window, q_offset=spec.q_offset)
    launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo, spec.scale, accum=False)
    return dq, dk, dv


def varlen_forward(q, k, v, cu_seqlens, max_seqlen, spec):
    """q (total, H, D), k/v (total, Hkv, D); returns out and lse (H, total)."""
    q4, k4, v4 = (_contig(t).unsqueeze(0) for t in (q, k, v))
    out = torch.empty_like(q4)
    lse = torch.empty(1, q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    geo = Geometry(q.shape[0], k.shape[0], causal=spec.causal, window=spec.window, cu_seqlens=cu_seqlens,
                   max_seqlen=max_seqlen)
    launch_forward(q4, k4, v4, out, lse, geo, spec.scale, merge=False)
    return out[0], lse[0]


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, spec, dlse=None):
    q4, k4, v4, do4, o4 = (_contig(t).unsqueeze(0) for t in (q, k, v, dout, out))
    lse4 = lse.contiguous().unsqueeze(0)
    delta = torch.empty_like(lse4)
    launch_preprocess(o4, do4, None if dlse is None else dlse.float().contiguous().unsqueeze(0), delta)
    dq, dk, dv = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)
    geo = Geometry(q.shape[0], k.shape[0], causal=spec.causal, window=spec.window, cu_seqlens=cu_seqlens,
                   max_seqlen=max_seqlen)
    launch_backward(q4, k4, v4, do4, lse4, delta, dq, dk, dv, geo, spec.scale, accum=False)
    return dq[0], dk[0], dv[0]


del math
