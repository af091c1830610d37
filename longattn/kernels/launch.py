"""Launchers of the Triton attention kernels and the adapters the backends
and the dilated engines call: dense blocks, packed documents, one dilated
branch, the grouped dilated schedule."""
from __future__ import annotations

from typing import Optional

import torch

from ._common import HAS_TRITON, LOG2E, contig, d_pad, ieee, launchable
from .autotune import Autotuner, default_tuner, scratch, scratch_lse
from .geometry import Geometry, GroupedPlan

if HAS_TRITON:
    import triton

    from .attention_jit import _bwd_preprocess, _dkdv_kernel, _dq_kernel, _fwd_kernel
    from .grouped_jit import _grouped_dkdv_kernel, _grouped_dq_kernel, _grouped_fwd_kernel


def _strides(*xs: torch.Tensor) -> tuple:
    """(batch, row, head) strides of each tensor, in order."""
    return tuple(s for x in xs for s in x.stride()[:3])


def launch_forward(q, k, v, out, lse, geo: Geometry, scale: float, merge: bool, tuner: Optional[Autotuner] = None):
    def trial(cfg, nseg):  # the autotuner's run: the first nseg segments into scratch
        o, l = scratch(out, geo, nseg), scratch_lse(lse, geo, nseg)
        # merging, as most branches do (its epilogue moves the best tile)
        _forward(q, k, v, o, l, geo, scale, True, cfg, nseg)

    cfg = (tuner or default_tuner()).config("fwd", q, k, geo, trial)
    _forward(q, k, v, out, lse, geo, scale, merge, cfg, geo.nseg)


def _forward(q, k, v, out, lse, geo, scale, merge, cfg, nseg):
    b, _, h, d = q.shape
    grid = (triton.cdiv(geo.max_m, cfg["BLOCK_M"]), b * h, nseg)
    # CU is only read under VARLEN; otherwise any read-only tensor (never an
    # output: traced launches must not see an output passed twice)
    launchable(_fwd_kernel, q)[grid](
        q, k, v, out, lse, geo.cu_arg(q), *_strides(q, k, v, out), lse.stride(0), lse.stride(1), h,
        h // k.shape[2], *geo.scalars(), scale * LOG2E, geo.inner,
        D=d, D_PAD=d_pad(d), MERGE=merge, IEEE=ieee(q), **geo.flags(), **cfg)


def launch_preprocess(out, dout, dlse, delta):
    """delta = rowsum(dout * out) - dlse, (B, H, S) float32."""
    b, s, h, d = out.shape
    block = 16 if out.device.type == "cpu" else 64
    grid = (triton.cdiv(s, block), b * h)
    launchable(_bwd_preprocess, out)[grid](
        out, dout, dlse if dlse is not None else out, delta, *_strides(out, dout), delta.stride(0), delta.stride(1),
        h, s, D=d, D_PAD=d_pad(d), BLOCK=block, HAS_DLSE=dlse is not None)


def launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo: Geometry, scale: float, accum: bool,
                    tuner: Optional[Autotuner] = None):
    tuner = tuner or default_tuner()

    def trial_dkdv(cfg, nseg):
        _dkdv(q, k, v, dout, lse, delta, scratch(dk, geo, nseg), scratch(dv, geo, nseg), geo, scale, False,
              cfg, nseg)

    def trial_dq(cfg, nseg):
        _dq(q, k, v, dout, lse, delta, scratch(dq, geo, nseg), geo, scale, False, cfg, nseg)

    _dkdv(q, k, v, dout, lse, delta, dk, dv, geo, scale, accum, tuner.config("dkdv", q, k, geo, trial_dkdv), geo.nseg)
    _dq(q, k, v, dout, lse, delta, dq, geo, scale, accum, tuner.config("dq", q, k, geo, trial_dq), geo.nseg)


def _dkdv(q, k, v, dout, lse, delta, dk, dv, geo, scale, accum, cfg, nseg):
    b, _, h, d = q.shape
    hkv = k.shape[2]
    ncls = geo.r if geo.dilated else 1
    launchable(_dkdv_kernel, q)[(triton.cdiv(geo.max_mk, cfg["BLOCK_N"]), b * hkv * ncls, nseg)](
        q, k, v, dout, lse, delta, dk, dv, geo.cu_arg(q), *_strides(q, k, v, dout), lse.stride(0), lse.stride(1),
        *_strides(dk, dv), h, hkv, h // hkv, ncls, *geo.scalars(), scale, scale * LOG2E, geo.inner,
        D=d, D_PAD=d_pad(d), ACCUM=accum, IEEE=ieee(q), **geo.flags(), **cfg)


def _dq(q, k, v, dout, lse, delta, dq, geo, scale, accum, cfg, nseg):
    b, _, h, d = q.shape
    launchable(_dq_kernel, q)[(triton.cdiv(geo.max_m, cfg["BLOCK_M"]), b * h, nseg)](
        q, k, v, dout, lse, delta, dq, geo.cu_arg(q), *_strides(q, k, v, dout), lse.stride(0), lse.stride(1),
        *_strides(dq), h, h // k.shape[2], *geo.scalars(), scale, scale * LOG2E, geo.inner,
        D=d, D_PAD=d_pad(d), ACCUM=accum, IEEE=ieee(q), **geo.flags(), **cfg)


def launch_grouped_forward(q, k, v, out, lse, plan: GroupedPlan, scale: float, tuner: Optional[Autotuner] = None):
    br = plan.table(q.device)

    def trial(cfg, nseg):
        _grouped_forward(q, k, v, scratch(out, plan, nseg), scratch_lse(lse, plan, nseg), br, plan, scale, cfg,
                         nseg)

    cfg = (tuner or default_tuner()).config("grouped_fwd", q, k, plan, trial)
    _grouped_forward(q, k, v, out, lse, br, plan, scale, cfg, plan.nseg)


def _grouped_forward(q, k, v, out, lse, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    grid = (triton.cdiv(plan.max_m, cfg["BLOCK_M"]), b * h, nseg * plan.r0)
    launchable(_grouped_fwd_kernel, q)[grid](
        q, k, v, out, lse, br, *_strides(q, k, v, out), lse.stride(0), lse.stride(1), h, h // k.shape[2], plan.sq,
        plan.w, plan.r0, nseg, scale * LOG2E, NB=len(plan.segs), D=d, D_PAD=d_pad(d), CAUSAL=plan.causal,
        IEEE=ieee(q), **cfg)


def launch_grouped_backward(q, k, v, dout, lse, delta, dq, dk, dv, plan: GroupedPlan, scale: float,
                            tuner: Optional[Autotuner] = None):
    tuner = tuner or default_tuner()
    br = plan.table(q.device)

    def trial_dkdv(cfg, nseg):
        _grouped_dkdv(q, k, v, dout, lse, delta, scratch(dk, plan, nseg), scratch(dv, plan, nseg), br, plan,
                      scale, cfg, nseg)

    def trial_dq(cfg, nseg):
        _grouped_dq(q, k, v, dout, lse, delta, scratch(dq, plan, nseg), br, plan, scale, cfg, nseg)

    _grouped_dkdv(q, k, v, dout, lse, delta, dk, dv, br, plan, scale,
                  tuner.config("grouped_dkdv", q, k, plan, trial_dkdv), plan.nseg)
    _grouped_dq(q, k, v, dout, lse, delta, dq, br, plan, scale, tuner.config("grouped_dq", q, k, plan, trial_dq),
                plan.nseg)


def _grouped_dkdv(q, k, v, dout, lse, delta, dk, dv, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    hkv = k.shape[2]
    launchable(_grouped_dkdv_kernel, q)[(triton.cdiv(plan.max_m, cfg["BLOCK_N"]), b * hkv, nseg * plan.r0)](
        q, k, v, dout, lse, delta, dk, dv, br, *_strides(q, k, v, dout), lse.stride(0), lse.stride(1),
        *_strides(dk, dv), h, hkv, h // hkv, plan.sq, plan.w, plan.r0, nseg, scale, scale * LOG2E,
        NB=len(plan.segs), D=d, D_PAD=d_pad(d), CAUSAL=plan.causal, IEEE=ieee(q), **cfg)


def _grouped_dq(q, k, v, dout, lse, delta, dq, br, plan, scale, cfg, nseg):
    b, _, h, d = q.shape
    launchable(_grouped_dq_kernel, q)[(triton.cdiv(plan.max_m, cfg["BLOCK_M"]), b * h, nseg * plan.r0)](
        q, k, v, dout, lse, delta, dq, br, *_strides(q, k, v, dout), lse.stride(0), lse.stride(1), *_strides(dq),
        h, h // k.shape[2], plan.sq, plan.w, plan.r0, nseg, scale, scale * LOG2E, NB=len(plan.segs), D=d,
        D_PAD=d_pad(d), CAUSAL=plan.causal, IEEE=ieee(q), **cfg)


# -------------------------------------------------------------- dense and varlen adapters
def forward(q, k, v, spec):
    """Dense block forward for the ``triton`` backend (see longattn.backends)."""
    q, k, v = contig(q), contig(k), contig(v)
    b, sq, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device=q.device)
    geo = Geometry(sq, k.shape[1], causal=spec.causal, window=spec.window, q_offset=spec.q_offset)
    launch_forward(q, k, v, out, lse, geo, spec.scale, merge=False)
    return out, lse


def backward(dout, q, k, v, out, lse, spec, dlse=None):
    q, k, v, dout, out = (contig(t) for t in (q, k, v, dout, out))
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    launch_preprocess(out, dout, None if dlse is None else dlse.float().contiguous(), delta)
    dq = torch.empty_like(q)
    # GQA: a kv head's program loops over its query heads, so dK/dV are
    # written once, in the input dtype, with no reduction pass.
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    geo = Geometry(q.shape[1], k.shape[1], causal=spec.causal, window=spec.window, q_offset=spec.q_offset)
    launch_backward(q, k, v, dout, lse, delta, dq, dk, dv, geo, spec.scale, accum=False)
    return dq, dk, dv


def varlen_forward(q, k, v, cu_seqlens, max_seqlen, spec):
    """q (total, H, D), k/v (total, Hkv, D); returns out and lse (H, total)."""
    q4, k4, v4 = (contig(t).unsqueeze(0) for t in (q, k, v))
    out = torch.empty_like(q4)
    lse = torch.empty(1, q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    geo = Geometry(q.shape[0], k.shape[0], causal=spec.causal, window=spec.window, cu_seqlens=cu_seqlens,
                   max_seqlen=max_seqlen)
    launch_forward(q4, k4, v4, out, lse, geo, spec.scale, merge=False)
    return out[0], lse[0]


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, spec, dlse=None):
    q4, k4, v4, do4, o4 = (contig(t).unsqueeze(0) for t in (q, k, v, dout, out))
    lse4 = lse.contiguous().unsqueeze(0)
    delta = torch.empty_like(lse4)
    launch_preprocess(o4, do4, None if dlse is None else dlse.float().contiguous().unsqueeze(0), delta)
    dq, dk, dv = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)
    geo = Geometry(q.shape[0], k.shape[0], causal=spec.causal, window=spec.window, cu_seqlens=cu_seqlens,
                   max_seqlen=max_seqlen)
    launch_backward(q4, k4, v4, do4, lse4, delta, dq, dk, dv, geo, spec.scale, accum=False)
    return dq[0], dk[0], dv[0]
