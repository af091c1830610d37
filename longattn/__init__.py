"""longattn: exact attention over very long sequences.

* :func:`attention` — dense attention through the best local kernel (cuDNN,
  flash, our Triton, efficient, math), GQA, causal, sliding windows, lse.
* :func:`dilated_attention` — LongNet dilated attention (fused Triton kernel on
  CUDA, gather path elsewhere), optionally sharded over ranks.
* :func:`ring_attention` — context parallelism over ``torch.distributed``.
* :func:`flex_attention`, :func:`ring_flex_attention` — any pattern
  (FlexAttention ``mask_mod``/``score_mod`` on global positions, e.g. from
  :mod:`longattn.masks`) on one device or across ranks.
* :mod:`longattn.nn` — modules; :mod:`longattn.bench` — the benchmark CLI.
"""
from .backends import BACKENDS, available_backends, use_backend
from .ops import attention, attention_varlen, dilated_attention, ring_attention, ring_attention_varlen
from .distributed import shard, shard_positions, shard_varlen, unshard, unshard_varlen
from . import nn, tuning
from .ops import flex_attention, ring_flex_attention
from . import masks

__version__ = "0.1.0"


def kernels_available(device: str = "cpu") -> bool:
    """Whether our Triton kernels can run on ``device`` here (on CPU: only
    under ``TRITON_INTERPRET=1``)."""
    import torch

    from .kernels import _common

    return _common.available(torch.device(device))

__all__ = [
    "attention", "attention_varlen", "dilated_attention", "nn", "ring_attention", "ring_attention_varlen", "shard", "unshard", "shard_positions",
    "shard_varlen", "unshard_varlen",
    "use_backend", "available_backends", "kernels_available", "BACKENDS", "tuning",
    "flex_attention", "ring_flex_attention", "masks",
]
