"""longattn: exact attention over very long sequences.

* :func:`attention` — dense attention through the best local kernel (cuDNN,
  flash, our Triton, efficient, math), GQA, causal, sliding windows, lse.
* :func:`dilated_attention` — LongNet dilated attention (fused Triton kernel on
  CUDA, gather path elsewhere), optionally sharded over ranks.
* :func:`ring_attention` — context parallelism over ``torch.distributed``.
* :func:`shard_documents`, :func:`packed_attention` — packed documents over
  ranks, held whole where they fit (only split documents' K/V travel).
* :func:`ulysses_attention` — head parallelism by all-to-all; :func:`context_parallel_attention`
  — the Ulysses x ring hybrid over a 2-D DeviceMesh.
* :func:`flex_attention`, :func:`ring_flex_attention` — any pattern
  (FlexAttention ``mask_mod``/``score_mod`` on global positions, e.g. from
  :mod:`longattn.masks`) on one device or across ranks.
* :func:`decode_attention`, :func:`dilated_decode_attention`, :class:`KVCache` —
  decoding with a KV cache, on one device or sharded over ranks.
* :mod:`longattn.nn` — modules; :mod:`longattn.bench` — the benchmark CLI.
"""
from .backends import BACKENDS, available_backends, use_backend
from .ops import (attention, attention_varlen, context_parallel_attention, context_parallel_attention_varlen,
                  dilated_attention, flex_attention, ring_attention, ring_attention_varlen, ring_flex_attention,
                  ulysses_attention, ulysses_attention_varlen)
from .ops import explain_flex, packed_attention
from .distributed.doc_shard import shard_documents
from .distributed import shard, shard_positions, shard_varlen, unshard, unshard_varlen
from .distributed.ulysses import (shard_for_mesh, shard_positions_for_mesh, shard_varlen_for_mesh,
                                  unshard_for_mesh, unshard_varlen_for_mesh)
from . import masks, nn, tuning
from .ops import decode_attention, dilated_decode_attention
from .cache import KVCache

__version__ = "0.1.0"


def kernels_available(device: str = "cpu") -> bool:
    """Whether our Triton kernels can run on ``device`` here (on CPU: only
    under ``TRITON_INTERPRET=1``)."""
    import torch

    from .kernels import _common

    return _common.available(torch.device(device))


def __getattr__(name: str):
    # Imported on first use, so that `import longattn` stays cheap (the
    # transformers adapter imports transformers).
    if name in ("context_parallel", "integrations"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'longattn' has no attribute {name!r}")


__all__ = [
    "attention", "attention_varlen", "dilated_attention", "ring_attention", "ring_attention_varlen",
    "ulysses_attention", "ulysses_attention_varlen", "context_parallel_attention",
    "context_parallel_attention_varlen", "explain_flex", "flex_attention", "ring_flex_attention",
    "shard", "unshard", "shard_positions", "shard_varlen", "unshard_varlen", "shard_for_mesh", "unshard_for_mesh",
    "shard_positions_for_mesh", "shard_varlen_for_mesh", "unshard_varlen_for_mesh",
    "masks", "nn", "tuning", "use_backend", "available_backends", "kernels_available", "BACKENDS",
    "decode_attention", "dilated_decode_attention", "KVCache", "shard_documents", "packed_attention",
]
