"""Packed variable-length documents on one device: ``attention_varlen``.

Tokens of several documents are packed in one ``(total_tokens, nheads,
headdim)`` tensor; ``cu_seqlens`` (int32, ``(ndocs + 1,)``) holds the
cumulative document lengths. A token attends only within its document.

Kernels: a loop over documents through the dense backend layer (cuDNN on
CUDA; any device and dtype), our Triton kernel (one launch for all
documents; program z is document z) and PyTorch's flash varlen kernel
(CUDA, fp16/bf16). ``auto`` on CUDA loops over long documents (mean length
>= 4096, measured fastest there), else takes flash varlen, else Triton.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import backends as bk
from ._ops import register_attention_autograd
from ._validation import check_flag, check_qkv, check_scale, check_window


def check_cu_seqlens(cu_seqlens, total: int, name: str = "cu_seqlens") -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of cumulative lengths (ndocs + 1 entries, starting at 0), "
                         f"got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")
    vals = cu_seqlens.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {vals[:8]}...")
    if vals[-1] != total:
        raise ValueError(f"{name}[-1] ({vals[-1]}) must equal the number of tokens ({total})")


def _kernel(q, k, spec: bk.BlockSpec, backend: str, cu_len: int) -> str:
    from .kernels import triton_attention as ta

    triton_ok = (ta.available(q.device) and q.shape[-1] in ta.SUPPORTED_HEADDIMS and q.dtype != torch.float64
                 and not (q.device.type == "cpu" and q.dtype == torch.bfloat16))
    flash_ok = (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
                and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device) >= (8, 0))
    if backend == "triton":
        if not triton_ok:
            raise ValueError("backend='triton' cannot run this varlen call (no Triton on this device/dtype)")
        return "triton"
    if backend == "flash":
        if not flash_ok:
            raise ValueError("backend='flash' varlen needs CUDA, fp16/bf16 and head dim % 8 == 0")
        return "flash"
    if backend == "auto":
        # Measured on H200 (docs/performance.md, run_varlen_h200_e12dbda.json): long documents
        # (mean >= 4K tokens) run fastest as one cuDNN call each; shorter ones through PyTorch's
        # flash varlen kernel (its backward beat our Triton varlen 1.6x); Triton where flash cannot run.
        long_docs = q.shape[0] >= 4096 * max(cu_len - 1, 1)
        if bk._forced() is None and long_docs and q.device.type == "cuda":
            return "loop"
        if bk._forced() in (None, "flash") and flash_ok:
            return "flash"
        if bk._forced() in (None, "triton") and triton_ok and q.device.type == "cuda":
            return "triton"
        if bk._forced() == "triton" and triton_ok:
            return "triton"
    return "loop"


def _loop_fwd(q, k, v, cu, spec, backend):
    h = q.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    bname = backend if backend not in ("triton", "flash") else "auto"
    for a, e in zip(cu[:-1], cu[1:]):
        if e == a:
            continue
        o, l = bk.block_forward(q[None, a:e], k[None, a:e], v[None, a:e], spec, bname)
        out[a:e] = o[0]
        lse[:, a:e] = l[0]
    return out, lse


def _loop_bwd(dout, q, k, v, out, lse, dlse, cu, spec, backend):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    bname = backend if backend not in ("triton", "flash") else "auto"
    for a, e in zip(cu[:-1], cu[1:]):
        if e == a:
            continue
        g = bk.block_backward(dout[None, a:e], q[None, a:e], k[None, a:e], v[None, a:e], out[None, a:e],
                              lse[None, :, a:e].contiguous(), spec, bname,
                              dlse=None if dlse is None else dlse[None, :, a:e].contiguous())
        dq[a:e], dk[a:e], dv[a:e] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


@torch.library.custom_op("longattn::varlen_fwd", mutates_args=(), device_types=None)
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right))
    kind = _kernel(q, k, spec, backend, cu_seqlens.numel())
    cu = cu_seqlens.to(q.device)
    if kind == "triton":
        from .kernels import triton_attention as ta

        return ta.varlen_forward(q, k, v, cu, max_seqlen, spec)
    if kind == "flash":
        left, right = window_left, (0 if causal else window_right)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right)
        return out, bk._pos_inf_rows_to_dead(lse)
    return _loop_fwd(q, k, v, cu_seqlens.tolist(), spec, backend)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, causal, window_left, window_right, backend):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longattn::varlen_bwd", mutates_args=(), device_types=None)
def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right))
    kind = _kernel(q, k, spec, backend, cu_seqlens.numel())
    cu = cu_seqlens.to(q.device)
    if kind == "triton":
        from .kernels import triton_attention as ta

        return ta.varlen_backward(dout, q, k, v, out, lse, cu, max_seqlen, spec, dlse)
    if kind == "flash" and dlse is None:
        left, right = window_left, (0 if causal else window_right)
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), bk._dead_rows_to_pos_inf(lse).contiguous(), cu, cu,
            max_seqlen, max_seqlen, 0.0, causal, rng, torch.empty(0, device=q.device), scale=scale,
            window_size_left=left, window_size_right=right)
        return dq, dk, dv
    return _loop_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens.tolist(), spec, backend)


@_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, scale, causal, window_left, window_right, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_varlen_fwd, _varlen_bwd,
                            ("max_seqlen", "scale", "causal", "window_left", "window_right", "backend"),
                            extra_tensors=1)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     max_seqlen: Optional[int] = None, causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, backend: str = "auto"):
    """Attention within each of several packed documents.

    Args:
        q: ``(total_tokens, nheads, headdim)``; k, v: ``(total_tokens, nheads_kv, headdim)``.
        cu_seqlens: int32 ``(ndocs + 1,)`` cumulative document lengths, ``[0, ..., total_tokens]``.
        max_seqlen: the longest document (computed when None).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            positions inside each document.
        return_lse: also return lse ``(nheads, total_tokens)`` float32 (flash-attn's varlen layout).
        backend: ``"auto"``, ``"triton"``, ``"flash"`` or a dense backend name used per document.

    Equivalent PyTorch::

        outs = [longattn.attention(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)[0]
                for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        out = torch.cat(outs)
    """
    check_qkv(q, k, v, same_seqlen=True, ndim=3)
    check_cu_seqlens(cu_seqlens, q.shape[0])
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    left, right = check_window(window_size)
    bk.check_backend_name(backend)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1])
    if max_seqlen is None:
        max_seqlen = int(lens.max())
    elif max_seqlen < int(lens.max()):
        raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest document ({int(lens.max())})")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    out, lse = _varlen_fwd(q, k, v, cu_seqlens, int(max_seqlen), scale, causal, left, right, backend)
    return (out, lse) if return_lse else out
