"""Public single-device ops: ``attention`` and ``dilated_attention``.

Layering (as in torch/nn/attention/varlen.py): a private ``torch.library``
custom op per kernel call with a fake implementation (so ``torch.compile``
traces through), autograd attached with ``register_autograd`` whose context
is unpacked by name, and a thin public function that validates inputs,
applies defaults and carries the documentation.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import backends as bk
from . import dilated as _dil
from ._ops import register_attention_autograd
from ._validation import check_dilated_call, check_flag, check_qkv, check_scale, check_window
from .kernels import triton_dilated as _fused

__all__ = ["attention", "dilated_attention"]


def _lse_like(q: torch.Tensor) -> torch.Tensor:
    b, s, h, _ = q.shape
    return q.new_empty(b, h, s, dtype=torch.float32)


# ------------------------------------------------------------------ dense attention
@torch.library.custom_op("longattn::attention_fwd", mutates_args=(), device_types=None)
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   window_left: int, window_right: int, q_offset: int, backend: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), q_offset)
    out, lse = bk.block_forward(q, k, v, spec, backend)
    return out.contiguous(), lse.contiguous()


@_attention_fwd.register_fake
def _(q, k, v, scale, causal, window_left, window_right, q_offset, backend):
    return torch.empty_like(q), _lse_like(q)


@torch.library.custom_op("longattn::attention_bwd", mutates_args=(), device_types=None)
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], scale: float,
                   causal: bool, window_left: int, window_right: int, q_offset: int, backend: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), q_offset)
    dq, dk, dv = bk.block_backward(dout, q, k, v, out, lse, spec, backend, dlse=dlse)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale, causal, window_left, window_right, q_offset, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_attention_fwd, _attention_bwd,
                            ("scale", "causal", "window_left", "window_right", "q_offset", "backend"))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
              return_lse: bool = False, backend: str = "auto"):
    """Exact softmax attention on one device through the best local kernel.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)``; ``nheads % nheads_kv == 0``
            (GQA/MQA: query head ``h`` reads kv head ``h // (nheads // nheads_kv)``).
        causal: mask keys after the query. With ``seqlen_q != seqlen_k`` the
            mask is aligned to the bottom-right corner as in flash-attn: query
            row ``i`` sits at key position ``i + seqlen_k - seqlen_q``.
        softmax_scale: defaults to ``headdim ** -0.5``.
        window_size: ``(left, right)``; a query at position p sees keys in
            ``[p - left, p + right]``; -1 is unbounded.
        return_lse: also return the log-sum-exp ``(batch, nheads, seqlen_q)``
            float32; it is differentiable.
        backend: ``"auto"`` (the fastest that supports the call: cuDNN, flash,
            triton, efficient, math) or one of those names; a backend that cannot
            run the call raises ``ValueError`` listing why.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in q's dtype, and ``lse`` when
        asked. Rows that see no key give 0 and lse ``-inf``.

    Equivalent PyTorch::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
        s = s.masked_fill(~mask, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.repeat_interleave(g, 2))
    """
    check_qkv(q, k, v)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    left, right = check_window(window_size)
    bk.check_backend_name(backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    q_offset = k.shape[1] - q.shape[1]
    spec = bk.BlockSpec(scale, causal, (left, right), q_offset)
    if not torch.compiler.is_compiling():  # raise on an unsupported forced backend before any kernel
        bk.select_backend(q, k, spec, backend)
    out, lse = _attention_fwd(q, k, v, scale, causal, left, right, q_offset, backend)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------- dilated attention
@torch.library.custom_op("longattn::dilated_fwd", mutates_args=(), device_types=None)
def _dilated_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: list[int],
                 dilation_rates: list[int], scale: float, causal: bool, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_fused(q, k, segment_lengths, dilation_rates, causal, backend):
        return _fused.forward(q, k, v, segment_lengths, dilation_rates, causal, scale)
    return _dil.forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend)


@_dilated_fwd.register_fake
def _(q, k, v, segment_lengths, dilation_rates, scale, causal, backend):
    return torch.empty_like(q), _lse_like(q)


@torch.library.custom_op("longattn::dilated_bwd", mutates_args=(), device_types=None)
def _dilated_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: Optional[torch.Tensor], segment_lengths: list[int],
                 dilation_rates: list[int], scale: float, causal: bool, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_fused(q, k, segment_lengths, dilation_rates, causal, backend, "bwd"):
        return _fused.backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale)
    return _dil.backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, backend)


@_dilated_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, scale, causal, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_dilated_fwd, _dilated_bwd,
                            ("segment_lengths", "dilation_rates", "scale", "causal", "backend"))


# From this many tokens (batch x seqlen) auto runs MHA dilated attention as cuDNN
# calls on strided views, forward and backward separately (the backward needs
# only the merged out/lse), per head dim. One H200, LongNet config, offset
# classes stacked into few views (run_dilated_d128_h200_6fbc591.json,
# run_dilated_d64_h200_6fbc591.json), views over fused Triton time:
#   D=128: forward 0.72x at 32K, 0.66x at 128K, 0.73x at 1M; backward 0.69x, 0.67x, 0.64x
#   D=64:  forward 1.94x at 32K, 0.97x at 128K, 0.90x at 1M; backward 0.84x, 0.56x, 0.58x
CUDNN_VIEWS_MIN_TOKENS = {("fwd", 128): 32768, ("bwd", 128): 32768, ("fwd", 64): 131072, ("bwd", 64): 32768}
# GQA: one cuDNN call per offset class (classes do not stack), 31 per pass for LongNet.
# One H100 at 5216961, LongNet 32q/8kv D=128, views (backend="cudnn") vs fused Triton,
# fwd / bwd ms: 32K 7.97 / 25.2 vs 6.83 / 21.2; 128K 22.8 / 54.9 vs 22.6 / 76.6 (with
# CUDA_LAUNCH_BLOCKING); 1M 129 / 397 vs 173 / 592. That build's gradient adds wrote out of
# bounds where a class's kv view has fewer heads than its query view (group 4, rates 2
# and 4). Fixed (one H100 at 0aa75dc, run_dilated_gqa_h100_0aa75dc.json, after the bf16
# GPU tests with group 4 passed), views vs fused, no launch blocking: 32K 4.22 / 13.68 vs 5.36 / 19.35; 128K 15.07 / 49.81
# vs 20.91 / 72.64; 128K causal 9.39 / 33.52 vs 13.61 / 48.60; 1M 131.3 / 412.2 vs 167.1 /
# 605.7: views from 32K in both passes.
CUDNN_VIEWS_MIN_TOKENS_GQA = {"fwd": 32768, "bwd": 32768}


def _views_min_tokens(pass_: str, head_dim: int, mha: bool = True) -> Optional[int]:
    if not mha:
        return CUDNN_VIEWS_MIN_TOKENS_GQA[pass_]
    return CUDNN_VIEWS_MIN_TOKENS[(pass_, 64 if head_dim <= 64 else 128)]


def _use_fused(q, k, segs, rates, causal: bool, backend: str, pass_: str = "fwd") -> bool:
    """The fused Triton dilated kernels run when asked for, or under auto on
    CUDA when they can, except for long sequences whose parts are strided
    views (MHA; GQA whose rates and group sizes divide), where cuDNN on the
    views is faster (docs/performance.md), unless it is the non-causal
    backward of segment classes short enough for the grouped fused schedule
    (one H100, segments 256-1K, run_dilated_short_h100_aca95a7.json: grouped
    backward 2.06 / 6.92 ms at 32K / 128K against the views' 3.64 / 8.83;
    causal 128K 8.35 against 7.96, so causal stays on the views)."""
    if backend == "triton":
        return True
    if backend != "auto" or q.device.type != "cuda" or bk._forced() not in (None, "triton"):
        return False
    limit = _views_min_tokens(pass_, q.shape[-1], q.shape[2] == k.shape[2])
    if (bk._forced() is None and limit is not None and q.shape[0] * q.shape[1] >= limit and _cudnn_views(q, k, rates)
            and not (pass_ == "bwd" and not causal and _fused.grouped_runs(q.shape[1], segs, rates))):
        return False
    return not _fused.refusals(q, k)


def _fused_both_passes(q, k, segs, rates, causal, backend: str) -> bool:
    """Forward and backward both run the fused kernels. Under torch.compile
    only when asked for by name: auto's choice reads device state the trace
    does not guard, so it stays inside the opaque op."""
    if _fused.fused_fwd is None or backend not in ("auto", "triton"):
        return False
    if torch.compiler.is_compiling():
        return backend == "triton"
    return _use_fused(q, k, segs, rates, causal, backend) and _use_fused(q, k, segs, rates, causal, backend, "bwd")


def _cudnn_views(q, k, rates) -> bool:
    """Every part is a strided view of q/k/v (see dilated.kv_views_ok); cuDNN
    takes them without copies."""
    return (_dil.kv_views_ok(rates, q.shape[2], k.shape[2])
            and not bk.BACKENDS["cudnn"].refusals(bk.BlockSpec(1.0), q, k))


def dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_lengths: Sequence[int],
                      dilation_rates: Sequence[int], causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      backend: str = "auto", group=None):
    """LongNet dilated attention.

    Branch ``i`` has segment length ``w_i`` and dilation rate ``r_i``. For query
    head ``h`` it selects position ``p`` when ``(p % w_i) % r_i == h % r_i``; a
    selected query attends to the selected keys of its own segment ``p // w_i``
    (with ``causal``, only keys at positions <= p). All branches are merged as
    one softmax over the union of the keys they give (a key given by two
    branches counts twice). The last segment may be partial; a segment longer
    than the sequence covers all of it. A (position, head) no branch selects
    gives output 0 and lse ``-inf``.

    Args:
        q: ``(batch, seqlen, nheads, headdim)``.
        k, v: ``(batch, seqlen, nheads_kv, headdim)``; GQA: query head ``h`` reads kv
            head ``h // (nheads // nheads_kv)`` at the positions its offset selects.
        segment_lengths, dilation_rates: one ``(w, r)`` per branch, positive ints.
        causal, softmax_scale, return_lse: as in :func:`attention`.
        backend: ``"triton"`` (fused kernels, no copies; a ``triton_op`` pair, so
            torch.compile compiles the kernels with the model; tiles autotuned per
            shape on CUDA, see ``LONGATTN_TRITON_AUTOTUNE``), a local backend name
            (``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``) run on every part
            (strided views, no copies; GQA whose rates and group size do not divide
            each other: gathered blocks), or ``"auto"``: on
            CUDA, cuDNN on the views from 32K tokens (MHA with D <= 64: forward from
            128K; GQA where rates and group size divide), the fused Triton kernels
            otherwise and for the non-causal backward of short segment classes (at
            most 512 keys per class, branches nested: one grouped launch per kernel); see
            ``CUDNN_VIEWS_MIN_TOKENS``.
        group: a ProcessGroup; when given, q/k/v are this rank's contiguous shard
            of the sequence (see :func:`longattn.distributed.dilated_attention`).

    Returns:
        ``out`` like q (and ``lse`` ``(batch, nheads, seqlen)`` float32 if asked).

    Equivalent PyTorch (one branch; the real op merges branches by lse)::

        sel = ((pos % w) % r)[None, :] == (heads % r)[:, None]          # (H, S)
        same_seg = (pos[:, None] // w) == (pos[None, :] // w)             # (S, S)
        mask = sel[:, :, None] & sel[:, None, :] & same_seg               # (H, S, S)
        out = softmax(q k^T * scale masked by mask) v
    """
    if group is not None:
        from .distributed.dilated import dilated_attention as _dist_dilated

        return _dist_dilated(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates,
                             causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                             backend=backend, group=group)
    segs, rates = check_dilated_call(q, k, v, segment_lengths, dilation_rates, causal, return_lse, softmax_scale)
    bk.check_backend_name(backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if torch.compiler.is_compiling():
        pass  # the op itself checks the backend at run time
    elif backend == "triton":
        reasons = _fused.refusals(q, k)
        if reasons:
            raise ValueError(f"backend='triton' cannot run this call: {'; '.join(reasons)}")
    elif backend != "auto":
        # The gather path hands dense blocks to this backend; check it can take them.
        bk.select_backend(q, k, bk.BlockSpec(scale, causal), backend)
    if _fused_both_passes(q, k, segs, rates, causal, backend):  # the triton_op pair: torch.compile sees the kernels
        out, lse = _fused.fused_fwd(q, k, v, list(segs), list(rates), scale, causal)
    else:
        out, lse = _dilated_fwd(q, k, v, list(segs), list(rates), scale, causal, backend)
    return (out, lse) if return_lse else out
