"""What every backend shares: the block spec, the capability-checked base
class, and the lse conventions at the kernel boundary."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What one dense block call needs, independent of the tensors' values."""

    scale: float
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    # Position of query row 0 relative to key row 0 (see the package docstring).
    q_offset: int = 0
    # Logit soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap)
    # before the mask and softmax; 0 is none. Elementwise per score, so each
    # block's lse still merges with the others'.
    softcap: float = 0.0

    @property
    def has_window(self) -> bool:
        return self.window[0] >= 0 or self.window[1] >= 0

    @property
    def masked(self) -> bool:
        return self.causal or self.has_window

    def flash_window(self) -> tuple[int, int]:
        """(left, right) as flash kernels take them: causal is right = 0."""
        left, right = self.window
        return left, (0 if self.causal else right)


def is_top_left(spec: BlockSpec, sq: int, sk: int) -> bool:
    """True when the mask is the one PyTorch SDPA's ``is_causal`` means."""
    return not spec.masked or (spec.q_offset == 0 and sq == sk)


def is_bottom_right(spec: BlockSpec, sq: int, sk: int) -> bool:
    """True when the mask is flash-attn's (query rows aligned to the last keys)."""
    return spec.q_offset == sk - sq or not spec.masked


class Backend:
    """A local attention kernel with its capabilities stated as data.

    ``forward(q, k, v, spec) -> (out, lse)``; ``backward(dout, q, k, v, out,
    lse, spec, dlse=None) -> (dq, dk, dv)`` takes the (possibly merged) output
    and lse, and the lse's gradient when the caller used the lse."""

    name: str = ""
    devices: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    max_headdim: int = 1 << 30
    headdim_multiple: int = 1
    supports_window: bool = False
    supports_gqa_native: bool = False  # False: K/V heads are expanded first
    supports_softcap: bool = False
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
        if spec.softcap and not self.supports_softcap:
            reasons.append("logit soft-capping (softcap) not supported")
        if q.device.type == "cuda" and self.min_capability > (0, 0):
            cap = self.capability(q.device)
            if cap < self.min_capability:
                reasons.append(f"compute capability {cap} < {self.min_capability}")
        reasons.extend(self._extra_refusals(spec, q, k))
        return reasons

    def _extra_refusals(self, spec, q, k) -> list[str]:
        return []

    def auto_refusals(self, q: torch.Tensor) -> list[str]:
        """Why ``backend="auto"`` passes over this backend for ``q`` although it
        can run the call (a forced ``backend=`` name still runs it)."""
        return []

    def capability(self, device: torch.device) -> tuple[int, int]:
        """The CUDA compute capability refusals read (tests substitute one)."""
        return torch.cuda.get_device_capability(device)

    def forward(self, q, k, v, spec: BlockSpec):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, spec: BlockSpec, dlse: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def expand_kv(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, S, H, D) with head h reading kv head h // (H // Hkv)."""
    hkv = x.shape[2]
    if hkv == nheads:
        return x
    return x.repeat_interleave(nheads // hkv, dim=2)


def reduce_kv_grad(dx: torch.Tensor, hkv: int) -> torch.Tensor:
    """The gradient of expand_kv: (B, S, H, D) -> (B, S, Hkv, D)."""
    b, s, h, d = dx.shape
    if h == hkv:
        return dx
    return dx.view(b, s, hkv, h // hkv, d).sum(3)


def dead_rows_to_pos_inf(lse: torch.Tensor) -> torch.Tensor:
    # Kernels compute P = exp(S - lse) in backward; a row that saw no key has
    # lse -inf by our convention, which would make P = inf. +inf makes P = 0.
    return torch.where(lse == float("-inf"), float("inf"), lse)


def pos_inf_rows_to_dead(lse: torch.Tensor) -> torch.Tensor:
    # flash-attn marks rows with no key with +inf; the library says -inf. One
    # kernel (a comparison and a select took two: a decode step is host-bound).
    return torch.nan_to_num(lse, nan=float("nan"), posinf=float("-inf"), neginf=float("-inf"))


def fold_dlse(dout, out, dlse):
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


def pad_headdim(x: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, pad)) if pad else x
