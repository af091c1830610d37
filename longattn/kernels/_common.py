"""What every Triton kernel module shares: whether Triton runs here, head
dims the kernels take, and the small launch helpers."""
from __future__ import annotations

import torch

from .._config import ENV

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised on machines without triton
    HAS_TRITON = False

SUPPORTED_HEADDIMS = (16, 32, 64, 96, 128, 256)
LOG2E = 1.4426950408889634


def interpreted() -> bool:
    """Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return ENV.triton_interpret


def available(device: torch.device) -> bool:
    return not unavailable_reason(device)


def unavailable_reason(device: torch.device) -> str:
    if not HAS_TRITON:
        return "triton is not installed"
    if device.type == "cpu" and not interpreted():
        return "Triton runs on CPU only under TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type} unsupported"
    return ""


def d_pad(d: int) -> int:
    """The head dim rounded up to the power of two the kernels' tiles use."""
    return max(16, 1 << (d - 1).bit_length())


def ieee(x: torch.Tensor) -> bool:
    """float32 inputs take IEEE dots (tf32 would miss the float32 tests' 1e-4)."""
    return x.dtype == torch.float32


def launchable(kernel, x: torch.Tensor):
    """The kernel to launch: directly on real tensors; through ``wrap_triton``
    while make_fx / torch.compile trace a ``triton_op`` (fake or functional
    tensors), so the traced graph holds the kernel itself, not an opaque call."""
    if type(x) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling():
        return kernel
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def contig(x: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (views); the kernels need unit stride in the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()
