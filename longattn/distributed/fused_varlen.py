"""A packed-document ring step as one varlen launch per mask kind
(FlashAttention-4's where it runs, else PyTorch's FlashAttention-2), instead
of one backend call (and merge) per document block. :func:`step_kernel`
chooses the kernel, once per call (it travels in the call's
:class:`longattn.distributed.ring_plan.RingPlan`)."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import backends as bk
from ..backends import _fa4_api, aten
from ..backends import varlen as _varlen
from .plan import Call, fuse_segments, local_length, plan_varlen, worth_fusing


class FlashVarlen:
    """PyTorch's FlashAttention-2 varlen kernel with separate query and key documents
    (the causal part bottom-right aligned): (total_q, H, D) -> out, lse (H, total_q).
    It takes no lse gradient (``takes_dlse``)."""

    takes_dlse = False

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        return aten.flash_forward(q, k, v, scale, causal, (-1, 0 if causal else -1), cu_q, cu_k, max_q, max_k)

    @staticmethod
    def backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float, dlse=None):
        return aten.flash_backward(do, q, k, v, o, lse, scale, causal, (-1, 0 if causal else -1), cu_q, cu_k,
                                   max_q, max_k)[:3]


class FA4Varlen:
    """FlashAttention-4's varlen kernel (:mod:`longattn.backends._fa4_api`), the
    same contract as :class:`FlashVarlen`; its backward takes the lse's gradient."""

    takes_dlse = True

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        return _fa4_api.forward(q, k, v, scale, causal, (-1, 0 if causal else -1), cu_q, max_q, cu_k=cu_k,
                                max_seqlen_k=max_k)

    @staticmethod
    def backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal: bool, scale: float, dlse=None):
        return _fa4_api.backward(do, q, k, v, o, lse, scale, causal, (-1, 0 if causal else -1), dlse, cu_q, max_q,
                                 cu_k=cu_k, max_seqlen_k=max_k)


FLASH_VARLEN = FlashVarlen()
KERNELS = {"fa4": FA4Varlen(), "flash": FLASH_VARLEN}


class FusedVarlenStep:
    """The document blocks of one ring step as one varlen launch per mask
    kind (full, causal), instead of one backend call (and merge) per block.

    Each segment is a range of local query rows with the key rows it sees in
    the visiting block, gathered by index (a query piece that sees two key
    pieces sees their concatenation, its causal part bottom-right aligned as
    flash kernels do). Rows in no segment get output 0 and lse -inf.
    ``kernel``: a name of :data:`KERNELS` or an object with their methods.
    """

    def __init__(self, calls, segs, scale: float, device, kernel=None):
        self.calls, self.scale = calls, scale
        self.kernel = KERNELS.get(kernel, kernel) if isinstance(kernel, str) else (kernel or FLASH_VARLEN)
        self.launches = []
        for causal in (False, True):
            mine = [sg for sg in segs if sg[2] == causal]
            if not mine:
                continue
            q_idx = torch.cat([torch.arange(q0, q1, device="cpu") for (q0, q1), _, _ in mine])
            k_idx = torch.cat([torch.cat([torch.arange(a, b, device="cpu") for a, b in ks]) for _, ks, _ in mine])
            lq = [q1 - q0 for (q0, q1), _, _ in mine]
            lk = [sum(b - a for a, b in ks) for _, ks, _ in mine]
            cu = lambda ls: torch.tensor([0] + ls, dtype=torch.int64, device="cpu").cumsum(0).to(torch.int32).to(device)
            self.launches.append((q_idx.to(device), k_idx.to(device), cu(lq), cu(lk), max(lq), max(lk), causal))

    def forward(self, q, k, v):
        _, l, h, _ = q.shape
        out = torch.zeros_like(q)
        lse = torch.full((1, h, l), float("-inf"), dtype=torch.float32, device=q.device)
        for q_idx, k_idx, cu_q, cu_k, mq, mk, causal in self.launches:
            o, ls = self.kernel.forward(q[0].index_select(0, q_idx), k[0].index_select(0, k_idx),
                                       v[0].index_select(0, k_idx), cu_q, cu_k, mq, mk, causal, self.scale)
            out[0].index_copy_(0, q_idx, o)
            lse[0].index_copy_(1, q_idx, ls)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, dlse):
        if dlse is not None and not getattr(self.kernel, "takes_dlse", False):
            return None  # FlashAttention-2 has no lse gradient: the ring runs self.calls one by one
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for q_idx, k_idx, cu_q, cu_k, mq, mk, causal in self.launches:
            sel = lambda t: t[0].index_select(0, q_idx)
            extra = {} if dlse is None else dict(dlse=dlse[0].index_select(1, q_idx))
            g_q, g_k, g_v = self.kernel.backward(sel(dout), sel(q), k[0].index_select(0, k_idx),
                                                 v[0].index_select(0, k_idx), sel(out), lse[0].index_select(1, q_idx),
                                                 cu_q, cu_k, mq, mk, causal, self.scale, **extra)
            dq[0].index_copy_(0, q_idx, g_q)
            dk[0].index_add_(0, k_idx, g_k.float())  # a key row may serve two segments: add
            dv[0].index_add_(0, k_idx, g_v.float())
        return dq, dk, dv


@functools.lru_cache(maxsize=256)
def fused_call(cu: tuple, layout: str, world: int, rank: int, src: int, causal: bool, window: tuple, scale: float,
               device: str, heads_x_dim: int, kernel=None, chunk: int = 0) -> Optional[tuple]:
    """The step's calls as one :class:`FusedVarlenStep` call on ``kernel`` (see
    there; :func:`step_kernel`'s choice), or None where fusing does not pay
    (:func:`worth_fusing`) or a block's mask does not fit."""
    calls = plan_varlen(cu, layout, world, rank, src, causal, window, scale, 0.0, chunk)
    if len(calls) < 2 or not worth_fusing(calls, heads_x_dim):
        return None
    segs = fuse_segments(calls)
    if segs is None:
        return None
    length = local_length(cu, layout, world)
    step = FusedVarlenStep(calls, segs, scale, torch.device(device), kernel)
    return (Call(0, length, 0, length, bk.BlockSpec(scale), run=step),)


def step_kernel(q: torch.Tensor, window: tuple, backend: str, softcap: float = 0.0) -> str:
    """The varlen kernel packed-document ring steps fuse into, or "" where they
    do not: the one place this is chosen, from the kernels' capabilities
    (:func:`longattn.backends.varlen.refusals`, on the local tokens ``q``
    (T, H, D)). FA4's where it runs (with the backend left to ``auto`` or
    forced to ``fa4``), else FlashAttention-2's (``auto`` or ``flash``; CUDA
    sm80+, fp16/bf16, head dim % 8 == 0 and <= 256). Never with a window or
    soft-capping: a fused segment concatenates key pieces, whose positions a
    window would need, and the segments are planned without soft-capping."""
    if window != (-1, -1) or softcap:
        return ""
    for name in KERNELS:
        if backend in ("auto", name) and not _varlen.refusals(name, q):
            return name
    return ""
