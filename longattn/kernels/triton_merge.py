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
