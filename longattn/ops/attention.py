"""``attention``: dense attention on one device through the backend layer.

Layering (as in torch/nn/attention/varlen.py): a private ``torch.library``
custom op per kernel call with a fake implementation (so ``torch.compile``
traces through), autograd attached with ``register_attention_autograd`` whose
context is unpacked by name, and a thin public function that validates
inputs, applies defaults and carries the documentation.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import backends as bk
from .._autograd import out_lse_like, register_attention_autograd
from .._sinks import apply_sinks
from .._validation import check_attention_call, check_softcap_sinks

__all__ = ["attention"]


# ------------------------------------------------------------------ dense attention
@torch.library.custom_op("longattn::attention_fwd", mutates_args=(), device_types=None)
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                   window_left: int, window_right: int, q_offset: int, backend: str,
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), q_offset, softcap)
    out, lse = bk.block_forward(q, k, v, spec, backend)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("longattn::attention_bwd", mutates_args=(), device_types=None)
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor], scale: float,
                   causal: bool, window_left: int, window_right: int, q_offset: int, backend: str,
                   softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = bk.BlockSpec(scale, causal, (window_left, window_right), q_offset, softcap)
    dq, dk, dv = bk.block_backward(dout, q, k, v, out, lse, spec, backend, dlse=dlse)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


# softcap last and defaulted: callers of the kernel ops that never soft-cap
# (Ulysses' local step) pass the arguments before it.
_attention = register_attention_autograd(_attention_fwd, _attention_bwd,
                                         ("scale", "causal", "window_left", "window_right", "q_offset", "backend",
                                          "softcap"),
                                         fwd_fake=out_lse_like)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
              return_lse: bool = False, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
              backend: str = "auto"):
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
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``):
            scores become ``softcap * tanh(scores / softcap)`` before the mask;
            0.0 is none. Only backends that apply it run such a call (the math
            backend: ``longattn.backends.explain`` lists who refuses and why).
        sinks: ``(nheads,)`` one learned logit per query head in every row's
            softmax denominator (GPT-OSS's ``s_aux``), finite, differentiable;
            lse then includes it.
        backend: ``"auto"`` (the fastest that supports the call: FA4, cuDNN,
            flash, triton (on CUDA; on CPU only where named, under the Triton
            interpreter), efficient, math) or one of those names; a backend that
            cannot run the call raises ``ValueError`` listing why.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads, headdim)`` in q's dtype, and ``lse`` when
        asked. Rows that see no key give 0 and lse ``-inf`` (with sinks: 0 and
        the head's sink).

    Equivalent PyTorch::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, 2)) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:  # one more column per row, whose value is zero
            s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], -1)
        out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1)[..., :k.shape[1]], v.repeat_interleave(g, 2))
    """
    left, right = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size)
    softcap = check_softcap_sinks(softcap, sinks, q)
    backend = bk.resolve(backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    q_offset = k.shape[1] - q.shape[1]
    spec = bk.BlockSpec(scale, causal, (left, right), q_offset, softcap)
    if not torch.compiler.is_compiling():  # raise on an unsupported forced backend before any kernel
        bk.select_backend(q, k, spec, backend)
    out, lse = _attention(q, k, v, scale, causal, left, right, q_offset, backend, softcap)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out
