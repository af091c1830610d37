"""Rows against a few keys that every one of them sees (a shard's rows
against the global tokens' keys), merged into a running (out, lse) and added
into a running dQ in place: the passes of the exchange's few-keys pieces
(:class:`longattn.flex.pieces.FewKeys`).

Shapes: q, out, dout, dq (B, N, H, D) and k, v (B, G, Hkv, D), any strides
with a unit last one (views of the shard and of the received halo); lse, dlse
(B, H, N) float32 views; G small (the keys of a few 128-key blocks). GQA from
the head counts.

* :func:`forward_into`: (out, lse) <- merge((out, lse), attention(q, k, v)).
  One launch: a program holds a tile of rows of one head, runs over every key
  in an online softmax and merges into out and lse (float32 arithmetic, out
  rounded once to its dtype; rows with lse -inf take the new result).
* :func:`backward_into`: dq += the rows' dQ against k, v from the merged out,
  lse (and dlse: delta = rowsum(dO * O) - dlse); returns dK, dV (B, G, Hkv,
  D) float32. One launch over row tiles computes delta, P and dS, adds dQ
  into ``dq`` and stores P and dS in the input dtype (as flash attention's
  backward rounds them for its matmuls); dV = P^T dO and dK = dS^T Q are
  batched GEMMs (float32 accumulation and output). With G keys that is a
  GEMM of depth N per (batch, head): a key's programs never chain over the
  rows, which a flash backward would (one program per key tile over every
  row tile).

Equivalent PyTorch (one head, no GQA)::

    s = q @ k.T * scale
    lse_g = s.logsumexp(-1); o_g = s.softmax(-1) @ v
    lse_new = logaddexp(lse, lse_g)
    out = out * exp(lse - lse_new) + o_g * exp(lse_g - lse_new); lse = lse_new
    # backward, from the merged out and lse
    p = exp(s - lse[:, None]); dp = dout @ v.T
    ds = p * (dp - (dout * out).sum(-1, keepdim=True) + dlse[:, None])
    dq += ds @ k * scale; dk = ds.T @ q * scale; dv = p.T @ dout
"""
from __future__ import annotations

import torch

from ._common import HAS_TRITON, LOG2E, d_pad

BLOCK_M = 64
"""Rows per program. One H200, 64K rows x 128 keys, H=16, D=128, bf16 (``benchmarks/few_keys_ab.py``): forward
0.45 ms with 64 rows against 0.75 with 128 and 0.76 with 32."""
BLOCK_N = 32
"""Keys per step of a row program. Same run: the backward's row launch 0.71 ms with 32 keys against 0.97 with 64
(``few_keys_ab_h200_c07fcc6.json``)."""

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .attention_jit import _lse_merge

    @triton.jit
    def _tile(X, rows, n, stride, D: tl.constexpr, D_PAD: tl.constexpr):
        """Rows ``rows`` of one (batch, head) of X (its base given, row stride ``stride``): (len(rows), D_PAD),
        zeros at and past row ``n`` and past column D."""
        d = tl.arange(0, D_PAD)
        return tl.load(X + rows.to(tl.int64)[:, None] * stride + d[None, :],
                       mask=(rows < n)[:, None] & (d < D)[None, :], other=0.0)

    @triton.jit
    def _program(N, GROUP: tl.constexpr, BM: tl.constexpr):
        """A row program's batch, head, kv head, rows and their mask."""
        b = tl.program_id(2).to(tl.int64)
        h = tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        return b, h, h // GROUP, rows, rows < N

    @triton.jit
    def _fwd_merge(Q, K, V, O, L, scale_log2, N, G, sqb, sqn, sqh, skb, skn, skh, svb, svn, svh, sob, son, soh,
                   slb, slh, sln, GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, IEEE: tl.constexpr):
        b, h, kvh, rows, rm = _program(N, GROUP, BM)
        q = _tile(Q + b * sqb + h * sqh, rows, N, sqn, D, D_PAD)
        kb, vb = K + b * skb + kvh * skh, V + b * svb + kvh * svh
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D_PAD], tl.float32)
        for start in range(0, G, BN):
            cols = start + tl.arange(0, BN)
            k, v = _tile(kb, cols, G, skn, D, D_PAD), _tile(vb, cols, G, svn, D, D_PAD)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2
            s = tl.where((cols < G)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile's first column is a key
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        d = tl.arange(0, D_PAD)
        msk = rm[:, None] & (d < D)[None, :]
        o_ptr = O + b * sob + h * soh + rows.to(tl.int64)[:, None] * son + d[None, :]
        l_ptr = L + b * slb + h * slh + rows.to(tl.int64) * sln
        res, lse = _lse_merge(tl.load(o_ptr, mask=msk, other=0.0), tl.load(l_ptr, mask=rm, other=float("-inf")),
                              acc / l_i[:, None], (m_i + tl.log2(l_i)) * 0.6931471805599453)
        tl.store(o_ptr, res.to(O.dtype.element_ty), mask=msk)
        tl.store(l_ptr, lse, mask=rm)

    @triton.jit
    def _bwd_rows(Q, K, V, O, DO, L, DL, DQ, PS, scale, scale_log2, N, G, sqb, sqn, sqh, skb, skn, skh,
                  svb, svn, svh, sob, son, soh, sdb, sdn, sdh, sgb, sgn, sgh, slb, slh, sln, sdlb, sdlh, sdln,
                  GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  HAS_DLSE: tl.constexpr, IEEE: tl.constexpr):
        """dQ of rows [BM] of head h added into DQ; P and dS stored to PS (2, B, H, N, G)."""
        b, h, kvh, rows, rm = _program(N, GROUP, BM)
        H = tl.num_programs(1)
        r64 = rows.to(tl.int64)
        q = _tile(Q + b * sqb + h * sqh, rows, N, sqn, D, D_PAD)
        do = _tile(DO + b * sdb + h * sdh, rows, N, sdn, D, D_PAD)
        delta = tl.sum(do.to(tl.float32) * _tile(O + b * sob + h * soh, rows, N, son, D, D_PAD).to(tl.float32), 1)
        if HAS_DLSE:
            delta -= tl.load(DL + b * sdlb + h * sdlh + r64 * sdln, mask=rm, other=0.0)
        # a row with lse -inf saw no key anywhere: p = exp2(s - inf) = 0
        lse2 = tl.load(L + b * slb + h * slh + r64 * sln, mask=rm, other=float("inf")) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
        kb, vb = K + b * skb + kvh * skh, V + b * svb + kvh * svh
        ps = PS + ((b * H + h) * N + r64[:, None]) * G
        half = (tl.num_programs(2) * H * N).to(tl.int64) * G  # dS after every P
        dq = tl.zeros([BM, D_PAD], tl.float32)
        for start in range(0, G, BN):
            cols = start + tl.arange(0, BN)
            cm = cols < G
            k, v = _tile(kb, cols, G, skn, D, D_PAD), _tile(vb, cols, G, svn, D, D_PAD)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(v), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(v))
            p = tl.where(cm[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if IEEE:
                dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
            else:
                dq += tl.dot(ds.to(k.dtype), k)
            keep = rm[:, None] & cm[None, :]
            tl.store(ps + cols[None, :], p.to(PS.dtype.element_ty), mask=keep)
            tl.store(ps + half + cols[None, :], ds.to(PS.dtype.element_ty), mask=keep)
        d = tl.arange(0, D_PAD)
        at = DQ + b * sgb + h * sgh + r64[:, None] * sgn + d[None, :]
        msk = rm[:, None] & (d < D)[None, :]
        old = tl.load(at, mask=msk, other=0.0).to(tl.float32)
        tl.store(at, (old + dq * scale).to(DQ.dtype.element_ty), mask=msk)


def _check(q, k, v, out, lse, **more):
    strided = [n for n, x in dict(q=q, k=k, v=v, out=out, **more).items() if x.stride(-1) != 1]
    if strided:
        raise ValueError(f"few keys: {', '.join(strided)} must have a unit stride in the head dim (pass "
                         f".contiguous() copies)")
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[2] % k.shape[2]:
        raise ValueError(f"few keys: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want (B, N, H, D) "
                         f"and (B, G, Hkv, D) with H a multiple of Hkv")
    if out.shape != q.shape or lse.shape != (q.shape[0], q.shape[2], q.shape[1]) or lse.dtype != torch.float32:
        raise ValueError(f"few keys: out {tuple(out.shape)}, lse {tuple(lse.shape)} {lse.dtype}: want q's shape "
                         f"and (B, H, N) float32")


def _ieee(q) -> bool:
    """float32 inputs keep float32 products (the interpreter's tests; a GPU's dot would round to tf32)."""
    return q.dtype == torch.float32


def forward_into(q, k, v, out, lse, scale: float) -> None:
    """(out, lse) <- merge((out, lse), attention(q, k, v)) in place (see the module docstring)."""
    _check(q, k, v, out, lse)
    b, n, h, d = q.shape
    if n == 0:
        return
    g = k.shape[1]
    _fwd_merge[(triton.cdiv(n, BLOCK_M), h, b)](
        q, k, v, out, lse, scale * LOG2E, n, g, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *out.stride()[:3], *lse.stride(), GROUP=h // k.shape[2], D=d, D_PAD=d_pad(d), BM=BLOCK_M, BN=BLOCK_N,
        IEEE=_ieee(q), num_warps=4)


def _bmm32(a, b):
    """a @ b batched, float32 out: cuBLAS accumulates in float32 and writes it (no rounding to the inputs' dtype)."""
    return torch.bmm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.bmm(a.float(), b.float())


def backward_into(dout, q, k, v, out, lse, dlse, dq, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dq += the rows' dQ; returns (dK, dV) (B, G, Hkv, D) float32 (see the module docstring)."""
    _check(q, k, v, out, lse, dout=dout, dq=dq)
    b, n, h, d = q.shape
    g, hkv = k.shape[1], k.shape[2]
    grouped = lambda x: x.view(b, hkv, h // hkv, g, d).sum(2).transpose(1, 2)  # (B, H, G, D) -> (B, G, Hkv, D)
    if n == 0:
        z = torch.zeros(b, g, hkv, d, dtype=torch.float32, device=q.device)
        return z, z.clone()
    ps = torch.empty(2, b, h, n, g, dtype=q.dtype, device=q.device)
    dl = lse if dlse is None else dlse
    _bwd_rows[(triton.cdiv(n, BLOCK_M), h, b)](
        q, k, v, out, dout, lse, dl, dq, ps, scale, scale * LOG2E, n, g, *q.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *out.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], *lse.stride(), *dl.stride(),
        GROUP=h // hkv, D=d, D_PAD=d_pad(d), BM=BLOCK_M, BN=BLOCK_N, HAS_DLSE=dlse is not None, IEEE=_ieee(q),
        num_warps=4)
    # per batch row: (H, G, N) @ (H, N, D), the rows' head-major views of dout and q (no copies)
    per_row = lambda j, x: [_bmm32(ps[j, i].transpose(1, 2), x[i].transpose(0, 1)) for i in range(b)]
    rows = lambda xs: xs[0][None] if b == 1 else torch.stack(xs)
    dv, dk = rows(per_row(0, dout)), rows(per_row(1, q)).mul_(scale)
    return grouped(dk), grouped(dv)
