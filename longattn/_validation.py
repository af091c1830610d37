"""Input checks shared by every public entry point. They run before any
kernel or collective and name the argument at fault and the fix."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(x, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        layout = "(batch, seqlen, nheads, headdim)" if ndim == 4 else "(total_tokens, nheads, headdim)"
        raise ValueError(f"{name} must have {ndim} dims {layout}, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT:
        raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32, fp64), got {x.dtype}")


def check_qkv(q, k, v, *, same_seqlen: bool = False, ndim: int = 4, names: Sequence[str] = ("q", "k", "v"),
              allow_empty_k: bool = False) -> None:
    """Shapes (B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D) with H % Hkv == 0;
    ``names`` as the errors call the three tensors. ``q=None`` checks k and v
    alone (a cache's new tokens). ``allow_empty_k``: Sk may be 0 (an empty
    cache part); q always needs a token."""
    given = [(x, n) for x, n in zip((q, k, v), names) if x is not None]
    for x, n in given:
        check_tensor(x, n, ndim)
    xs, ns = [x for x, _ in given], ", ".join(n for _, n in given)
    if len({x.dtype for x in xs}) > 1:
        raise TypeError(f"{ns} must share a dtype, got {', '.join(str(x.dtype) for x in xs)}")
    if len({x.device for x in xs}) > 1:
        raise ValueError(f"{ns} must be on one device, got {', '.join(str(x.device) for x in xs)}")
    nq, nk, nv = names
    if k.shape != v.shape:
        raise ValueError(f"{nk} and {nv} must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q is None:
        return
    if ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"{nq} and {nk} must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{nq} and {nk} must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or h % hkv:
        raise ValueError(f"nheads of {nq} ({h}) must be a multiple of nheads of {nk}/{nv} ({hkv}) for grouped-query "
                         f"attention")
    if same_seqlen and q.shape[-3] != k.shape[-3]:
        raise ValueError(f"{nq} and {nk} must have the same seqlen here, got {q.shape[-3]} and {k.shape[-3]}")
    if q.shape[-3] == 0 or (k.shape[-3] == 0 and not allow_empty_k):
        raise ValueError(f"{nq} needs at least one token (seqlen 0 given)" if allow_empty_k else
                         f"{nq} and {nk} need at least one token (seqlen 0 given)")


def check_window(window_size) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0 or -1 (unbounded), got {window_size!r}")
    return left, right


def check_scale(softmax_scale) -> None:
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")


def check_flag(x, name: str) -> None:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")


def check_dilation(segment_lengths: Sequence[int], dilation_rates: Sequence[int]
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for vals, name in ((segment_lengths, "segment_lengths"), (dilation_rates, "dilation_rates")):
        if not isinstance(vals, (list, tuple)) or not vals:
            raise TypeError(f"{name} must be a non-empty list of ints, got {vals!r}")
        for x in vals:
            if not isinstance(x, int) or isinstance(x, bool):
                raise TypeError(f"{name} must hold ints, got {x!r}")
            if x <= 0:
                raise ValueError(f"{name} entries must be positive, got {list(vals)}")
    if len(segment_lengths) != len(dilation_rates):
        raise ValueError(
            f"segment_lengths ({len(segment_lengths)} entries) and dilation_rates "
            f"({len(dilation_rates)} entries) must have the same length: one (w, r) per branch")
    return tuple(int(x) for x in segment_lengths), tuple(int(x) for x in dilation_rates)


def check_dilated_call(q, k, v, segment_lengths, dilation_rates, causal, return_lse, softmax_scale):
    """Every argument check of dilated_attention, single-device or over ranks."""
    check_qkv(q, k, v, same_seqlen=True)
    segs, rates = check_dilation(segment_lengths, dilation_rates)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    return segs, rates


def check_cu_seqlens_tensor(cu_seqlens, name: str = "cu_seqlens") -> None:
    """What can be checked of ``cu_seqlens`` without reading its values: type, dtype, shape."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32), got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of cumulative lengths (ndocs + 1 entries, starting at 0), "
                         f"got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}")


def check_cu_seqlens(cu_seqlens, total: Optional[int], name: str = "cu_seqlens") -> list:
    """Checks ``cu_seqlens`` against ``total`` tokens (None: its own last entry)
    and returns its values as a host list: the one read of the tensor a call
    makes (a read of a CUDA tensor waits for the work queued before it)."""
    check_cu_seqlens_tensor(cu_seqlens, name)
    vals = cu_seqlens.tolist()
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name} must start at 0 and be non-decreasing, got {vals[:8]}...")
    if total is not None and vals[-1] != total:
        raise ValueError(f"{name}[-1] ({vals[-1]}) must equal the number of tokens ({total})")
    return vals


def check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, *, same_seqlen: bool = False,
                         ndim: int = 4) -> tuple[int, int]:
    """The checks every attention entry point shares (tensors, flags, scale,
    window); returns the window as (left, right)."""
    check_qkv(q, k, v, same_seqlen=same_seqlen, ndim=ndim)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    return check_window(window_size)


def check_softcap_sinks(softcap, sinks, q: torch.Tensor) -> float:
    """``softcap`` (a float >= 0; 0 is none) and ``sinks`` (None or one logit
    per query head, ``(nheads,)``, floating, on q's device, as q's heads are
    ``q.shape[-2]``); returns softcap as a float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: no soft-capping), got {type(softcap).__name__}")
    if not (softcap >= 0 and softcap != float("inf")):
        raise ValueError(f"softcap must be a finite float >= 0 (0.0: no soft-capping; Gemma 2 uses 50.0), "
                         f"got {softcap}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor of shape (nheads,) or None, got {type(sinks).__name__}")
        h = q.shape[-2]
        if sinks.shape != (h,):
            raise ValueError(f"sinks must hold one logit per query head, shape ({h},), got {tuple(sinks.shape)}")
        if sinks.dtype not in _FLOAT:
            raise ValueError(f"sinks must be a floating tensor (fp16, bf16, fp32, fp64), got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    return float(softcap)


def check_chunk_size(chunk_size) -> int:
    """``chunk_size`` (None or an int >= 1) as the planners' chunk (0: none)."""
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None (whole documents) or an int >= 1 (Llama 4's "
                         f"attention_chunk_size), got {chunk_size!r}")
    return int(chunk_size)
