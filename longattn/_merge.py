"""Merging partial attention results by their log-sum-exp, in float32.

Two partial softmax results (out_a, lse_a) and (out_b, lse_b) over disjoint
key sets combine into the softmax over the union:
    lse = lse_a - logsigmoid(lse_a - lse_b)
    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)
Rows where a side saw no key carry lse -inf and output 0; the forms below keep
such rows exact and NaN-free.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def empty_state(like: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge's identity for ``like`` (B, S, H, D): output 0 in ``dtype`` and
    lse -inf (B, H, S) float32, the state of rows that have seen no key."""
    b, s, h, d = like.shape
    return (torch.zeros(b, s, h, d, dtype=dtype, device=like.device),
            torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=like.device))


def merge_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- merge((out, lse), (out_b, lse_b)).

    out, out_b: (..., D) float32; lse, lse_b: (...) float32 aligned with out's
    leading dims. ``out`` and ``lse`` may be strided views into larger buffers.
    """
    lse_b = lse_b.float()
    # sigmoid(lse_b - lse) is the weight of b; NaN only when both are -inf,
    # where neither side has a key and out stays 0.
    w_b = torch.sigmoid(lse_b - lse).nan_to_num_(0.0)
    hi = torch.maximum(lse, lse_b)
    lo = torch.minimum(lse, lse_b)
    new_lse = hi - F.logsigmoid(hi - lo)
    new_lse = torch.where(hi == float("-inf"), hi, new_lse)
    # out - w_b * (out - out_b), as one fused pass over the output (lerp)
    out.lerp_(out_b.to(out.dtype), w_b.unsqueeze(-1))
    lse.copy_(new_lse)


def merge_stack(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c partial results over disjoint key sets merged at once: out (c, ..., D),
    lse (c, ...) aligned with out's leading dims -> (out (..., D) float32,
    lse (...) float32). The c-way form of :func:`merge_` (one pass instead of a
    chain of c - 1 pairwise merges): lse = logsumexp over c (shifted by the
    max, as logsigmoid is), out = sum_j exp(lse_j - lse) out_j; rows where no
    partial saw a key: lse -inf, out 0."""
    lse = lse.float()
    total = torch.logsumexp(lse, 0)  # -inf where every partial is -inf
    w = torch.exp(lse - total).nan_to_num_(0.0)  # -inf - -inf -> NaN -> weight 0
    return (out.float() * w.unsqueeze(-1)).sum(0), total


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
               use_triton: bool) -> None:
    """:func:`merge_` for an ``out`` of any floating dtype: float32 arithmetic, the
    result stored in ``out``'s dtype (one rounding per merge).

    out, out_b: (N, M, H, D) (strided views allowed); lse, lse_b: (N, M, H)
    float32. With ``use_triton`` (and a device the kernel runs on) one Triton
    pass reads both sides and writes the merged result; otherwise torch passes.
    """
    if use_triton and out.stride(-1) == 1 and out_b.stride(-1) == 1:
        from .kernels import merge as kmerge

        if kmerge.usable(out):
            kmerge.merge_into(out, lse, out_b, lse_b)
            return
    if out.dtype == torch.float32:
        merge_(out, lse, out_b, lse_b)
    else:
        acc = out.float()
        merge_(acc, lse, out_b, lse_b)
        out.copy_(acc)
