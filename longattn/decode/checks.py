"""Argument checks of the decode calls (the tensors, the lengths, and what a
cross-rank check compares), raised before any kernel or collective."""
from __future__ import annotations

from typing import Sequence

import torch

from .. import backends as bk
from .._validation import check_flag, check_qkv, check_scale, check_softcap_sinks


def check_cache_tensors(q, k_cache, v_cache) -> None:
    """q ``(B, Lq, H, D)``, cache ``(B, capacity, Hkv, D)`` twice, ``H % Hkv == 0``;
    the capacity may be 0."""
    check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"), allow_empty_k=True)


def check_seqlens_tensor(cache_seqlens, batch: int) -> None:
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor (int32, (batch,)), got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.dim() != 1 or cache_seqlens.numel() != batch:
        raise ValueError(f"cache_seqlens must be a 1-D int32 tensor of {batch} lengths (one per batch row), got "
                         f"dtype {cache_seqlens.dtype} shape {tuple(cache_seqlens.shape)}")


def check_lengths(lens: Sequence[int], capacity: int, q_len: int, need_queries: bool) -> None:
    """Every length in [0, capacity]; at least q_len where the part holds the
    queries' own keys."""
    if any(not 0 <= n <= capacity for n in lens):
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (the cache capacity, k_cache.shape[1]), "
                         f"got {list(lens)}")
    if need_queries and any(n < q_len for n in lens):
        raise ValueError(f"cache_seqlens ({list(lens)}) must be at least q_len ({q_len}): the cache must already hold "
                         f"the queries' own keys and values (append them before attending)")


@torch.no_grad()
def check_decode_args(q, k_cache, v_cache, cache_seqlens, causal, return_lse, softmax_scale, backend,
                      softcap=0.0, sinks=None) -> float:
    """The arguments of :func:`longattn.decode_attention` (not the lengths'
    values: those are read on the host, or not at all under capture); returns
    softcap as a float."""
    check_cache_tensors(q, k_cache, v_cache)
    check_seqlens_tensor(cache_seqlens, q.shape[0])
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    bk.check_backend_name(backend)
    return check_softcap_sinks(softcap, sinks, q)


def no_capture(q: torch.Tensor, what: str) -> None:
    """Raise where ``what`` would read lengths on the host under CUDA graph capture."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"{what} reads the lengths on the host and cannot run under CUDA graph capture; capture "
                         f"decode_attention on one device with cache_seqlens on the GPU instead")


def describe(x, capacity: bool = True):
    """What a cross-rank check compares of an argument (a cache's capacity, dim
    1, may differ across ranks)."""
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape) if capacity or x.dim() < 2 else (x.shape[0], *x.shape[2:])
        return (type(x).__name__, shape, str(x.dtype), x.device.type)
    return type(x).__name__
