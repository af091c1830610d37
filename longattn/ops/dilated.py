"""``dilated_attention``: LongNet dilated attention, on one device or over a process group."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import backends as bk
from .. import dilated as _dil
from .. import tuning as _tuning
from .._autograd import out_lse_like, register_attention_autograd
from .._validation import check_dilated_call
from ..dilated.plan import DilatedPlan

__all__ = ["dilated_attention"]


@torch.library.custom_op("longattn::dilated_fwd", mutates_args=(), device_types=None)
def _dilated_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: list[int],
                 dilation_rates: list[int], scale: float, causal: bool, backend: str, plan: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _dil.forward(DilatedPlan.from_key(plan), q, k, v, segment_lengths, dilation_rates, causal, scale,
                        backend)


@torch.library.custom_op("longattn::dilated_bwd", mutates_args=(), device_types=None)
def _dilated_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: Optional[torch.Tensor], segment_lengths: list[int],
                 dilation_rates: list[int], scale: float, causal: bool, backend: str, plan: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dil.backward(DilatedPlan.from_key(plan), dout, q, k, v, out, lse, dlse, segment_lengths,
                         dilation_rates, causal, scale, backend)


_dilated = register_attention_autograd(_dilated_fwd, _dilated_bwd,
                                       ("segment_lengths", "dilation_rates", "scale", "causal", "backend", "plan"),
                                       fwd_fake=out_lse_like)


def dilated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segment_lengths: Sequence[int],
                      dilation_rates: Sequence[int], causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      backend: str = "auto", tuning: Optional[_tuning.DilatedTuning] = None, group=None):
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
            each other: gathered blocks), or ``"auto"``: on CUDA, cuDNN on the views
            from 8K tokens (MHA; GQA where rates and group size divide; each pass
            replayed from a CUDA graph up to 16K tokens, 32K when causal, at
            D <= 64 and for GQA), the fused Triton kernels below 8K and for the non-causal
            backward of short segment classes (at most 512 keys per class,
            branches nested: one grouped launch per kernel; chained branches at
            D <= 64 compute every pair of the union once); see
            :class:`longattn.tuning.DilatedTuning` for every threshold and its measurement.
        tuning: a :class:`longattn.tuning.DilatedTuning` in place of the measured
            defaults (other hardware, A/B measurements; ``schedule`` forces an engine).
        group: a ProcessGroup; when given, q/k/v are this rank's contiguous shard
            of the sequence (see :func:`longattn.distributed.dilated.dilated_attention`).

    Returns:
        ``out`` like q (and ``lse`` ``(batch, nheads, seqlen)`` float32 if asked).

    Equivalent PyTorch (one branch; the real op merges branches by lse)::

        sel = ((pos % w) % r)[None, :] == (heads % r)[:, None]          # (H, S)
        same_seg = (pos[:, None] // w) == (pos[None, :] // w)             # (S, S)
        mask = sel[:, :, None] & sel[:, None, :] & same_seg               # (H, S, S)
        out = softmax(q k^T * scale masked by mask) v
    """
    if tuning is not None and not isinstance(tuning, _tuning.DilatedTuning):
        raise TypeError(f"tuning must be a longattn.tuning.DilatedTuning or None, got {type(tuning).__name__}")
    tuning = tuning or _tuning.DILATED
    if group is not None:
        from .dilated_ring import dilated_attention_over_ranks as _over_ranks

        return _over_ranks(q, k, v, segment_lengths=segment_lengths, dilation_rates=dilation_rates, causal=causal,
                           softmax_scale=softmax_scale, return_lse=return_lse, backend=backend, tuning=tuning,
                           group=group)
    segs, rates = check_dilated_call(q, k, v, segment_lengths, dilation_rates, causal, return_lse, softmax_scale)
    backend = bk.resolve(backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    plan = _dil.choose(q, k, segs, rates, causal, backend, tuning)
    if plan.fwd in ("views", "gather") and backend != "auto" and not torch.compiler.is_compiling():
        # The views path hands dense blocks to this backend; check it can take them.
        bk.select_backend(q, k, bk.BlockSpec(scale, causal), backend)
    if plan.fwd == plan.bwd == "fused":  # the triton_op pair: torch.compile sees the kernels
        out, lse = _dil.fused.fused_op(q, k, v, list(segs), list(rates), scale, causal, plan.fused_schedule,
                                       plan.autotune)
    else:
        out, lse = _dilated(q, k, v, list(segs), list(rates), scale, causal, backend, plan.key())
    return (out, lse) if return_lse else out
