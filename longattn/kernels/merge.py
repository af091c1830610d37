"""One-pass lse merge of a partial attention result into strided views.

(out, lse) <- merge((out, lse), (out_b, lse_b)) for tensors laid out as
(N, M, Hc, D) / (N, M, Hc) with any strides (views of (B, S, H, D) outputs):
the arithmetic in float32 registers, ``out`` stored in its own dtype (one
rounding per merge). The same stable form as :func:`longattn._merge.merge_`;
rows where neither side saw a key keep output 0 and lse -inf.
"""
from __future__ import annotations

import torch

from ._common import HAS_TRITON, available, d_pad

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .attention_jit import _lse_merge

    # Every tensor is addressed as (N, R, M, Hc[, D]): N x R programs' worth of
    # rows, so the offset classes of a dilated branch (R of them, rows and
    # heads shifted together: no single stride) go in one launch. 4-D callers
    # pass R = 1.
    @triton.jit
    def _nrh(HC, R):
        nh = tl.program_id(1)
        hc = (nh % HC).to(tl.int64)
        nr = nh // HC
        return (nr // R).to(tl.int64), (nr % R).to(tl.int64), hc

    @triton.jit
    def _merge_kernel(O, L, OB, LB, so0, sor, so1, so2, sl0, slr, sl1, sl2, sb0, sbr, sb1, sb2,
                      slb0, slbr, slb1, slb2, M, HC, R, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
        n, c, hc = _nrh(HC, R)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rm = rows < M
        r64 = rows.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        msk = rm[:, None] & (offs_d < D)[None, :]
        l_ptr = L + n * sl0 + c * slr + r64 * sl1 + hc * sl2
        o_ptr = O + n * so0 + c * sor + r64[:, None] * so1 + hc * so2 + offs_d[None, :]
        ob_ptr = OB + n * sb0 + c * sbr + r64[:, None] * sb1 + hc * sb2 + offs_d[None, :]
        res, lse = _lse_merge(tl.load(o_ptr, mask=msk, other=0.0), tl.load(l_ptr, mask=rm, other=float("-inf")),
                              tl.load(ob_ptr, mask=msk, other=0.0),
                              tl.load(LB + n * slb0 + c * slbr + r64 * slb1 + hc * slb2, mask=rm, other=float("-inf")))
        tl.store(o_ptr, res.to(O.dtype.element_ty), mask=msk)
        tl.store(l_ptr, lse, mask=rm)

    @triton.jit
    def _pair_tile(X, Y, sx0, sxr, sx1, sy0, syr, sy1, n, c, r64, offs_d, msk, ADD: tl.constexpr):
        x_ptr = X + n * sx0 + c * sxr + r64[:, None] * sx1 + offs_d[None, :]
        y = tl.load(Y + n * sy0 + c * syr + r64[:, None] * sy1 + offs_d[None, :], mask=msk, other=0.0)
        if ADD:
            y = tl.load(x_ptr, mask=msk, other=0.0).to(tl.float32) + y.to(tl.float32)
        tl.store(x_ptr, y.to(X.dtype.element_ty), mask=msk)

    @triton.jit
    def _pairs_kernel(X0, Y0, X1, Y1, X2, Y2, s00, s0r, s01, s02, t00, t0r, t01, t02,
                      s10, s1r, s11, s12, t10, t1r, t11, t12, s20, s2r, s21, s22, t20, t2r, t21, t22,
                      M, HC, R, NPAIR: tl.constexpr, ADD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                      BLOCK: tl.constexpr):
        n, c, hc = _nrh(HC, R)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r64 = rows.to(tl.int64)
        offs_d = tl.arange(0, D_PAD)
        msk = (rows < M)[:, None] & (offs_d < D)[None, :]
        # the head offset goes on the base pointers: one multiply per tensor
        _pair_tile(X0 + hc * s02, Y0 + hc * t02, s00, s0r, s01, t00, t0r, t01, n, c, r64, offs_d, msk, ADD)
        if NPAIR > 1:
            _pair_tile(X1 + hc * s12, Y1 + hc * t12, s10, s1r, s11, t10, t1r, t11, n, c, r64, offs_d, msk, ADD)
        if NPAIR > 2:
            _pair_tile(X2 + hc * s22, Y2 + hc * t22, s20, s2r, s21, t20, t2r, t21, n, c, r64, offs_d, msk, ADD)

    @triton.jit
    def _listed_tile(M, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
        # (head, this program's rows as int64, their mask, the head dim's offsets, the tile's mask)
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rm = rows < M
        offs_d = tl.arange(0, D_PAD)
        return tl.program_id(1).to(tl.int64), rows.to(tl.int64), rm, offs_d, rm[:, None] & (offs_d < D)[None, :]

    @triton.jit
    def _stack_kernel(O, L, DST, DL, ROWS, C, M, so0, so1, so2, sl0, sl1, sl2, sd1, sd2, sdl1, sdl2,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr):
        # rows i of head h: the C partials O[j, i, h] merged by their lse L[j, h, i], the result stored at row
        # ROWS[i] of DST (S, H, D) and DL (H, S); the weights from the largest lse, as logsumexp takes them
        h, r64, rm, offs_d, msk = _listed_tile(M, D, D_PAD, BLOCK)
        # the partials' pointers step by their stride (64-bit pointer arithmetic: j * stride in int32 would wrap
        # past 2**31 elements)
        l_ptr = L + h * sl1 + r64 * sl2
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        for _ in range(C):
            mx = tl.maximum(mx, tl.load(l_ptr, mask=rm, other=float("-inf")))
            l_ptr += sl0
        shift = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D_PAD], tl.float32)
        l_ptr = L + h * sl1 + r64 * sl2
        o_ptr = O + r64[:, None] * so1 + h * so2 + offs_d[None, :]
        for _ in range(C):
            w = tl.exp(tl.load(l_ptr, mask=rm, other=float("-inf")) - shift)
            tot += w
            acc += w[:, None] * tl.load(o_ptr, mask=msk, other=0.0).to(tl.float32)
            l_ptr += sl0
            o_ptr += so0
        seen = tot > 0
        den = tl.where(seen, tot, 1.0)
        lse = tl.where(seen, shift + tl.log(den), float("-inf"))  # rows no partial saw: output 0, lse -inf
        dst = tl.load(ROWS + r64, mask=rm, other=0).to(tl.int64)
        tl.store(DST + dst[:, None] * sd1 + h * sd2 + offs_d[None, :], (acc / den[:, None]).to(DST.dtype.element_ty),
                 mask=msk)
        tl.store(DL + h * sdl1 + dst * sdl2, lse, mask=rm)

    @triton.jit
    def _sum_rows_kernel(G, DST, ROWS, C, M, sg0, sg1, sg2, sd1, sd2, D: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK: tl.constexpr):
        # DST[ROWS[i], h] <- sum over j of G[j, i, h], in float32, one rounding
        h, r64, rm, offs_d, msk = _listed_tile(M, D, D_PAD, BLOCK)
        acc = tl.zeros([BLOCK, D_PAD], tl.float32)
        g_ptr = G + r64[:, None] * sg1 + h * sg2 + offs_d[None, :]
        for _ in range(C):  # stepping the pointer: 64-bit arithmetic (see _stack_kernel)
            acc += tl.load(g_ptr, mask=msk, other=0.0).to(tl.float32)
            g_ptr += sg0
        dst = tl.load(ROWS + r64, mask=rm, other=0).to(tl.int64)
        tl.store(DST + dst[:, None] * sd1 + h * sd2 + offs_d[None, :], acc.to(DST.dtype.element_ty), mask=msk)


def usable(x: torch.Tensor) -> bool:
    return HAS_TRITON and available(x.device) and x.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _nrmh(x: torch.Tensor, lse: bool) -> tuple:
    """(N, R, M, Hc) strides of an (N, R, M, Hc[, D]) tensor; 4-D (N, M, Hc, D)
    and 3-D (N, M, Hc) ones have R = 1 (stride 0). Lean: the dilated path
    launches these kernels several times per call and short sequences are
    bound by host time."""
    st = x.stride()
    return st[:4] if len(st) == (4 if lse else 5) else (st[0], 0, st[1], st[2])


def _grid(x: torch.Tensor, block: int):
    sh = x.shape
    if x.dim() == 5:
        return (triton.cdiv(sh[2], block), sh[0] * sh[1] * sh[3]), sh[2], sh[3], sh[1]
    return (triton.cdiv(sh[1], block), sh[0] * sh[2]), sh[1], sh[2], 1


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """out, out_b: (N, M, Hc, D) or (N, R, M, Hc, D), unit stride in D, any
    other strides; lse, lse_b: (N, M, Hc) or (N, R, M, Hc) float32."""
    assert out.shape == out_b.shape and out.stride(-1) == out_b.stride(-1) == 1
    d = out.shape[-1]
    block = 16 if out.device.type == "cpu" else 64
    grid, m, hc, r = _grid(out, block)
    _merge_kernel[grid](out, lse, out_b, lse_b, *_nrmh(out, False), *_nrmh(lse, True), *_nrmh(out_b, False),
                        *_nrmh(lse_b, True), m, hc, r, D=d, D_PAD=d_pad(d), BLOCK=block,
                        num_warps=4 if d <= 128 else 8)


def _pairs(dsts, srcs, add: bool) -> None:
    npair = len(dsts)
    if not 1 <= npair == len(srcs) <= 3:
        raise ValueError(f"dsts and srcs: 1 to 3 pairs, got {npair} and {len(srcs)}")
    args, strides = [], []
    for x, y in zip(dsts, srcs):
        # one grid for every pair: a pair of another shape would be read and
        # written out of its bounds
        if x.shape != dsts[0].shape or y.shape != x.shape:
            raise ValueError(f"every tensor needs the shape {tuple(dsts[0].shape)}, got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}: launch pairs of other shapes separately")
        if x.stride(-1) != 1 or y.stride(-1) != 1:
            raise ValueError("the last dim needs unit stride")
        args += (x, y)
        strides += (*_nrmh(x, False), *_nrmh(y, False))
    if npair < 3:  # unused slots (NPAIR guards them)
        args += args[:2] * (3 - npair)
        strides += strides[:8] * (3 - npair)
    x = dsts[0]
    d = x.shape[-1]
    block = 16 if x.device.type == "cpu" else 64
    grid, m, hc, r = _grid(x, block)
    _pairs_kernel[grid](*args, *strides, m, hc, r, NPAIR=npair, ADD=add, D=d, D_PAD=d_pad(d), BLOCK=block,
                        num_warps=4 if d <= 128 else 8)


def add_into(dsts, srcs) -> None:
    """dst += src for up to three pairs of (N, M, Hc, D) or (N, R, M, Hc, D)
    tensors, all of one shape (ValueError otherwise), any strides with unit
    stride in D, in one launch:
    float32 arithmetic, one rounding into the dst dtype. torch's own add on
    such strided views runs a generic element-wise kernel (no vector loads):
    the dilated backward's gradient accumulation took 2.6 ms of 17 at 128K
    causal that way."""
    _pairs(dsts, srcs, True)


def copy_into(dsts, srcs) -> None:
    """dst <- src for up to three pairs, as :func:`add_into`: the dilated path
    gathers a branch's strided rows into dense blocks with it (one launch)."""
    _pairs(dsts, srcs, False)


def stack_into(out: torch.Tensor, lse: torch.Tensor, parts: torch.Tensor, parts_lse: torch.Tensor,
               rows: torch.Tensor) -> None:
    """In place: ``out[rows]``, ``lse[:, rows]`` <- the c partial results over
    disjoint key sets merged (:func:`longattn._merge.merge_stack`'s result,
    float32 arithmetic, one rounding into ``out``'s dtype), in one launch.

    out: (S, H, D), unit stride in D; lse: (H, S) float32; parts: (c, m, H, D),
    unit stride in D; parts_lse: (c, H, m) float32; rows: (m,) int64 on their
    device, the rows of ``out`` that the parts' m rows are. Equivalent PyTorch::

        o, l = merge_stack(parts, parts_lse.transpose(1, 2))
        out[rows], lse[:, rows] = o.to(out.dtype), l.t()
    """
    c, m, h, d = parts.shape
    assert out.stride(-1) == parts.stride(-1) == 1 and out.shape[1:] == (h, d) and parts_lse.shape == (c, h, m)
    assert lse.dtype == parts_lse.dtype == torch.float32
    block = 16 if out.device.type == "cpu" else 32
    _stack_kernel[(triton.cdiv(m, block), h)](
        parts, parts_lse, out, lse, rows, c, m, *parts.stride()[:3], *parts_lse.stride(), *out.stride()[:2],
        *lse.stride(), D=d, D_PAD=d_pad(d), BLOCK=block, num_warps=4)


def sum_rows_into(dst: torch.Tensor, parts: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: ``dst[rows]`` <- ``parts.sum(0)`` (float32 sum, one rounding
    into ``dst``'s dtype), in one launch. dst: (S, H, D), parts: (c, m, H, D),
    both unit stride in D; rows: (m,) int64 on their device. Equivalent PyTorch::

        dst[rows] = parts.sum(0, dtype=torch.float32).to(dst.dtype)
    """
    c, m, h, d = parts.shape
    assert dst.stride(-1) == parts.stride(-1) == 1 and dst.shape[1:] == (h, d)
    block = 16 if dst.device.type == "cpu" else 32
    _sum_rows_kernel[(triton.cdiv(m, block), h)](parts, dst, rows, c, m, *parts.stride()[:3], *dst.stride()[:2],
                                                 D=d, D_PAD=d_pad(d), BLOCK=block, num_warps=4)
