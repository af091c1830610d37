"""Dilated attention over a contiguous shard per rank: the custom ops behind
``dilated_attention(..., group=...)`` (algorithm in :mod:`longattn.distributed.dilated`)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .. import dilated as _dil
from .. import tuning as _tuning
from .._autograd import out_lse_like, register_attention_autograd
from .._validation import check_dilated_call
from ..dilated.plan import DilatedPlan
from ..distributed.ring_plan import RingPlan
from ..distributed import checks
from ..distributed import dilated as _over

__all__ = ["dilated_attention_over_ranks"]


def _plan(key: str) -> Optional[DilatedPlan]:
    return DilatedPlan.from_key(key) if key else None


# ``plan``: the local branches' DilatedPlan as a key ('' when none); ``ring_plan``: the
# spanning branches' RingPlan as a key. Both ops follow them.
@torch.library.custom_op("longattn::dilated_dist_fwd", mutates_args=(), device_types=None)
def _dist_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_lengths: list[int],
              dilation_rates: list[int], scale: float, causal: bool, group_name: str, backend: str, plan: str,
              ring_plan: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _over.forward(_plan(plan), RingPlan.from_key(ring_plan), q, k, v, segment_lengths, dilation_rates, scale,
                         causal, checks.group_from_name(group_name), backend)


@torch.library.custom_op("longattn::dilated_dist_bwd", mutates_args=(), device_types=None)
def _dist_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dlse: Optional[torch.Tensor], segment_lengths: list[int], dilation_rates: list[int],
              scale: float, causal: bool, group_name: str, backend: str, plan: str, ring_plan: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _over.backward(_plan(plan), RingPlan.from_key(ring_plan), dout, q, k, v, out, lse, dlse, segment_lengths,
                          dilation_rates, scale, causal, checks.group_from_name(group_name), backend)


_dist = register_attention_autograd(_dist_fwd, _dist_bwd, ("segment_lengths", "dilation_rates", "scale", "causal",
                                                          "group_name", "backend", "plan", "ring_plan"),
                                    fwd_fake=out_lse_like)


def dilated_attention_over_ranks(q, k, v, *, segment_lengths, dilation_rates, causal=False, softmax_scale=None,
                                 return_lse=False, backend="auto", tuning=_tuning.DILATED, group=None):
    """:func:`longattn.dilated_attention` on this rank's contiguous shard
    ``(batch, seqlen // world, nheads, headdim)``; equals the single-device
    result on the unsharded sequence. Every segment length must divide the
    shard length or be a multiple of it (see
    :func:`longattn.distributed.dilated.split_branches`): branches whose
    segments fit in a shard run locally (their engine chosen once, as on one
    device), the others as a ring over the ranks a segment spans."""
    segs, rates = check_dilated_call(q, k, v, segment_lengths, dilation_rates, causal, return_lse, softmax_scale)
    backend = bk.resolve(backend)
    g = checks.resolve_group(group)
    local, _ = _over.split_branches(q.shape[1], dist.get_world_size(g), segs, rates)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if not torch.compiler.is_compiling():
        checks.check_consistent(g, "dilated_attention", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                                segs=segs, rates=rates, causal=causal, scale=scale, backend=backend)
    plan = _dil.choose(q, k, [w for w, _ in local], [r for _, r in local], causal, backend, tuning) if local else None
    ring_plan = _over.make_ring_plan(q, k, segs, rates, causal, scale, g, backend)
    out, lse = _dist(q, k, v, list(segs), list(rates), scale, causal, checks.group_name(g), backend,
                     plan.key() if plan else "", ring_plan)
    return (out, lse) if return_lse else out
