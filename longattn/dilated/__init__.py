"""LongNet dilated attention on one device: the schedule (:mod:`.schedule`),
the choice of engine (:mod:`.plan`), and the engines: views and gather
(:mod:`.views`), fused Triton kernels (:mod:`.fused`).

:func:`forward` and :func:`backward` run one pass as a plan says; the public
op is :func:`longattn.dilated_attention`.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.autotune import default_tuner
from . import fused, graphs, views
from .plan import DilatedPlan, choose
from .schedule import pair_count

__all__ = ["DilatedPlan", "choose", "forward", "backward", "pair_count"]


def forward(plan: DilatedPlan, q, k, v, segment_lengths, dilation_rates, causal: bool, scale: float,
            backend: str = "auto", out_dtype: Optional[torch.dtype] = None):
    """(out, lse) of one forward pass as ``plan.fwd`` says; ``out`` in
    ``out_dtype`` (default q's), lse (B, H, S) float32. ``plan.graphs``: replayed
    from a CUDA graph per shape (:mod:`.graphs`)."""
    if plan.graphs and plan.fwd != "gather":
        key = ("fwd", plan, tuple(segment_lengths), tuple(dilation_rates), causal, scale, backend, out_dtype)
        return graphs.run(key, lambda q, k, v: _forward(plan, q, k, v, segment_lengths, dilation_rates, causal,
                                                        scale, backend, out_dtype), (q, k, v))
    return _forward(plan, q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype)


def _forward(plan, q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype):
    if plan.fwd == "fused":
        return fused.forward(q, k, v, segment_lengths, dilation_rates, causal, scale, plan.fused_schedule,
                             out_dtype=out_dtype, tuner=default_tuner(plan.autotune))
    return views.forward(plan, q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype)


def backward(plan: DilatedPlan, dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal: bool,
             scale: float, backend: str = "auto", grad_dtype: Optional[torch.dtype] = None):
    """(dq, dk, dv) of one backward pass as ``plan.bwd`` says, in ``grad_dtype``
    (default the inputs' dtypes)."""
    if plan.graphs and plan.bwd != "gather":
        key = ("bwd", plan, tuple(segment_lengths), tuple(dilation_rates), causal, scale, backend, grad_dtype)
        return graphs.run(key, lambda *xs: _backward(plan, *xs, segment_lengths, dilation_rates, causal, scale,
                                                     backend, grad_dtype), (dout, q, k, v, out, lse, dlse))
    return _backward(plan, dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, backend,
                     grad_dtype)


def _backward(plan, dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, backend,
              grad_dtype):
    if plan.bwd == "fused":
        return fused.backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale,
                              plan.fused_schedule, grad_dtype=grad_dtype, tuner=default_tuner(plan.autotune))
    grads = views.backward(plan, dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale,
                           backend)
    return grads if grad_dtype is None else tuple(g.to(grad_dtype) for g in grads)
