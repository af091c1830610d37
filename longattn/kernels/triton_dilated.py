"""Fused dilated attention: one kernel launch per branch, no gathered copies.

Forward: branch 1 writes a float32 running output and lse, each later branch
merges into them in its epilogue (launches are ordered on the stream, and
inside one launch each (row, head) has one owner). Backward: one
``delta = rowsum(dO * O) - dlse`` pass over the merged output, then per
branch a dK/dV and a dQ launch that add into float32 accumulators.
Extra memory beyond inputs, outputs and grads: the float32 accumulators
(out, dq, dk, dv) and delta, i.e. O(S * H * D), independent of the branches.
"""
from __future__ import annotations

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


def _branches(seqlen, segment_lengths, dilation_rates, causal):
    for w, r in zip(segment_lengths, dilation_rates):
        yield ta.Geometry(seqlen, seqlen, w=w, r=r, causal=causal)


def forward(q, k, v, segment_lengths, dilation_rates, causal, scale, out_dtype=None):
    q, k, v = (ta._contig(t) for t in (q, k, v))
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    for geo in _branches(s, segment_lengths, dilation_rates, causal):
        ta.launch_forward(q, k, v, out, lse, geo, scale, merge=True)
    return out.to(out_dtype or q.dtype), lse


def backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale):
    q, k, v, dout, out = (ta._contig(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    ta.launch_preprocess(out, dout, None if dlse is None else dlse.float().contiguous(), delta)
    s = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for geo in _branches(s, segment_lengths, dilation_rates, causal):
        ta.launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo, scale, accum=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
