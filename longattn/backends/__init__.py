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
``refusals(spec, q, k)`` that lists why it cannot run a call; ``select_backend``
walks a priority list and returns the first one with no reasons. When the
caller forces a backend that refuses, the error lists every reason. Packed
documents (:mod:`.varlen`) choose among the backends' varlen kernels the same way.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Optional, Sequence

from .base import Backend, BlockSpec
from .fa4 import FA4Backend
from .math import MathBackend
from .sdpa import CudnnBackend, EfficientBackend, FlashBackend
from .triton import TritonBackend

__all__ = [
    "BlockSpec", "Backend", "BACKENDS", "select_backend", "available_backends", "explain", "use_backend", "resolve",
    "block_forward", "block_backward", "check_backend_name", "default_scale",
]

MATH = MathBackend()
_FLASH = FlashBackend()
BACKENDS: dict[str, Backend] = {
    b.name: b for b in (FA4Backend(), CudnnBackend(_FLASH, MATH), _FLASH, TritonBackend(), EfficientBackend(), MATH)
}
# "auto" walks this order: FlashAttention-4 first where it is installed (it
# beats cuDNN in both passes on every shape measured on Hopper, see
# FA4Backend), then cuDNN, the fastest of PyTorch's own kernels on Hopper
# where it applies; our Triton kernel before the efficient one because it
# handles every mask offset at flash speed.
AUTO_ORDER = ("fa4", "cudnn", "flash", "triton", "efficient", "math")

_state = threading.local()


def _forced() -> Optional[str]:
    return getattr(_state, "forced", None)


def resolve(name: str) -> str:
    """The backend a public call runs under: ``name``, or for ``"auto"`` the one
    a :func:`use_backend` block forces (``"auto"`` when none). The only reader of
    that state: each public op resolves once, at the call, and carries the
    answer into its backward, so a backward run after the block has closed
    follows the forward. Below the public ops a name means what it says
    (``"auto"``: the first backend whose capabilities fit)."""
    check_backend_name(name)
    return (_forced() or "auto") if name == "auto" else name


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``backend="auto"`` calls inside the block to use ``name``.

    >>> with longattn.use_backend("math"):
    ...     out = longattn.attention(q, k, v)
    """
    check_backend_name(name)
    prev = _forced()
    _state.forced = None if name == "auto" else name
    try:
        yield
    finally:
        _state.forced = prev


def explain(q, k, spec: BlockSpec) -> dict[str, list[str]]:
    """Every backend and the reasons it refuses this call (empty list: it runs
    where named). ``auto`` also passes over a backend whose
    ``auto_refusals(q)`` gives a reason (our Triton kernel on CPU)."""
    return {name: BACKENDS[name].refusals(spec, q, k) for name in AUTO_ORDER}


# Selections already made: short sequences cut into many block calls (the
# dilated views path: 16-32 per pass) are bound by host time, and walking the
# refusals of every backend costs tens of microseconds per call. The key holds
# everything refusals read (cuDNN's and FA4's presence and the interpreter switch are
# fixed per process); bounded so shapes that never repeat cannot grow it.
_selected: dict = {}
_SELECTED_MAX = 4096


def select_backend(q, k, spec: BlockSpec, name: str = "auto", exclude: Sequence[str] = ()) -> Backend:
    key = (name, tuple(exclude), q.device, q.dtype, k.dtype, q.shape[1:], k.shape[1:], spec)
    hit = _selected.get(key)
    if hit is None:
        hit = _select(q, k, spec, name, exclude)
        if len(_selected) > _SELECTED_MAX:
            _selected.clear()
        _selected[key] = hit
    return hit


def _select(q, k, spec, name, exclude) -> Backend:
    if name != "auto":
        check_backend_name(name)
        reasons = BACKENDS[name].refusals(spec, q, k)
        if reasons:
            raise ValueError(
                f"backend={name!r} cannot run this call: {'; '.join(reasons)}. "
                f"Use backend='auto' or one of: {available_backends(q, k, spec)}")
        return BACKENDS[name]
    for cand in AUTO_ORDER:
        if cand not in exclude and not BACKENDS[cand].refusals(spec, q, k) and not BACKENDS[cand].auto_refusals(q):
            return BACKENDS[cand]
    lines = "; ".join(f"{n}: {', '.join(r or BACKENDS[n].auto_refusals(q))}" for n, r in explain(q, k, spec).items())
    raise ValueError(f"no attention backend supports this call ({lines})")


def available_backends(q, k, spec: BlockSpec) -> list[str]:
    """Names of the backends that can run this call where named, fastest first
    (``auto`` takes the first without ``auto_refusals``)."""
    return [n for n, r in explain(q, k, spec).items() if not r]


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
