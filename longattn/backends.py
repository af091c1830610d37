"""Local attention backends: one dense attention block on one device.

Every higher-level op (``attention``, ``dilated_attention``, ``ring_attention``)
reduces to calls of two primitives on dense blocks in ``(batch, seqlen, heads,
headdim)`` layout:

* ``block_forward(q, k, v, spec) -> (out, lse)``
* ``block_backward(dout, q, k, v, out, lse, spec, dlse=None) -> (dq, dk, dv)``

The backward takes ``out`` and ``lse`` as arguments instead of recomputing
them: a block that is one piece of a larger softmax (a ring step, a dilated
branch) passes the *merged* output and lse, which makes its gradients exact
pieces of the gradient of the whole (the ring-attention identity).

Masks are defined in positions: query row ``i`` sits at position
``i + q_offset``, key row ``j`` at ``j``. A key is visible when
``(not causal or j <= pos_q)`` and ``(left < 0 or pos_q - j <= left)`` and
``(right < 0 or j - pos_q <= right)``. Rows that see no key give output 0 and
lse ``-inf``.

Each backend is a small class with its capabilities as data and
``refusals(spec, q)`` that lists why it cannot run a call; ``select_backend``
walks a priority list and returns the first one with no reasons. When the
caller forces a backend that refuses, the error lists every reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from typing import Optional, Sequence

import torch

__all__ = [
    "BlockSpec",
    "Backend",
    "BACKENDS",
    "select_backend",
    "available_backends",
    "explain",
    "use_backend",
    "block_forward",
    "block_backward",
]


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What one dense block call needs, independent of the tensors' values."""

    scale: float
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    # Position of query row 0 relative to key row 0 (see module docstring).
    q_offset: int = 0

    @property
    def has_window(self) -> bool:
        return self.window[0] >= 0 or self.window[1] >= 0

    @property
    def masked(self) -> bool:
        return self.causal or self.has_window


def _is_top_left(spec: BlockSpec, sq: int, sk: int) -> bool:
    """True when the mask is the one PyTorch SDPA's ``is_causal`` means."""
    return not spec.masked or (spec.q_offset == 0 and sq == sk)


def _is_bottom_right(spec: BlockSpec, sq: int, sk: int) -> bool:
    """True when the mask is flash-attn's (query rows aligned to the last keys)."""
    return spec.q_offset == sk - sq or not spec.masked


class Backend:
    """A local attention kernel with its capabilities stated as data."""

    name: str = ""
    devices: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    max_headdim: int = 1 << 30
    headdim_multiple: int = 1
    supports_window: bool = False
    supports_gqa_native: bool = False  # False: K/V heads are expanded first
    min_capability: tuple[int, int] = (0, 0)

    def refusals(self, spec: BlockSpec, q: torch.Tensor, k: torch.Tensor) -> list[str]:
        reasons = []
        if q.device.type not in self.devices:
            reasons.append(f"device {q.device.type} not in {self.devices}")
        if q.dtype not in self.dtypes:
            reasons.append(f"dtype {q.dtype} not in {[str(d) for d in self.dtypes]}")
        d = q.shape[-1]
        if d > self.max_headdim:
            reasons.append(f"head dim {d} > {self.max_headdim}")
        if d % self.headdim_multiple:
            reasons.append(f"head dim {d} not a multiple of {self.headdim_multiple}")
        if spec.has_window and not self.supports_window:
            reasons.append("sliding window not supported")
        if q.device.type == "cuda" and self.min_capability > (0, 0):
            cap = torch.cuda.get_device_capability(q.device)
            if cap < self.min_capability:
                reasons.append(f"compute capability {cap} < {self.min_capability}")
        reasons.extend(self._extra_refusals(spec, q, k))
        return reasons

    def _extra_refusals(self, spec, q, k) -> list[str]:
        return []

    def forward(self, q, k, v, spec: BlockSpec):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, spec: BlockSpec):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def _expand_kv(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, H, D) with head h reading kv head h // (H // Hkv)."""
    hkv = x.shape[2]
    if hkv == nheads:
        return x
    return x.repeat_interleave(nheads // hkv, dim=2)


def _reduce_kv_grad(dx: torch.Tensor, hkv: int) -> torch.Tensor:
    b, s, h, d = dx.shape
    if h == hkv:
        return dx
    return dx.view(b, s, hkv, h // hkv, d).sum(3)


def _dead_rows_to_pos_inf(lse: torch.Tensor) -> torch.Tensor:
    # Kernels compute P = exp(S - lse) in backward; a row that saw no key has
    # lse -inf by our convention, which would make P = inf. +inf makes P = 0.
    return torch.where(lse == float("-inf"), float("inf"), lse)


def _pos_inf_rows_to_dead(lse: torch.Tensor) -> torch.Tensor:
    # flash-attn marks rows with no key with +inf; the library says -inf.
    return torch.where(lse == float("inf"), float("-inf"), lse)


# --------------------------------------------------------------------------- math
class MathBackend(Backend):
    """Plain PyTorch: any device, any dtype, any mask. Chunked over query rows
    so memory stays bounded; computes in float32 (float64 for float64 input)."""

    name = "math"
    devices = ("cpu", "cuda")
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    supports_window = True
    supports_gqa_native = True
    chunk_elems = 1 << 24  # scores per chunk

    @staticmethod
    def _mask(spec: BlockSpec, rows: torch.Tensor, sk: int, device) -> Optional[torch.Tensor]:
        if not spec.masked:
            return None
        pos_q = (rows + spec.q_offset)[:, None]
        pos_k = torch.arange(sk, device=device)[None, :]
        ok = torch.ones(rows.numel(), sk, dtype=torch.bool, device=device)
        if spec.causal:
            ok &= pos_k <= pos_q
        left, right = spec.window
        if left >= 0:
            ok &= pos_q - pos_k <= left
        if right >= 0:
            ok &= pos_k - pos_q <= right
        return ok

    @staticmethod
    def _acc(t):
        return torch.float64 if t.dtype == torch.float64 else torch.float32

    def _chunks(self, q, k):
        b, sq, h, _ = q.shape
        step = max(1, self.chunk_elems // max(1, b * h * k.shape[1]))
        for s0 in range(0, sq, step):
            yield s0, min(sq, s0 + step)

    def forward(self, q, k, v, spec):
        acc = self._acc(q)
        h = q.shape[2]
        kf = _expand_kv(k, h).to(acc)
        vf = _expand_kv(v, h).to(acc)
        out = torch.empty(q.shape, dtype=acc, device=q.device)
        lse = torch.empty(q.shape[0], h, q.shape[1], dtype=torch.float32, device=q.device)
        for s0, s1 in self._chunks(q, k):
            qf = q[:, s0:s1].to(acc)
            s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * spec.scale
            mask = self._mask(spec, torch.arange(s0, s1, device=q.device), k.shape[1], q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            l = torch.logsumexp(s, dim=-1)  # (B, H, q)
            p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l)[..., None])
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            out[:, s0:s1] = torch.einsum("bhqk,bkhd->bqhd", p, vf)
            lse[:, :, s0:s1] = l.float()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        acc = self._acc(q)
        h, hkv = q.shape[2], k.shape[2]
        kf = _expand_kv(k, h).to(acc)
        vf = _expand_kv(v, h).to(acc)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kf.shape, dtype=acc, device=q.device)
        dv = torch.zeros(vf.shape, dtype=acc, device=q.device)
        for s0, s1 in self._chunks(q, k):
            qf = q[:, s0:s1].to(acc)
            do = dout[:, s0:s1].to(acc)
            l = lse[:, :, s0:s1].to(acc)
            s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * spec.scale
            mask = self._mask(spec, torch.arange(s0, s1, device=q.device), k.shape[1], q.device)
            p = torch.exp(s - _dead_rows_to_pos_inf(l)[..., None])
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv += torch.einsum("bhqk,bqhd->bkhd", p, do)
            dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
            delta = (do * out[:, s0:s1].to(acc)).sum(-1).transpose(1, 2)  # (B, H, q)
            if dlse is not None:
                delta = delta - dlse[:, :, s0:s1].to(acc)
            ds = p * (dp - delta[..., None]) * spec.scale
            dq[:, s0:s1] = torch.einsum("bhqk,bkhd->bqhd", ds, kf)
            dk += torch.einsum("bhqk,bqhd->bkhd", ds, qf)
        return dq.to(q.dtype), _reduce_kv_grad(dk, hkv).to(k.dtype), _reduce_kv_grad(dv, hkv).to(v.dtype)


# ---------------------------------------------------------- dlse folding helper
def _fold_dlse(dout, out, dlse):
    """Kernels compute delta = rowsum(dout * out). A gradient on lse enters the
    backward as delta - dlse. Pad the head dim by 8 with one extra column that
    holds (dlse, -1), so the kernel's own delta already has the term; the extra
    column of V is zero, so dP and the other gradients are unchanged.
    Returns (dout', out', pad) where pad is the padding width (0 if none)."""
    if dlse is None:
        return dout, out, 0
    b, s, h, d = out.shape
    pad = 8
    extra_do = torch.zeros(b, s, h, pad, dtype=dout.dtype, device=dout.device)
    extra_o = torch.zeros_like(extra_do)
    extra_do[..., 0] = dlse.transpose(1, 2).to(dout.dtype)
    extra_o[..., 0] = -1.0
    return torch.cat([dout, extra_do], -1), torch.cat([out, extra_o], -1), pad


def _pad_headdim(x, pad):
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


# --------------------------------------------------------------------------- flash
class FlashBackend(Backend):
    """PyTorch's vendored FlashAttention-2 (CUDA) and its CPU flash kernel.

    CUDA: ``aten::_flash_attention_forward`` in our (B, S, H, D) layout,
    native GQA, sliding windows, bottom-right aligned masks.
    CPU: ``aten::_scaled_dot_product_flash_attention_for_cpu``, top-left
    causal only, no window."""

    name = "flash"
    devices = ("cuda", "cpu")
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    max_headdim = 256
    supports_window = True
    supports_gqa_native = True
    min_capability = (8, 0)

    def _extra_refusals(self, spec, q, k):
        r = []
        sq, sk = q.shape[1], k.shape[1]
        if q.device.type == "cuda":
            if q.dtype not in (torch.float16, torch.bfloat16):
                r.append("CUDA flash kernel needs fp16/bf16")
            if q.shape[-1] % 8:
                r.append("CUDA flash kernel needs head dim multiple of 8")
            if not _is_bottom_right(spec, sq, sk):
                r.append(f"mask offset {spec.q_offset} is not bottom-right aligned ({sk - sq})")
        else:
            if spec.has_window:
                r.append("CPU flash kernel has no sliding window")
            if not _is_top_left(spec, sq, sk):
                r.append("CPU flash kernel supports only top-left causal with seqlen_q == seqlen_k")
        return r

    @staticmethod
    def _win(spec):
        left, right = spec.window
        if spec.causal:
            right = 0
        return left, right

    def forward(self, q, k, v, spec):
        if q.device.type == "cpu":
            h = q.shape[2]
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(1, 2), _expand_kv(k, h).transpose(1, 2), _expand_kv(v, h).transpose(1, 2),
                0.0, spec.causal, scale=spec.scale)
            return out.transpose(1, 2), lse.float()
        left, right = self._win(spec)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.shape[1], k.shape[1], 0.0, spec.causal, False,
            scale=spec.scale, window_size_left=left, window_size_right=right)
        return out, _pos_inf_rows_to_dead(lse)

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        dout, out, pad = _fold_dlse(dout, out, dlse)
        qp, kp, vp = (_pad_headdim(t, pad) for t in (q, k, v))
        lse = _dead_rows_to_pos_inf(lse)
        if q.device.type == "cpu":
            h, hkv = q.shape[2], k.shape[2]
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.transpose(1, 2), qp.transpose(1, 2), _expand_kv(kp, h).transpose(1, 2),
                _expand_kv(vp, h).transpose(1, 2), out.transpose(1, 2), lse, 0.0, spec.causal,
                scale=spec.scale)
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
            dk, dv = _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)
        else:
            left, right = self._win(spec)
            empty = torch.empty(0, device=q.device)
            rng = torch.zeros(2, dtype=torch.int64, device=q.device)
            # cum_seq None = not varlen (an empty tensor would mean varlen)
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                dout.contiguous(), qp, kp, vp, out.contiguous(), lse.contiguous(), None, None,
                q.shape[1], k.shape[1], 0.0, spec.causal, rng, empty,
                scale=spec.scale, window_size_left=left, window_size_right=right)
        if pad:
            dq, dk, dv = dq[..., :-pad], dk[..., :-pad], dv[..., :-pad]
        return dq, dk, dv


# --------------------------------------------------------------------------- cuDNN
def _cudnn_stats(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, S) lse, any strides -> the contiguous (B, H, S, 1) stats cuDNN's
    backward reads, dead rows (-inf) as +inf (see _dead_rows_to_pos_inf): one
    kernel, where the copy, comparison and select took three."""
    stats = torch.empty((*lse.shape, 1), dtype=torch.float32, device=lse.device)
    torch.nan_to_num(lse, nan=float("nan"), neginf=float("inf"), out=stats[..., 0])
    return stats


class CudnnBackend(Backend):
    """cuDNN's fused attention through ``aten::_scaled_dot_product_cudnn_attention``.
    About 1.7x the flash backend on Hopper (see docs/performance.md). GQA is
    native: cuDNN reads each kv head for its group of query heads and returns
    dK/dV with the kv heads' shape (no expanded copies, no reduction)."""

    name = "cudnn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_headdim = 128
    headdim_multiple = 8
    supports_gqa_native = True
    min_capability = (8, 0)

    def _extra_refusals(self, spec, q, k):
        r = []
        if not torch.backends.cudnn.is_available():
            r.append("cuDNN not available")
        if not _is_top_left(spec, q.shape[1], k.shape[1]):
            r.append("cuDNN path supports only top-left causal with seqlen_q == seqlen_k")
        return r

    def forward(self, q, k, v, spec):
        h = q.shape[2]
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, spec.causal, False,
            scale=spec.scale)
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.reshape(q.shape[0], h, q.shape[1]).float()

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        if dlse is not None:
            # Folding dlse pads the head dim past cuDNN's limit; the flash
            # kernel takes the padded call (math where flash cannot).
            alt = BACKENDS["flash"] if not BACKENDS["flash"].refusals(spec, q, k) else MATH
            return alt.backward(dout, q, k, v, out, lse, spec, dlse)
        # cuDNN wants grad_out laid out like out: strided views that already agree
        # (dilated parts) pass as they are, anything else as (B, S, H, D) memory.
        if dout.stride() != out.stride():
            dout, out = dout.contiguous(), out.contiguous()
        res = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), _cudnn_stats(lse),
            None, None, None, None, None, q.shape[1], k.shape[1], 0.0, spec.causal, scale=spec.scale)
        return tuple(t.transpose(1, 2) for t in res[:3])


# ----------------------------------------------------------------------- efficient
class EfficientBackend(Backend):
    """xformers-derived memory-efficient kernel via SDPA's aten op."""

    name = "efficient"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_headdim = 256
    headdim_multiple = 8
    min_capability = (5, 0)

    def _extra_refusals(self, spec, q, k):
        if not _is_top_left(spec, q.shape[1], k.shape[1]):
            return ["efficient path supports only top-left causal with seqlen_q == seqlen_k"]
        return []

    def forward(self, q, k, v, spec):
        h = q.shape[2]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.transpose(1, 2), _expand_kv(k, h).transpose(1, 2), _expand_kv(v, h).transpose(1, 2),
            None, True, 0.0, spec.causal, scale=spec.scale)
        return out.transpose(1, 2), lse[..., : q.shape[1]].float()

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        h, hkv = q.shape[2], k.shape[2]
        dout, out, pad = _fold_dlse(dout, out, dlse)
        qp, kp, vp = (_pad_headdim(t, pad) for t in (q, _expand_kv(k, h), _expand_kv(v, h)))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        res = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.transpose(1, 2), qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), None,
            out.transpose(1, 2), _dead_rows_to_pos_inf(lse).contiguous(), seed, seed, 0.0,
            [True, True, True, False], spec.causal, scale=spec.scale)
        dq, dk, dv = (t.transpose(1, 2) for t in res[:3])
        if pad:
            dq, dk, dv = dq[..., :-pad], dk[..., :-pad], dv[..., :-pad]
        return dq, _reduce_kv_grad(dk, hkv), _reduce_kv_grad(dv, hkv)


# ------------------------------------------------------------------------- triton
class TritonBackend(Backend):
    """Our Triton flash-attention kernel (longattn.kernels.triton_attention):
    any mask offset, sliding windows, native GQA. On CPU it runs only under
    ``TRITON_INTERPRET=1`` (tests)."""

    name = "triton"
    devices = ("cuda", "cpu")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_headdim = 256
    supports_window = True
    supports_gqa_native = True

    def _extra_refusals(self, spec, q, k):
        from .kernels import triton_attention as ta

        r = []
        if not ta.available(q.device):
            r.append(ta.unavailable_reason(q.device))
        d = q.shape[-1]
        if d not in ta.SUPPORTED_HEADDIMS:
            r.append(f"head dim {d} not in {ta.SUPPORTED_HEADDIMS}")
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            r.append("the Triton interpreter has no bf16")
        return r

    def forward(self, q, k, v, spec):
        from .kernels import triton_attention as ta

        return ta.forward(q, k, v, spec)

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        from .kernels import triton_attention as ta

        return ta.backward(dout, q, k, v, out, lse, spec, dlse)


MATH = MathBackend()
BACKENDS: dict[str, Backend] = {
    b.name: b for b in (CudnnBackend(), FlashBackend(), TritonBackend(), EfficientBackend(), MATH)
}
# "auto" walks this order; cuDNN first because it is the fastest on Hopper
# where it applies, our Triton kernel before the efficient one because it
# handles every mask offset at flash speed.
AUTO_ORDER = ("cudnn", "flash", "triton", "efficient", "math")

_state = threading.local()


def _forced() -> Optional[str]:
    return getattr(_state, "forced", None)


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``backend="auto"`` calls inside the block to use ``name``.

    >>> with longattn.use_backend("math"):
    ...     out = longattn.attention(q, k, v)
    """
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend={name!r}: choose one of {['auto', *BACKENDS]}")
    prev = _forced()
    _state.forced = None if name == "auto" else name
    try:
        yield
    finally:
        _state.forced = prev


def explain(q: torch.Tensor, k: torch.Tensor, spec: BlockSpec) -> dict[str, list[str]]:
    """Every backend and the reasons it refuses this call (empty list: usable)."""
    return {name: BACKENDS[name].refusals(spec, q, k) for name in AUTO_ORDER}


def _selection_key(q, k, spec, name, exclude):
    """Everything refusals read: device, dtypes, shapes, the spec, and on CPU
    the Triton interpreter switch (cuDNN's presence is fixed per process)."""
    dev = q.device
    interp = os.environ.get("TRITON_INTERPRET") if dev.type == "cpu" else None
    return (name, exclude, dev, q.dtype, k.dtype, q.shape[1:], k.shape[1:], spec, interp)


# Selections already made: short sequences cut into many block calls (the
# dilated views path: 16-32 per pass) are bound by host time, and walking the
# refusals of every backend costs tens of microseconds per call.
_selected: dict = {}


def select_backend(q, k, spec: BlockSpec, name: str = "auto", exclude: Sequence[str] = ()) -> Backend:
    if name == "auto":
        name = _forced() or "auto"
    key = _selection_key(q, k, spec, name, tuple(exclude))
    hit = _selected.get(key)
    if hit is None:
        hit = _select(q, k, spec, name, exclude)
        if len(_selected) > 4096:
            _selected.clear()
        _selected[key] = hit
    return hit


def _select(q, k, spec, name, exclude) -> Backend:
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"backend={name!r}: choose one of {['auto', *BACKENDS]}")
        reasons = BACKENDS[name].refusals(spec, q, k)
        if reasons:
            raise ValueError(
                f"backend={name!r} cannot run this call: {'; '.join(reasons)}. "
                f"Use backend='auto' or one of: {_usable(q, k, spec)}")
        return BACKENDS[name]
    for cand in AUTO_ORDER:
        if cand in exclude:
            continue
        if not BACKENDS[cand].refusals(spec, q, k):
            return BACKENDS[cand]
    lines = "; ".join(f"{n}: {', '.join(r)}" for n, r in explain(q, k, spec).items())
    raise ValueError(f"no attention backend supports this call ({lines})")


def _usable(q, k, spec) -> list[str]:
    return [n for n, r in explain(q, k, spec).items() if not r]


def available_backends(q, k, spec: BlockSpec) -> list[str]:
    """Names of the backends that can run this call, fastest first."""
    return _usable(q, k, spec)


def check_backend_name(name: str) -> None:
    if not isinstance(name, str) or (name != "auto" and name not in BACKENDS):
        raise ValueError(f"backend={name!r}: choose one of {['auto', *BACKENDS]}")


def block_forward(q, k, v, spec: BlockSpec, backend: str = "auto"):
    """Dense attention of one block; returns (out in q.dtype, lse float32 (B, H, Sq))."""
    return select_backend(q, k, spec, backend).forward(q, k, v, spec)


def block_backward(dout, q, k, v, out, lse, spec: BlockSpec, backend: str = "auto", dlse=None):
    """Gradients of one block given the (possibly merged) out and lse."""
    return select_backend(q, k, spec, backend).backward(dout, q, k, v, out, lse, spec, dlse=dlse)


def default_scale(headdim: int, softmax_scale: Optional[float]) -> float:
    return headdim ** -0.5 if softmax_scale is None else float(softmax_scale)


del math
