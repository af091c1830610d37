"""Dilated-attention baselines a user would write without longattn.

``headsplit_dilated``: the dilated-attention-pytorch algorithm (heads divided
among branches: not LongNet's function). ``longnet_gather_dilated``: LongNet's
function as its paper describes it, written the direct way: per branch and
offset, gather the selected rows, one SDPA call over every segment, LongNet's
merge of the branches by their logsumexp. The second computes the same
function as ``longattn.dilated_attention``, so the "x" against it is a cost
ratio of one function.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def headsplit_dilated(q, k, v, segment_lengths, dilation_rates, causal):
    """The dilated-attention-pytorch algorithm (baseline): heads are divided
    among the branches; branch i gathers rows ``offset::r`` (offset = i % r)
    of each segment for its head group, runs SDPA on the copies and scatters
    back; the sum is divided by the number of branches. Needs S divisible by
    every segment length. Not LongNet's definition (see longattn.dilated)."""
    b, s, h, d = q.shape
    n = len(segment_lengths)
    out = torch.zeros_like(q)
    bounds = [round(i * h / n) for i in range(n + 1)]
    g = h // k.shape[2]
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        h0, h1 = bounds[i], bounds[i + 1]
        if h1 == h0:
            continue
        off = i % r
        w = min(w, s)
        qs = q.view(b, s // w, w, h, d)[:, :, off::r, h0:h1]
        kvh = torch.arange(h0, h1, device=q.device) // g
        ks = k.view(b, s // w, w, -1, d)[:, :, off::r].index_select(3, kvh)
        vs = v.view(b, s // w, w, -1, d)[:, :, off::r].index_select(3, kvh)
        m = qs.shape[2]
        x = F.scaled_dot_product_attention(qs.reshape(-1, m, h1 - h0, d).transpose(1, 2),
                                           ks.reshape(-1, m, h1 - h0, d).transpose(1, 2),
                                           vs.reshape(-1, m, h1 - h0, d).transpose(1, 2), is_causal=causal)
        x = x.transpose(1, 2).reshape(b, s // w, m, h1 - h0, d)
        out = out.view(b, s // w, w, h, d)
        out[:, :, off::r, h0:h1] += x
        out = out.view(b, s, h, d)
    return out / n


def sdpa_with_lse(q, k, v, causal: bool, backend: Optional[str] = None):
    """(out, lse float32) of SDPA on (B, H, S, D) with equal head counts, through
    the aten op of ``backend`` ("cudnn", "flash"; None: cuDNN on CUDA, the CPU
    flash kernel on CPU). The public SDPA returns no lse, which LongNet's merge needs."""
    if q.device.type != "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    elif (backend or "cudnn") == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[:2]
    return out, lse.reshape(q.shape[:3]).float()


def _branch_parts(s: int, w: int):
    """(start, length, segment length) of the runs of whole segments: the full
    segments as one run, the partial last one by itself."""
    w = min(w, s)
    full = s // w * w
    parts = [(0, full, w)] if full else []
    if full < s:
        parts.append((full, s - full, s - full))
    return parts


def longnet_gather_dilated(q, k, v, segment_lengths, dilation_rates, causal: bool = False,
                           backend: Optional[str] = None, return_lse: bool = False):
    """LongNet dilated attention, gathered: every head in every branch, head
    ``h`` at offset ``h % r``; per (branch, offset) the selected rows of all
    segments are copied out, attended with one SDPA call (``sdpa_with_lse``),
    and the branches merged as one softmax by their lse. The same function as
    ``longattn.dilated_attention`` (its docstring states it); forward only (the
    lse of SDPA's aten ops carries no gradient). q (B, S, H, D); k, v
    (B, S, Hkv, D), GQA: head h reads kv head h // (H / Hkv).

    Equivalent per (branch (w, r), offset o), full segments::

        qs = q.view(B, S // w, w, H, D)[:, :, o::r, o::r]     # rows and heads of offset o
        ks = k.view(B, S // w, w, Hkv, D)[:, :, o::r][:, :, :, kv_head_of(o::r)]
        out_o, lse_o = sdpa_with_lse(qs, ks, vs)                # one call, all segments
        merged = sum_branches exp(lse_b - logsumexp_b(lse_b)) * out_b
    """
    b, s, h, d = q.shape
    g = h // k.shape[2]
    dev = q.device
    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise NotImplementedError("longnet-gather is forward-only: the lse of SDPA's aten ops carries no gradient, "
                                  "which LongNet's merge of the branches needs")
    acc = torch.zeros(b, s, h, d, device=dev, dtype=torch.promote_types(q.dtype, torch.float32))
    lse_all = torch.full((b, h, s), float("-inf"), device=dev)
    for w, r in zip(segment_lengths, dilation_rates):
        out_br = torch.zeros(b, s, h, d, device=dev, dtype=q.dtype)
        lse_br = torch.full((b, h, s), float("-inf"), device=dev)
        for start, length, seg in _branch_parts(s, w):
            n = length // seg
            qv, kv, vv = (x[:, start:start + length].unflatten(1, (n, seg)) for x in (q, k, v))
            ov = out_br[:, start:start + length].view(b, n, seg, h, d)
            lv = lse_br[:, :, start:start + length].view(b, h, n, seg)
            for off in range(min(r, seg, h)):
                kvh = torch.arange(off, h, r, device=dev) // g
                qs = qv[:, :, off::r, off::r]
                ks, vs = (x[:, :, off::r].index_select(3, kvh) for x in (kv, vv))
                hs, m = qs.shape[3], qs.shape[2]
                o, lse = sdpa_with_lse(*(x.flatten(0, 1).transpose(1, 2).contiguous() for x in (qs, ks, vs)),
                                       causal, backend)
                ov[:, :, off::r, off::r] = o.transpose(1, 2).reshape(b, n, m, hs, d)
                lv[:, off::r, :, off::r] = lse.reshape(b, n, hs, m).transpose(1, 2)
        new = torch.logaddexp(lse_all, lse_br)
        dead = torch.isinf(new)  # no branch so far selects this (head, position)
        keep = torch.where(dead, 0.0, torch.exp(lse_all - new)).transpose(1, 2)[..., None]
        take = torch.where(dead, 0.0, torch.exp(lse_br - new)).transpose(1, 2)[..., None]
        acc = acc * keep + out_br.to(acc.dtype) * take
        lse_all = new
        del out_br, lse_br
    out = acc.to(q.dtype)
    return (out, lse_all) if return_lse else out
