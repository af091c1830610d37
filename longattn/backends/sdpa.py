"""Backends on PyTorch's own attention kernels (the aten ops behind SDPA):
cuDNN, FlashAttention-2 (and its CPU flash kernel), memory-efficient."""
from __future__ import annotations

import torch

from . import aten
from .base import Backend, expand_kv, fold_dlse, is_bottom_right, is_top_left, pad_headdim, reduce_kv_grad
from .math import MathBackend


class FlashBackend(Backend):
    """PyTorch's vendored FlashAttention-2 (CUDA) and its CPU flash kernel.

    CUDA: native GQA, sliding windows, bottom-right aligned masks, packed
    documents (:meth:`varlen_refusals`). CPU: top-left causal only, no window."""

    name = "flash"
    devices = ("cuda", "cpu")
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    max_headdim = 256
    supports_window = True
    supports_gqa_native = True
    min_capability = (8, 0)

    def _extra_refusals(self, spec, q, k):
        r = []
        sq, sk = q.shape[1], k.shape[1]
        if q.device.type == "cuda":
            r += self._cuda_refusals(q)
            if not is_bottom_right(spec, sq, sk):
                r.append(f"mask offset {spec.q_offset} is not bottom-right aligned ({sk - sq})")
        else:
            if spec.has_window:
                r.append("CPU flash kernel has no sliding window")
            if not is_top_left(spec, sq, sk):
                r.append("CPU flash kernel supports only top-left causal with seqlen_q == seqlen_k")
        return r

    @staticmethod
    def _cuda_refusals(q) -> list[str]:
        r = []
        if q.dtype not in (torch.float16, torch.bfloat16):
            r.append("CUDA flash kernel needs fp16/bf16")
        if q.shape[-1] % 8:
            r.append("CUDA flash kernel needs head dim multiple of 8")
        return r

    def varlen_refusals(self, q: torch.Tensor) -> list[str]:
        """Why the varlen kernel (packed documents, cu_seqlens) cannot take ``q``
        (T, H, D); its masks are the dense kernel's, per document."""
        r = [] if q.device.type == "cuda" else [f"varlen flash kernel needs CUDA, not {q.device.type}"]
        if q.shape[-1] > self.max_headdim:
            r.append(f"head dim {q.shape[-1]} > {self.max_headdim}")
        if q.device.type == "cuda":
            r += self._cuda_refusals(q)
            if self.capability(q.device) < self.min_capability:
                r.append(f"compute capability below {self.min_capability}")
        return r

    def forward(self, q, k, v, spec):
        if q.device.type == "cpu":
            return aten.cpu_flash_forward(q, k, v, spec.scale, spec.causal)
        return aten.flash_forward(q, k, v, spec.scale, spec.causal, spec.flash_window())

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        dout, out, pad = fold_dlse(dout, out, dlse)
        qp, kp, vp = (pad_headdim(t, pad) for t in (q, k, v))
        if q.device.type == "cpu":
            dq, dk, dv = aten.cpu_flash_backward(dout, qp, kp, vp, out, lse, spec.scale, spec.causal)
        else:
            dq, dk, dv = aten.flash_backward(dout, qp, kp, vp, out, lse, spec.scale, spec.causal,
                                             spec.flash_window())
        if pad:
            dq, dk, dv = dq[..., :-pad], dk[..., :-pad], dv[..., :-pad]
        return dq, dk, dv


class CudnnBackend(Backend):
    """cuDNN's fused attention. About 1.7x the flash backend on Hopper
    (docs/performance.md). GQA is native: cuDNN reads each kv head for its
    group of query heads and returns dK/dV with the kv heads' shape (no
    expanded copies, no reduction)."""

    name = "cudnn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_headdim = 128
    headdim_multiple = 8
    supports_gqa_native = True
    min_capability = (8, 0)

    def __init__(self, flash: FlashBackend, math: MathBackend):
        self._flash, self._math = flash, math

    def _extra_refusals(self, spec, q, k):
        r = []
        if not torch.backends.cudnn.is_available():
            r.append("cuDNN not available")
        if not is_top_left(spec, q.shape[1], k.shape[1]):
            r.append("cuDNN path supports only top-left causal with seqlen_q == seqlen_k")
        if q.shape[1] == 1 and k.shape[1] == 1:  # cuDNN 9.19's frontend raises "s_q = s_kv = 1 is not supported"
            r.append("cuDNN takes no call with seqlen_q = seqlen_k = 1")
        return r

    def forward(self, q, k, v, spec):
        return aten.cudnn_forward(q, k, v, spec.scale, spec.causal)

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        if dlse is not None:
            # Folding dlse pads the head dim past cuDNN's limit; the flash
            # kernel takes the padded call (math where flash cannot).
            alt = self._flash if not self._flash.refusals(spec, q, k) else self._math
            return alt.backward(dout, q, k, v, out, lse, spec, dlse)
        return aten.cudnn_backward(dout, q, k, v, out, lse, spec.scale, spec.causal)


class EfficientBackend(Backend):
    """xformers-derived memory-efficient kernel."""

    name = "efficient"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_headdim = 256
    headdim_multiple = 8
    min_capability = (5, 0)

    def _extra_refusals(self, spec, q, k):
        if not is_top_left(spec, q.shape[1], k.shape[1]):
            return ["efficient path supports only top-left causal with seqlen_q == seqlen_k"]
        return []

    def forward(self, q, k, v, spec):
        return aten.efficient_forward(q, k, v, spec.scale, spec.causal)

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        h, hkv = q.shape[2], k.shape[2]
        dout, out, pad = fold_dlse(dout, out, dlse)
        qp, kp, vp = (pad_headdim(t, pad) for t in (q, expand_kv(k, h), expand_kv(v, h)))
        dq, dk, dv = aten.efficient_backward(dout, qp, kp, vp, out, lse, spec.scale, spec.causal)
        if pad:
            dq, dk, dv = dq[..., :-pad], dk[..., :-pad], dv[..., :-pad]
        return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv)
