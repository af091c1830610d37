"""``attention_varlen``: packed variable-length documents on one device.

Tokens of several documents are packed in one ``(total_tokens, nheads,
headdim)`` tensor; ``cu_seqlens`` (int32, ``(ndocs + 1,)``) holds the
cumulative document lengths. A token attends only within its document. The
kernel is chosen once per call by :func:`longattn.backends.varlen.choose`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import backends as bk
from .._autograd import register_attention_autograd, varlen_out_lse_like
from .._sinks import apply_sinks
from .._validation import check_attention_call, check_cu_seqlens, check_cu_seqlens_tensor, check_softcap_sinks
from ..backends import varlen as _varlen

__all__ = ["attention_varlen"]


@torch.library.custom_op("longattn::varlen_fwd", mutates_args=(), device_types=None)
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str, kernel: str,
                softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), 0, softcap)
    return _varlen.forward(kernel, q, k, v, cu_seqlens, max_seqlen, spec, backend)


@torch.library.custom_op("longattn::varlen_bwd", mutates_args=(), device_types=None)
def _varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, max_seqlen: int,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str, kernel: str,
                softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), 0, softcap)
    return _varlen.backward(kernel, dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, spec, backend)


# softcap last and defaulted, as in ops/attention.py
_varlen_op = register_attention_autograd(_varlen_fwd, _varlen_bwd,
                                         ("max_seqlen", "scale", "causal", "window_left", "window_right", "backend",
                                          "kernel", "softcap"),
                                         extra_tensors=1, fwd_fake=varlen_out_lse_like)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     max_seqlen: Optional[int] = None, causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, softcap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None, backend: str = "auto"):
    """Attention within each of several packed documents.

    Args:
        q: ``(total_tokens, nheads, headdim)``; k, v: ``(total_tokens, nheads_kv, headdim)``.
        cu_seqlens: int32 ``(ndocs + 1,)`` cumulative document lengths, ``[0, ..., total_tokens]``,
            best kept on the host: every call reads it there (its checks, the
            kernel's choice), which for a CUDA tensor waits for the work queued
            before it, so the host cannot run ahead of the GPU; a host tensor is
            copied to the device without waiting. Under CUDA graph capture
            nothing is read on the host: pass it on q's device with
            ``max_seqlen`` (its values then go unchecked, as in flash-attn),
            after one call outside the capture (which compiles the kernel).
        max_seqlen: the longest document (computed when None; required under capture).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            positions inside each document.
        return_lse: also return lse ``(nheads, total_tokens)`` float32 (flash-attn's varlen layout).
        softcap, sinks: as :func:`longattn.attention`. Soft-capping runs in
            FA4's varlen kernel where it runs, else one document at a time
            through a dense backend that applies it (the Triton and flash
            varlen kernels do not: forcing them raises).
        backend: ``"auto"``, ``"fa4"``, ``"triton"``, ``"flash"`` or a dense backend name used per document.

    Equivalent PyTorch::

        outs = [longattn.attention(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal)[0]
                for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        out = torch.cat(outs)
    """
    left, right = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True,
                                       ndim=3)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:  # nothing can be read on the host: what a varlen kernel takes, given on the device
        _check_capture_args(q, cu_seqlens, max_seqlen)
    else:
        cu = check_cu_seqlens(cu_seqlens, q.shape[0])  # the call's one read of cu_seqlens (a wait if on a GPU)
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
        if max_seqlen is None:
            max_seqlen = longest
        elif max_seqlen < longest:
            raise ValueError(f"max_seqlen ({max_seqlen}) is shorter than the longest document ({longest})")
    softcap = check_softcap_sinks(softcap, sinks, q)
    backend = bk.resolve(backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    kernel = _kernel(q, backend, cu_seqlens.numel() - 1, softcap, loop_ok=not capturing)
    # made once here, what the forward and backward both take: no further read or blocking copy
    op_cu = cu_seqlens if capturing else _varlen.op_cu_seqlens(kernel, cu_seqlens, cu, q.device)
    out, lse = _varlen_op(q, k, v, op_cu, int(max_seqlen), scale, causal, left, right, backend, kernel, softcap)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, varlen=True)
    return (out, lse) if return_lse else out


def _kernel(q, backend: str, ndocs: int, softcap: float, loop_ok: bool = True) -> str:
    """The varlen kernel of a call (also Ulysses' per-rank one):
    :func:`longattn.backends.varlen.choose`, softcap among the capabilities."""
    return _varlen.choose(q, backend, ndocs, softcap=softcap, loop_ok=loop_ok)


def _check_capture_args(q, cu_seqlens, max_seqlen) -> None:
    """Under CUDA graph capture a call cannot read ``cu_seqlens`` on the host
    (nor copy a host one: the graph would replay a copy from a freed buffer),
    so it takes them as flash-attn does, unchecked in their values."""
    check_cu_seqlens_tensor(cu_seqlens)
    if cu_seqlens.device != q.device or max_seqlen is None:
        raise ValueError("attention_varlen under CUDA graph capture reads nothing on the host: pass cu_seqlens on "
                         f"q's device (got {cu_seqlens.device}) and max_seqlen (got {max_seqlen!r}); their values "
                         "are not checked inside a capture")
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be an int >= 1, got {max_seqlen!r}")
