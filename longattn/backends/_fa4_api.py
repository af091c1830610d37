"""The one module that calls FlashAttention-4 (``flash-attn-4``, the CuTe DSL
kernels of flash-attention): dense, varlen, split-KV decoding, and the mask
calls of :mod:`longattn.flex.fa4` (``mask_mod``, block sparsity, aux tensors).

Its public functions (``flash_attn_func``, ``flash_attn_varlen_func``) tie the
backward to the forward's own output inside one autograd Function; longattn's
blocks take their backward from a given, possibly merged, output and lse (see
:mod:`longattn.backends`), which only the private ``_flash_attn_fwd`` and
``_flash_attn_bwd`` of ``flash_attn.cute.interface`` offer. They are reached
here and nowhere else: :func:`problem` checks on first use that they still take
every argument passed below, and names the release this module was written for
when they do not (the backend then refuses with that reason);
:func:`mask_signature_problem` does the same for the mask calls' arguments
(``longattn.flex.fa4`` refuses its FA4 kernel with it: the dense backend does
not depend on them).

Every function takes and returns our layouts: (B, S, H, D) (varlen: (T, H, D))
tensors and lse (B, H, S) (varlen: (H, T)) float32. FA4 already marks rows
that saw no key with lse -inf and output 0, and its backward reads -inf rows
as empty, so no conversion is needed. Strides that are not 16-byte aligned
are copied by FA4 itself.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

WRITTEN_FOR = "4.0.0b36"
DIST = "flash-attn-4"
INSTALL_HINT = f"pip install 'longattn[fa4]' (pins {DIST}=={WRITTEN_FOR})"

# The keyword arguments passed below, per private function.
FWD_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
            "causal", "softcap", "window_size_left", "window_size_right", "return_lse", "seqused_k", "num_splits",
            "pack_gqa")
BWD_ARGS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "softcap", "window_size_left",
            "window_size_right", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dlse")
# ... and those of the mask calls (masked_forward / masked_backward).
MASK_FWD_ARGS = ("mask_mod", "block_sparse_tensors", "aux_tensors", "return_lse", "pack_gqa", "softmax_scale")
MASK_BWD_ARGS = ("mask_mod", "block_sparse_tensors", "aux_tensors", "dlse", "softmax_scale")


def installed_version() -> str:
    from importlib import metadata

    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return "unknown"


def _missing(interface, calls) -> list[str]:
    """What ``interface`` lacks of ``calls``: ((function name, keyword arguments), ...)."""
    out = []
    for fn_name, args in calls:
        fn = getattr(interface, fn_name, None)
        if fn is None:
            out.append(f"no {fn_name}")
            continue
        params = inspect.signature(fn).parameters
        absent = [a for a in args if a not in params]
        if absent:
            out.append(f"{fn_name} lacks {absent}")
    return out


def signature_problem(interface, version: str) -> Optional[str]:
    """Why ``interface`` (a ``flash_attn.cute.interface`` module or a stand-in)
    lacks the private functions this module calls with their arguments; None if it has them."""
    missing = _missing(interface, (("_flash_attn_fwd", FWD_ARGS), ("_flash_attn_bwd", BWD_ARGS)))
    if missing:
        return (f"{DIST} {version}: flash_attn.cute.interface has {missing[0]}; longattn's fa4 backend was "
                f"written for {DIST}=={WRITTEN_FOR} ({INSTALL_HINT})")
    return None


def mask_signature_problem(interface) -> list[str]:
    """What ``interface`` lacks of the mask calls' arguments (:func:`masked_forward`,
    :func:`masked_backward`), each as a phrase; empty if it has them."""
    return _missing(interface, (("_flash_attn_fwd", MASK_FWD_ARGS), ("_flash_attn_bwd", MASK_BWD_ARGS)))


@functools.lru_cache(maxsize=None)
def _load():
    """(interface module, None) or (None, why it cannot be used). Imported on
    the first CUDA call that asks, never at ``import longattn``."""
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        return None, f"{DIST} not installed ({e}); {INSTALL_HINT}"
    except Exception as e:  # noqa: BLE001 - a broken CuTe DSL install raises anything at import
        return None, f"{DIST} failed to import ({type(e).__name__}: {e}); {INSTALL_HINT}"
    why = signature_problem(interface, installed_version())
    return (None, why) if why else (interface, None)


def problem() -> Optional[str]:
    """Why FA4 cannot be used in this process (None: it can)."""
    return _load()[1]


def _interface():
    mod, why = _load()
    if mod is None:
        raise RuntimeError(why)
    return mod


def _window(window: tuple[int, int]) -> tuple[Optional[int], Optional[int]]:
    # FA4 reads a negative bound on one side as a real bound (right = -1 hides the
    # diagonal); unbounded is None.
    return tuple(None if w < 0 else int(w) for w in window)


def forward(q, k, v, scale: float, causal: bool, window: tuple[int, int], cu=None, max_seqlen: int = 0, *,
            softcap: float = 0.0, cu_k=None, max_seqlen_k: int = 0, pack_gqa: Optional[bool] = None):
    """out in q.dtype and lse float32. ``cu`` (int32 cu_seqlens) makes it varlen,
    shared by q and k unless ``cu_k`` (with ``max_seqlen_k``) gives the key
    documents (causal then bottom-right aligned per document). ``softcap``:
    FA4's own soft-capping (a score_mod in both passes on sm_90 and sm_100).
    ``pack_gqa``: whether a tile holds the query heads of one kv head (None:
    FA4's choice, packed under GQA)."""
    left, right = _window(window)
    cu_k, max_k = (cu, max_seqlen) if cu_k is None else (cu_k, max_seqlen_k)
    res = _interface()._flash_attn_fwd(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen if cu is not None else None,
        max_seqlen_k=max_k if cu is not None else None, softmax_scale=scale, causal=causal,
        softcap=float(softcap), window_size_left=left, window_size_right=right, return_lse=True, pack_gqa=pack_gqa)
    return res[0], res[1]


def backward(dout, q, k, v, out, lse, scale: float, causal: bool, window: tuple[int, int], dlse=None, cu=None,
             max_seqlen: int = 0, *, softcap: float = 0.0, cu_k=None, max_seqlen_k: int = 0):
    """(dq, dk, dv) from the given out and lse; ``dlse`` (lse's shape) enters FA4's
    preprocessing as delta - dlse, its own handling of a used lse. The rest as :func:`forward`."""
    left, right = _window(window)
    cu_k, max_k = (cu, max_seqlen) if cu_k is None else (cu_k, max_seqlen_k)
    res = _interface()._flash_attn_bwd(
        q=q, k=k, v=v, out=out.to(q.dtype), dout=dout.to(q.dtype), lse=lse.float(), softmax_scale=scale,
        causal=causal, softcap=float(softcap), window_size_left=left, window_size_right=right, cu_seqlens_q=cu,
        cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen if cu is not None else None,
        max_seqlen_k=max_k if cu is not None else None, dlse=None if dlse is None else dlse.float())
    return res[0], res[1], res[2]


def decode(q, k_cache, v_cache, lens, max_len: Optional[int], scale: float, causal: bool, softcap: float = 0.0,
           num_splits: int = 0):
    """Attention of q (B, Lq, H, D) over the first ``lens[b]`` (int32 (B,) on
    q's device) slots of each row of the caches (B, capacity, Hkv, D), in one
    launch: FA4's split-KV forward (``num_splits`` 0: its own heuristic from the
    SM count and ``max_len``, the longest row, None: the capacity), query heads
    of a kv head packed into one tile (its default for GQA). ``causal``:
    bottom-right per row. Returns out in q.dtype and lse (B, H, Lq) float32."""
    res = _interface()._flash_attn_fwd(
        q=q, k=k_cache, v=v_cache, seqused_k=lens, max_seqlen_k=max_len, softmax_scale=scale, causal=causal,
        softcap=float(softcap), num_splits=num_splits, return_lse=True)
    return res[0], res[1]


def masked_forward(interface, q, k, v, scale: float, mask_mod, sparse, aux):
    """(out in q.dtype, lse (B, H, Sq) float32) of every query against every key
    under ``mask_mod`` (a CuTe mask function, or None) with the block sparsity
    ``sparse`` (a ``BlockSparseTensorsTorch``, or None) and ``aux`` tensors the
    mask reads; query heads unpacked (a query tile is one head's rows, as the
    block tables are). ``interface``: ``flash_attn.cute.interface`` as
    :mod:`longattn.flex.fa4` loaded it (or a stand-in)."""
    res = interface._flash_attn_fwd(
        q=q, k=k, v=v, softmax_scale=scale, causal=False, pack_gqa=False, return_lse=True, mask_mod=mask_mod,
        block_sparse_tensors=sparse, aux_tensors=aux)
    return res[0], res[1]


def masked_backward(interface, dout, q, k, v, out, lse, scale: float, mask_mod, sparse, aux, dlse=None):
    """(dq, dk, dv) of :func:`masked_forward` from the given, possibly merged, out
    and lse (and lse's gradient ``dlse``); ``sparse``: the per-key-block tables."""
    res = interface._flash_attn_bwd(
        q=q, k=k, v=v, out=out.to(q.dtype), dout=dout.to(q.dtype), lse=lse.float(), softmax_scale=scale,
        causal=False, mask_mod=mask_mod, aux_tensors=aux, block_sparse_tensors=sparse,
        dlse=None if dlse is None else dlse.float())
    return res[0], res[1], res[2]
