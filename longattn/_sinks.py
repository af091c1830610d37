"""Attention sinks: a learned logit per head in the softmax denominator
(GPT-OSS's ``s_aux``), added once to an attention result.

A sink ``s_h`` is one more score in every row of head ``h`` whose value
vector is zero: ``out' = sum_j exp(S_j - L') v_j`` with
``L' = logaddexp(L, s_h)``. Given the result ``(out, L)`` over the keys,
that is ``out' = out * exp(L - L')``, so the sink merges once, after every
block (or ring step) has been merged by lse; the kernels never see it. Rows
that see no key (``L = -inf``) give ``out' = 0`` and ``L' = s_h``.

Gradients come from autograd through these few elementwise ops (they are
not kernels): with ``w = exp(L - L')``, ``dout = w dout'``,
``dL = w dL' + (1 - w) rowsum(dout' * out')`` and
``ds_h = sum over rows of (1 - w) (dL' - rowsum(dout' * out'))``.

Across ranks (ring, Ulysses, the hybrid) the sink merges on each rank's
shard of the rows, after the distributed attention: each rank's gradient of
``sinks`` is then the sum over its own rows, a partial gradient of a
replicated parameter that the group sums like every other
(:func:`longattn.context_parallel.all_reduce_grads`).
"""
from __future__ import annotations

import torch


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, varlen: bool = False):
    """``(out', lse')`` of ``(out, lse)`` with one sink logit per head.

    out ``(B, S, H, D)`` with lse ``(B, H, S)``, or with ``varlen`` out
    ``(T, H, D)`` with lse ``(H, T)``; sinks ``(H,)`` (-inf: that head has none). lse' is float32."""
    s = sinks.to(torch.promote_types(sinks.dtype, torch.float32))
    s = s[:, None] if varlen else s[None, :, None]
    # A sink of -inf is no sink: that head keeps (out, lse). Both branches stay finite where they are not taken,
    # so no NaN reaches a gradient through the where (a row with no key and no sink would give -inf - -inf).
    none = torch.isneginf(s)
    merged = torch.logaddexp(lse, torch.where(none, 0.0, s))
    new = torch.where(none, lse, merged)
    w = torch.where(none, 1.0, torch.exp(lse - merged))  # (B, H, S) / (H, T); 0 where no key was seen
    w = w.transpose(0, 1) if varlen else w.transpose(1, 2)
    return out * w[..., None].to(out.dtype), new.float()


def sinks_meta(sinks) -> tuple | None:
    """What must match across ranks about ``sinks`` (its values are a
    replicated parameter's, not checked): (shape, dtype), or None."""
    if not isinstance(sinks, torch.Tensor):
        return None if sinks is None else type(sinks).__name__
    return tuple(sinks.shape), str(sinks.dtype)
