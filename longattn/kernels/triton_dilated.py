"""Fused dilated attention, no gathered copies.

Grouped schedule (branches nest and every branch has at most
``GROUPED_MAX_KEYS`` keys per segment class): one launch per kernel, each
(row, head) owned by one program that runs all of its branches through one
online softmax (see the grouped kernels in triton_attention.py). Otherwise one
launch per branch. Forward: a rate-1 branch (it selects every row of every head) runs first and
writes the output and lse; without one they start as 0 / -inf. Each later
branch merges into them in its epilogue, in float32 registers (launches are
ordered on the stream, and inside one launch each (row, head) has one owner). Backward: one
``delta = rowsum(dO * O) - dlse`` pass over the merged output, then per
branch a dK/dV and a dQ launch that add into the gradients in place (a
rate-1 branch first, writing them).
Extra memory beyond inputs, outputs and grads: the float32 lse and delta,
(B, H, S) each: the output and gradients are accumulated in place.

``fused_fwd`` / ``fused_bwd`` are the same two passes registered as
``torch.library.triton_op``: under torch.compile the graph holds the Triton
kernels themselves (wrapped by ``wrap_triton``), which Inductor compiles and
schedules with the code around them; eagerly they launch as plain kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import triton_attention as ta


def refusals(q: torch.Tensor, k: torch.Tensor) -> list[str]:
    r = []
    if not ta.available(q.device):
        r.append(ta.unavailable_reason(q.device))
    if q.shape[-1] not in ta.SUPPORTED_HEADDIMS:
        r.append(f"head dim {q.shape[-1]} not in {ta.SUPPORTED_HEADDIMS}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        r.append(f"dtype {q.dtype} unsupported (fp16, bf16, fp32)")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        r.append("the Triton interpreter has no bf16")
    return r


# Internal switch for in-process A/B only (benchmarks/triton_autotune_ab.py):
# "auto" (see _plan), "grouped" (wherever branches nest), "per_branch" (a
# rate-1 branch writing first), "per_branch_zero_fill" (every branch merges
# into zero-filled buffers).
SCHEDULE = "auto"
# Keys per segment class (w / r) up to which the passes run grouped where
# branches nest. One H100, static tiles, in-process A/B, grouped vs per-branch
# fwd / bwd ms (triton_grouped_ab_h100_00acb45.json, classes ordered heaviest
# first): segments 256-1K (256 keys per class) 0.79 / 2.05 vs 0.94 / 3.08,
# causal 0.74 / 2.22 vs 0.89 / 3.28; LongNet (2048 keys) 32K 3.21 / ~9.9 vs
# 3.03 / 10.55, 128K 12.55 / 40.7 vs 11.16 / 39.5, D=64 2.12 / 7.0 vs 1.59 /
# 7.0, GQA 16q/4kv 2.91 / 10.6 vs 2.77 / 9.75, 32K causal 3.37 / 9.5 vs
# 1.91 / 7.7. Short classes gain what per-branch launches lose to
# prologues, merges and gradient read-modify-writes; long ones lose: a grouped
# block's rows are strided by the largest rate, so the block spans the whole
# segment (a causal low-rate branch runs its full square, masked) and the
# programs' loads are uneven (a class sees 1 to 5 branches).
GROUPED_MAX_KEYS = 512


def _plan(seqlen, segment_lengths, dilation_rates, causal):
    if SCHEDULE not in ("auto", "grouped"):
        return None
    plan = ta.GroupedPlan.of(seqlen, list(segment_lengths), list(dilation_rates), causal)
    if plan is None or SCHEDULE == "grouped":
        return plan
    return plan if _short_classes(seqlen, segment_lengths, dilation_rates) else None


def _short_classes(seqlen, segment_lengths, dilation_rates) -> bool:
    return max(min(w, seqlen) // r for w, r in zip(segment_lengths, dilation_rates)) <= GROUPED_MAX_KEYS


def grouped_runs(seqlen, segment_lengths, dilation_rates) -> bool:
    """The default schedule is grouped: branches nest and every branch has at
    most GROUPED_MAX_KEYS keys per segment class."""
    return (_short_classes(seqlen, segment_lengths, dilation_rates)
            and ta.GroupedPlan.of(seqlen, list(segment_lengths), list(dilation_rates), False) is not None)


def _branches(seqlen, segment_lengths, dilation_rates, causal):
    """(geometry, writes) per branch, a rate-1 branch first when there is one:
    it selects every (row, head), so it writes the output (and the gradients)
    instead of merging into zeros: no zero-fill and no read-back of the first
    branch (one H100: 6% of the LongNet forward, 2-3% of the backward)."""
    order = sorted(range(len(dilation_rates)), key=lambda i: dilation_rates[i] != 1)
    covers = SCHEDULE != "per_branch_zero_fill" and dilation_rates[order[0]] == 1
    for j, i in enumerate(order):
        yield ta.Geometry(seqlen, seqlen, w=segment_lengths[i], r=dilation_rates[i], causal=causal), covers and j == 0


def _buffer(shape, like, dtype, covered, fill):
    if covered:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


def forward(q, k, v, segment_lengths, dilation_rates, causal, scale, out_dtype=None):
    """Grouped where branches nest and classes are short (one launch: every
    (row, head) is written once, after all its branches), else one launch per
    branch merging into the output in place. The output is kept in the input dtype by default (the
    merges run in float32 registers, one rounding per branch), so the only
    extra memory is the lse; pass ``out_dtype=torch.float32`` where the result
    is merged again (dilated attention over ranks)."""
    q, k, v = (ta._contig(t) for t in (q, k, v))
    b, s, h, d = q.shape
    plan = _plan(s, segment_lengths, dilation_rates, causal)
    if plan is not None:
        out = torch.empty(b, s, h, d, dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        ta.launch_grouped_forward(q, k, v, out, lse, plan, scale)
        return out, lse
    branches = list(_branches(s, segment_lengths, dilation_rates, causal))
    covered = branches[0][1]
    out = _buffer((b, s, h, d), q, out_dtype or q.dtype, covered, 0.0)
    lse = _buffer((b, h, s), q, torch.float32, covered, float("-inf"))
    for geo, writes in branches:
        ta.launch_forward(q, k, v, out, lse, geo, scale, merge=not writes)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, grad_dtype=None):
    """Grouped (each gradient row written once) or per branch adding into
    dQ/dK/dV in place (float32 registers, stored in ``grad_dtype``, default
    the input dtype): no float32 copies of the gradients; extra memory is the
    (B, H, S) float32 delta."""
    q, k, v, dout, out = (ta._contig(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    ta.launch_preprocess(out, dout, None if dlse is None else dlse.float().contiguous(), delta)
    plan = _plan(q.shape[1], segment_lengths, dilation_rates, causal)
    if plan is not None:
        dq, dk, dv = (torch.empty(x.shape, dtype=grad_dtype or x.dtype, device=q.device) for x in (q, k, v))
        ta.launch_grouped_backward(q, k, v, dout, lse, delta, dq, dk, dv, plan, scale)
        return dq, dk, dv
    branches = list(_branches(q.shape[1], segment_lengths, dilation_rates, causal))
    covered = branches[0][1]
    dq, dk, dv = (_buffer(x.shape, q, grad_dtype or x.dtype, covered, 0.0) for x in (q, k, v))
    for geo, writes in branches:
        ta.launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo, scale, accum=not writes)
    return dq, dk, dv


def _register_ops():
    """The op pair: ``triton_op`` where Triton compiles; under the CPU
    interpreter (tests), whose kernels ``wrap_triton`` cannot trace, plain
    custom ops with fake kernels, so torch.compile still runs them (opaque)."""
    from .._ops import register_attention_autograd

    if ta._interpret():
        define = lambda name: torch.library.custom_op(name, mutates_args=())
    else:
        define = lambda name: torch.library.triton_op(name, mutates_args=())

    @define("longattn::dilated_triton_fwd")
    def fused_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: list[int],
                  dilation_rates: list[int], scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, segment_lengths, dilation_rates, causal, scale)

    @define("longattn::dilated_triton_bwd")
    def fused_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: Optional[torch.Tensor], segment_lengths: list[int],
                  dilation_rates: list[int], scale: float, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale)

    if ta._interpret():  # a triton_op's fake kernel is its body; these are written out
        b_h_s = lambda q: (q.shape[0], q.shape[2], q.shape[1])
        fused_fwd.register_fake(lambda q, k, v, *_: (torch.empty_like(q),
                                                     q.new_empty(b_h_s(q), dtype=torch.float32)))
        fused_bwd.register_fake(lambda dout, q, k, v, *_: (torch.empty_like(q), torch.empty_like(k),
                                                           torch.empty_like(v)))
    register_attention_autograd(fused_fwd, fused_bwd, ("segment_lengths", "dilation_rates", "scale", "causal"))
    return fused_fwd, fused_bwd


fused_fwd, fused_bwd = _register_ops() if ta.HAS_TRITON else (None, None)
