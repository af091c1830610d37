"""One-pass lse merge of a partial attention result into strided views.

(out, lse) <- merge((out, lse), (out_b, lse_b)) for tensors laid out as
(N, M, Hc, D) / (N, M, Hc) with any strides (views of (B, S, H, D) outputs):
the arithmetic in float32 registers, ``out`` stored in its own dtype (one
rounding per merge). The same stable form as :func:`longattn._merge.merge_`;
rows where neither side saw a key keep output 0 and lse -inf.
"""
from __future__ import annotations

import torch

from .triton_attention import HAS_TRITON, _d_pad, available

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_attention import _lse_merge

    @triton.jit
    def _merge_kernel(O, L, OB, LB, so0, so1, so2, sl0, sl1, sl2, sb0, sb1, sb2, slb0, slb1, slb2, M, HC,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nh = tl.program_id(1)
        n = (nh // HC).to(tl.int64)
        hc = (nh % HC).to(tl.int64)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        rm = rows < M
        r64 = rows.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        msk = rm[:, None] & (offs_d < D)[None, :]
        l_ptr = L + n * sl0 + r64 * sl1 + hc * sl2
        o_ptr = O + n * so0 + r64[:, None] * so1 + hc * so2 + offs_d[None, :]
        res, lse = _lse_merge(tl.load(o_ptr, mask=msk, other=0.0), tl.load(l_ptr, mask=rm, other=float("-inf")),
                              tl.load(OB + n * sb0 + r64[:, None] * sb1 + hc * sb2 + offs_d[None, :], mask=msk,
                                      other=0.0),
                              tl.load(LB + n * slb0 + r64 * slb1 + hc * slb2, mask=rm, other=float("-inf")))
        tl.store(o_ptr, res.to(O.dtype.element_ty), mask=msk)
        tl.store(l_ptr, lse, mask=rm)


    @triton.jit
    def _add_tile(X, Y, sx0, sx1, sx2, sy0, sy1, sy2, n, hc, r64, offs_d, msk):
        x_ptr = X + n * sx0 + r64[:, None] * sx1 + hc * sx2 + offs_d[None, :]
        y = tl.load(Y + n * sy0 + r64[:, None] * sy1 + hc * sy2 + offs_d[None, :], mask=msk, other=0.0)
        tl.store(x_ptr, (tl.load(x_ptr, mask=msk, other=0.0).to(tl.float32) + y.to(tl.float32)).to(X.dtype.element_ty),
                 mask=msk)

    @triton.jit
    def _add_kernel(X0, Y0, X1, Y1, X2, Y2, s00, s01, s02, t00, t01, t02, s10, s11, s12, t10, t11, t12,
                    s20, s21, s22, t20, t21, t22, M, HC, NPAIR: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nh = tl.program_id(1)
        n = (nh // HC).to(tl.int64)
        hc = (nh % HC).to(tl.int64)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        r64 = rows.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        msk = (rows < M)[:, None] & (offs_d < D)[None, :]
        _add_tile(X0, Y0, s00, s01, s02, t00, t01, t02, n, hc, r64, offs_d, msk)
        if NPAIR > 1:
            _add_tile(X1, Y1, s10, s11, s12, t10, t11, t12, n, hc, r64, offs_d, msk)
        if NPAIR > 2:
            _add_tile(X2, Y2, s20, s21, s22, t20, t21, t22, n, hc, r64, offs_d, msk)


def usable(x: torch.Tensor) -> bool:
    return HAS_TRITON and available(x.device) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """out, out_b: (N, M, Hc, D) with unit stride in D; lse, lse_b: (N, M, Hc) float32."""
    n, m, hc, d = out.shape
    assert out.stride(-1) == 1 and out_b.stride(-1) == 1
    block = 16 if out.device.type == "cpu" else 64
    grid = (triton.cdiv(m, block), n * hc)
    _merge_kernel[grid](out, lse, out_b, lse_b, *out.stride()[:3], *lse.stride(), *out_b.stride()[:3],
                                 *lse_b.stride(), m, hc, D=d, D_PAD=_d_pad(d), BLOCK=block,
                                 num_warps=4 if d <= 128 else 8)


def add_into(dsts, srcs) -> None:
    """dst += src for up to three pairs of (N, M, Hc, D) tensors of one shape,
    any strides with unit stride in D, in one launch: float32 arithmetic, one
    rounding into the dst dtype. torch's own add on such strided views runs a
    generic element-wise kernel (no vector loads): the dilated backward's
    gradient accumulation took 2.6 ms of 17 at 128K causal that way."""
    assert 1 <= len(dsts) == len(srcs) <= 3
    n, m, hc, d = dsts[0].shape
    for x, y in zip(dsts, srcs):
        assert x.shape == y.shape == dsts[0].shape and x.stride(-1) == 1 and y.stride(-1) == 1
    pairs = list(zip(dsts, srcs))
    pairs += [pairs[0]] * (3 - len(pairs))  # unused slots (NPAIR guards them)
    args, strides = [], []
    for x, y in pairs:
        args += [x, y]
        strides += [*x.stride()[:3], *y.stride()[:3]]
    block = 16 if dsts[0].device.type == "cpu" else 64
    grid = (triton.cdiv(m, block), n * hc)
    _add_kernel[grid](*args, *strides, m, hc, NPAIR=len(dsts), D=d, D_PAD=_d_pad(d), BLOCK=block,
                      num_warps=4 if d <= 128 else 8)
