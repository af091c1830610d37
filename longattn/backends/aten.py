"""The one module that calls PyTorch's aten attention kernels.

Every function takes and returns our layouts: (B, S, H, D) (varlen: (T, H,
D)) tensors, lse (B, H, S) (varlen: (H, T)) float32 with rows that saw no key
at -inf; the conversions to each kernel's own conventions happen here.
"""
from __future__ import annotations

import torch

from .base import dead_rows_to_pos_inf, expand_kv, pos_inf_rows_to_dead, reduce_kv_grad


# ------------------------------------------------ FlashAttention-2 (CUDA), dense and varlen
def flash_forward(q, k, v, scale: float, causal: bool, window: tuple[int, int], cu_q=None, cu_k=None,
                  max_q: int = 0, max_k: int = 0):
    """Dense (cu_q None: (B, S, H, D)) or varlen ((T, H, D) with int32 cu_seqlens)."""
    left, right = window
    if cu_q is None:
        max_q, max_k = q.shape[1], k.shape[1]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, window_size_left=left,
        window_size_right=right)
    return out, pos_inf_rows_to_dead(lse.float())


def flash_backward(dout, q, k, v, out, lse, scale: float, causal: bool, window: tuple[int, int], cu_q=None,
                   cu_k=None, max_q: int = 0, max_k: int = 0):
    left, right = window
    if cu_q is None:  # cum_seq None = not varlen (an empty tensor would mean varlen)
        max_q, max_k = q.shape[1], k.shape[1]
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), dead_rows_to_pos_inf(lse).contiguous(), cu_q, cu_k, max_q,
        max_k, 0.0, causal, rng, torch.empty(0, device=q.device), scale=scale, window_size_left=left,
        window_size_right=right)


# ------------------------------------------------------------- the CPU flash kernel
def cpu_flash_forward(q, k, v, scale: float, causal: bool):
    h = q.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2), 0.0, causal,
        scale=scale)
    return out.transpose(1, 2), lse.float()


def cpu_flash_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    h, hkv = q.shape[2], k.shape[2]
    # the kernel reads lse in its accumulation dtype: float32, float64 for float64 inputs
    stats = dead_rows_to_pos_inf(lse).to(torch.promote_types(q.dtype, torch.float32))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2),
        out.transpose(1, 2), stats, 0.0, causal, scale=scale)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv)


# --------------------------------------------------------------------------- cuDNN
def cudnn_stats(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, S) lse, any strides -> the contiguous (B, H, S, 1) stats cuDNN's
    backward reads, dead rows (-inf) as +inf (see dead_rows_to_pos_inf): one
    kernel, where the copy, comparison and select took three."""
    stats = torch.empty((*lse.shape, 1), dtype=torch.float32, device=lse.device)
    torch.nan_to_num(lse, nan=float("nan"), neginf=float("inf"), out=stats[..., 0])
    return stats


def cudnn_forward(q, k, v, scale: float, causal: bool):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out.transpose(1, 2), lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def cudnn_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    # cuDNN wants grad_out laid out like out: strided views that already agree
    # (dilated parts) pass as they are, anything else as (B, S, H, D) memory.
    if dout.stride() != out.stride():
        dout, out = dout.contiguous(), out.contiguous()
    res = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        cudnn_stats(lse), None, None, None, None, None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return tuple(t.transpose(1, 2) for t in res[:3])


# ----------------------------------------------------------------------- efficient
def efficient_forward(q, k, v, scale: float, causal: bool):
    h = q.shape[2]
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.transpose(1, 2), expand_kv(k, h).transpose(1, 2), expand_kv(v, h).transpose(1, 2), None, True, 0.0,
        causal, scale=scale)
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()


def efficient_stats(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, S) lse, any strides -> the (B, H, S rounded up to 32) float32
    buffer the efficient kernel's backward reads, laid out as its forward
    returns it: the kernel raises "LSE is not correctly aligned" unless the
    head and batch strides are multiples of 8 (a document of 3 tokens, a
    sequence of 1001), and its last query block may read past S. Dead rows and
    the padding +inf (P = 0)."""
    s = lse.shape[-1]
    stats = torch.full((*lse.shape[:-1], -(-s // 32) * 32), float("inf"), dtype=torch.float32, device=lse.device)
    stats[..., :s] = dead_rows_to_pos_inf(lse)
    return stats


def efficient_backward(dout, q, k, v, out, lse, scale: float, causal: bool):
    """k, v already expanded to q's heads."""
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    res = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, out.transpose(1, 2),
        efficient_stats(lse), seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return tuple(t.transpose(1, 2) for t in res[:3])
