"""The fused engine of dilated attention: our Triton kernels, no gathered copies.

Schedules (chosen by :func:`longattn.dilated.plan.choose`):

* ``grouped`` (branches nest): one launch per kernel, each (row, head) owned
  by one program that runs all of its branches through one online softmax
  (:mod:`longattn.kernels.grouped_jit`).
* ``per_branch``: one launch per branch. Forward: a rate-1 branch (it selects
  every row of every head) runs first and writes the output and lse; without
  one they start as 0 / -inf. Each later branch merges into them in its
  epilogue, in float32 registers (launches are ordered on the stream, and
  inside one launch each (row, head) has one owner). Backward: one
  ``delta = rowsum(dO * O) - dlse`` pass over the merged output, then per
  branch a dK/dV and a dQ launch that add into the gradients in place (a
  rate-1 branch first, writing them).
* ``dedup`` (branches form a chain, see
  :func:`longattn.kernels.geometry.dedup_chain`): as ``per_branch``, in chain
  order, with every pair of the union computed once: a branch skips its
  diagonal sub-blocks (the previous branch's segment, whose pairs that branch
  has) and each pair is weighted by the number of branches that give it
  (LongNet: 76% of the pairs, no diagonal tiles outside the first branch).
* ``per_branch_zero_fill``: as ``per_branch`` with every branch merging into
  zero-filled buffers (A/B measurements).

Extra memory beyond inputs, outputs and grads: the float32 lse and delta,
(B, H, S) each: the output and gradients are accumulated in place.

``fused_op`` runs the same two passes registered as a pair of
``torch.library.triton_op`` (:class:`longattn._autograd.AttentionOp`): under
torch.compile the graph holds the Triton kernels themselves (wrapped by
``wrap_triton``), which Inductor compiles and schedules with the code around
them; eagerly they launch as plain kernels.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import _common, launch
from ..kernels.autotune import Autotuner, default_tuner
from ..kernels.geometry import Geometry, GroupedPlan, dedup_chain


def _branches(seqlen, segment_lengths, dilation_rates, causal, schedule: str):
    """(geometry, writes) per branch, a rate-1 branch first when there is one:
    it selects every (row, head), so it writes the output (and the gradients)
    instead of merging into zeros: no zero-fill and no read-back of the first
    branch (one H100: 6% of the LongNet forward, 2-3% of the backward).
    ``dedup``: the chain's branches, each with its sub-block and the later
    rates that weight its pairs; a branch all of whose pairs an earlier one
    computes is left out."""
    chain = dedup_chain(seqlen, segment_lengths, dilation_rates) if schedule == "dedup" else None
    if chain is not None:
        covers = chain[0].r == 1
        for b in chain:
            geo = Geometry(seqlen, seqlen, w=b.w, r=b.r, causal=causal, inner=b.inner,
                           higher=[x.r for x in chain[b.rank + 1:]])
            if b.rank == 0 or b.inner < geo.max_m:
                yield geo, covers and b.rank == 0
        return
    order = sorted(range(len(dilation_rates)), key=lambda i: dilation_rates[i] != 1)
    covers = schedule != "per_branch_zero_fill" and dilation_rates[order[0]] == 1
    for j, i in enumerate(order):
        yield Geometry(seqlen, seqlen, w=segment_lengths[i], r=dilation_rates[i], causal=causal), covers and j == 0


def _grouped(schedule: str, seqlen, segment_lengths, dilation_rates, causal) -> Optional[GroupedPlan]:
    if schedule != "grouped":
        return None
    return GroupedPlan.of(seqlen, list(segment_lengths), list(dilation_rates), causal)


def _buffer(shape, like, dtype, covered, fill):
    if covered:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


def forward(q, k, v, segment_lengths, dilation_rates, causal, scale, schedule: str = "per_branch", out_dtype=None,
            tuner: Optional[Autotuner] = None):
    """Grouped (one launch: every (row, head) is written once, after all its
    branches) or one launch per branch (``per_branch``, ``dedup``) merging into
    the output in place. The
    output is kept in the input dtype by default (the merges run in float32
    registers, one rounding per branch), so the only extra memory is the lse;
    pass ``out_dtype=torch.float32`` where the result is merged again (dilated
    attention over ranks). ``tuner`` chooses the tiles (default: the process's)."""
    q, k, v = (_common.contig(t) for t in (q, k, v))
    b, s, h, d = q.shape
    grouped = _grouped(schedule, s, segment_lengths, dilation_rates, causal)
    if grouped is not None:
        out = torch.empty(b, s, h, d, dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        launch.launch_grouped_forward(q, k, v, out, lse, grouped, scale, tuner)
        return out, lse
    branches = list(_branches(s, segment_lengths, dilation_rates, causal, schedule))
    covered = branches[0][1]
    out = _buffer((b, s, h, d), q, out_dtype or q.dtype, covered, 0.0)
    lse = _buffer((b, h, s), q, torch.float32, covered, float("-inf"))
    for geo, writes in branches:
        launch.launch_forward(q, k, v, out, lse, geo, scale, merge=not writes, tuner=tuner)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale,
             schedule: str = "per_branch", grad_dtype=None, tuner: Optional[Autotuner] = None):
    """Grouped (each gradient row written once) or per branch adding into
    dQ/dK/dV in place (float32 registers, stored in ``grad_dtype``, default
    the input dtype): no float32 copies of the gradients; extra memory is the
    (B, H, S) float32 delta."""
    q, k, v, dout, out = (_common.contig(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    launch.launch_preprocess(out, dout, None if dlse is None else dlse.float().contiguous(), delta)
    grouped = _grouped(schedule, q.shape[1], segment_lengths, dilation_rates, causal)
    if grouped is not None:
        dq, dk, dv = (torch.empty(x.shape, dtype=grad_dtype or x.dtype, device=q.device) for x in (q, k, v))
        launch.launch_grouped_backward(q, k, v, dout, lse, delta, dq, dk, dv, grouped, scale, tuner)
        return dq, dk, dv
    branches = list(_branches(q.shape[1], segment_lengths, dilation_rates, causal, schedule))
    covered = branches[0][1]
    dq, dk, dv = (_buffer(x.shape, q, grad_dtype or x.dtype, covered, 0.0) for x in (q, k, v))
    for geo, writes in branches:
        launch.launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo, scale, accum=not writes, tuner=tuner)
    return dq, dk, dv


def _register_ops():
    """The op pair: ``triton_op`` where Triton compiles; under the CPU
    interpreter (tests), whose kernels ``wrap_triton`` cannot trace, plain
    custom ops with fake kernels, so torch.compile still runs them (opaque)."""
    from .._autograd import register_attention_autograd

    if _common.interpreted():
        define = lambda name: torch.library.custom_op(name, mutates_args=())
    else:
        define = lambda name: torch.library.triton_op(name, mutates_args=())

    @define("longattn::dilated_triton_fwd")
    def fused_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: list[int],
                  dilation_rates: list[int], scale: float, causal: bool, schedule: str, autotune: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(q, k, v, segment_lengths, dilation_rates, causal, scale, schedule,
                       tuner=default_tuner(autotune))

    @define("longattn::dilated_triton_bwd")
    def fused_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: Optional[torch.Tensor], segment_lengths: list[int],
                  dilation_rates: list[int], scale: float, causal: bool, schedule: str, autotune: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, schedule,
                        tuner=default_tuner(autotune))

    if _common.interpreted():  # a triton_op's fake kernel is its body; these are written out
        b_h_s = lambda q: (q.shape[0], q.shape[2], q.shape[1])
        fused_fwd.register_fake(lambda q, k, v, *_: (torch.empty_like(q),
                                                     q.new_empty(b_h_s(q), dtype=torch.float32)))
        fused_bwd.register_fake(lambda dout, q, k, v, *_: (torch.empty_like(q), torch.empty_like(k),
                                                           torch.empty_like(v)))
    return register_attention_autograd(fused_fwd, fused_bwd, ("segment_lengths", "dilation_rates", "scale", "causal",
                                                              "schedule", "autotune"))


fused_op = _register_ops() if _common.HAS_TRITON else None
