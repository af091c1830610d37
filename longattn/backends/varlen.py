"""Packed documents on one device: which kernel runs ``attention_varlen``, and running it.

Kernels: a loop over documents through the dense backends (cuDNN on CUDA; any
device and dtype), our Triton kernel (one launch for all documents; program z
is document z), PyTorch's FlashAttention-2 varlen kernel (CUDA, fp16/bf16) and
FlashAttention-4's (one launch; where installed, :mod:`._fa4_api`).
:func:`choose` makes the choice from the backends' capabilities and
:class:`longattn.tuning.VarlenTuning`.
"""
from __future__ import annotations

import torch

from .. import tuning as _tuning
from . import BACKENDS, BlockSpec, _fa4_api, aten, block_backward, block_forward

KINDS = ("loop", "fa4", "flash", "triton")
_ONE_LAUNCH = ("fa4", "flash", "triton")


def choose(q: torch.Tensor, backend: str, ndocs: int, tuning: _tuning.VarlenTuning = _tuning.VARLEN,
           softcap: float = 0.0, loop_ok: bool = True) -> str:
    """The kernel for a call on ``q`` (T, H, D) with ``ndocs`` documents:
    ``backend="fa4"`` / ``"triton"`` / ``"flash"`` their varlen kernels
    (ValueError when they cannot run it), another backend name a loop over
    documents through it; ``"auto"`` on CUDA takes FA4's varlen kernel where
    it can run, else loops over long documents (one cuDNN call each), else
    flash varlen, else Triton; elsewhere the loop. ``softcap`` (logit
    soft-capping) is a capability like the others: a varlen kernel without it
    refuses, and the loop's dense backend is chosen from capabilities that
    include it. ``backend`` is already resolved
    (:func:`longattn.backends.resolve`): a name forced with
    :func:`longattn.use_backend` arrives as that name. ``loop_ok=False``
    (under CUDA graph capture, where the loop's host read of the documents
    cannot run): a varlen kernel or ValueError."""
    if backend in _ONE_LAUNCH:
        why = refusals(backend, q, softcap)
        if why:
            raise ValueError(f"backend={backend!r} cannot run this varlen call: {'; '.join(why)}; use "
                             "backend='auto' or a dense backend's name (one call per document)")
        return backend
    if backend != "auto":
        if not loop_ok:
            raise ValueError(f"backend={backend!r} runs one call per document, which reads cu_seqlens on the host: "
                             f"not under CUDA graph capture; use backend='auto' or a varlen kernel {_ONE_LAUNCH}")
        return "loop"
    # FA4 in one launch beat the cuDNN loop on long documents too (one H200, 128K
    # tokens, causal, fwd+bwd: 33 documents 42.8 -> 34.6 ms, 114 documents 26.7 -> 16.1)
    if not refusals("fa4", q, softcap):
        return "fa4"
    triton_why, flash_why = refusals("triton", q, softcap), refusals("flash", q, softcap)
    long_docs = q.shape[0] >= tuning.loop_min_mean_tokens * max(ndocs, 1)
    if long_docs and q.device.type == "cuda" and loop_ok:
        return "loop"
    if not flash_why:
        return "flash"
    if not triton_why and q.device.type == "cuda":
        return "triton"
    if not loop_ok:
        raise ValueError("no varlen kernel takes this call (fa4: " + "; ".join(refusals("fa4", q, softcap)) +
                         "; flash: " + "; ".join(flash_why) + "), and one call per document reads cu_seqlens on the "
                         "host, which CUDA graph capture cannot run: call it outside the capture")
    return "loop"


def refusals(kind: str, q: torch.Tensor, softcap: float = 0.0) -> list[str]:
    """Why the one-launch kernel ``kind`` cannot take packed documents ``q`` (T, H, D)."""
    b = BACKENDS[kind]
    why = [] if not softcap or b.supports_softcap else ["logit soft-capping (softcap) not supported"]
    return why + (b.kernel_refusals(q) if kind == "triton" else b.varlen_refusals(q))


def _dense_name(backend: str) -> str:
    """The dense backend a document loop uses: the varlen kernels' names mean auto."""
    return backend if backend not in _ONE_LAUNCH else "auto"


def forward(kind: str, q, k, v, cu: torch.Tensor, max_seqlen: int, spec: BlockSpec, backend: str):
    """out (T, H, D) and lse (H, T); ``cu`` as :func:`op_cu_seqlens` makes it
    (the loop reads it on the host, the kernels take it on q's device)."""
    if kind in _ONE_LAUNCH:
        cu = cu.to(q.device)
    if kind == "triton":
        from ..kernels import launch

        return launch.varlen_forward(q, k, v, cu, max_seqlen, spec)
    if kind == "fa4":
        return _fa4_api.forward(q, k, v, spec.scale, spec.causal, spec.flash_window(), cu, max_seqlen,
                                softcap=spec.softcap)
    if kind == "flash":
        return aten.flash_forward(q, k, v, spec.scale, spec.causal, spec.flash_window(), cu, cu, max_seqlen,
                                  max_seqlen)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for a, e in _docs(cu):
        o, l = block_forward(q[None, a:e], k[None, a:e], v[None, a:e], spec, _dense_name(backend))
        out[a:e] = o[0]
        lse[:, a:e] = l[0]
    return out, lse


def backward(kind: str, dout, q, k, v, out, lse, dlse, cu: torch.Tensor, max_seqlen: int, spec: BlockSpec,
             backend: str):
    if kind in _ONE_LAUNCH:
        cu = cu.to(q.device)
    if kind == "triton":
        from ..kernels import launch

        return launch.varlen_backward(dout, q, k, v, out, lse, cu, max_seqlen, spec, dlse)
    if kind == "fa4":
        return _fa4_api.backward(dout, q, k, v, out, lse, spec.scale, spec.causal, spec.flash_window(), dlse, cu,
                                 max_seqlen, softcap=spec.softcap)
    if kind == "flash" and dlse is None:  # FlashAttention-2 takes no lse gradient: the loop does
        return aten.flash_backward(dout, q, k, v, out, lse, spec.scale, spec.causal, spec.flash_window(), cu, cu,
                                   max_seqlen, max_seqlen)[:3]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, e in _docs(cu):
        g = block_backward(dout[None, a:e], q[None, a:e], k[None, a:e], v[None, a:e], out[None, a:e],
                           lse[None, :, a:e].contiguous(), spec, _dense_name(backend),
                           dlse=None if dlse is None else dlse[None, :, a:e].contiguous())
        dq[a:e], dk[a:e], dv[a:e] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def op_cu_seqlens(kind: str, cu_seqlens: torch.Tensor, values, device: torch.device) -> torch.Tensor:
    """The cu_seqlens a call hands its kernel ``kind`` (forward and backward),
    from the tensor given and its ``values`` already read: a document loop
    slices on the host, so a host tensor (reading one waits for nothing);
    one launch takes it on the device, so a host tensor is copied without
    waiting for the device (a blocking copy waits for every kernel queued,
    and the host then cannot run ahead of the GPU)."""
    if kind == "loop":
        return cu_seqlens if cu_seqlens.device.type == "cpu" else torch.tensor(values, dtype=torch.int32, device="cpu")
    return cu_seqlens if cu_seqlens.device == device else cu_seqlens.to(device, non_blocking=True)


def _docs(cu: torch.Tensor):
    bounds = cu.tolist()
    return [(a, e) for a, e in zip(bounds[:-1], bounds[1:]) if e > a]
