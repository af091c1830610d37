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

:func:`record_masked_forward` records the one compiled kernel call a masked
forward makes and returns a :class:`ForwardReplay` that makes that call
again for new q, k, v of the same layout without FA4's per-call Python (its
argument checks, block-table normalization and compile-key construction:
about 0.3 ms of host time per call, a quarter of a 32K block-sparse
fwd+bwd's issue time on an H200's host, ``fa4_host_time_h200_039606c.json``).

Every function takes and returns our layouts: (B, S, H, D) (varlen: (T, H, D))
tensors and lse (B, H, S) (varlen: (H, T)) float32. FA4 already marks rows
that saw no key with lse -inf and output 0, and its backward reads -inf rows
as empty, so no conversion is needed. Strides that are not 16-byte aligned
are copied by FA4 itself.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Optional

import torch

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


# ---------------------------------------------------------------------------- replaying a compiled forward
class _Recorder:
    """Stands in for one FA4 JIT cache while a call is recorded: every lookup
    passes through, each compiled function called is noted with its arguments."""

    def __init__(self, name: str, cache, calls: list):
        self.name, self.cache, self.calls = name, cache, calls

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def call(*args, **kwargs):
            self.calls.append((self.name, fn, args, kwargs))
            return fn(*args, **kwargs)
        return call

    def __getattr__(self, name):
        return getattr(self.cache, name)


_RECORDING = threading.Lock()


def _caches(interface) -> dict:
    """The interface's functions that keep a JIT cache, by name."""
    return {n: f for n in dir(interface) if hasattr(f := getattr(interface, n, None), "compile_cache")}


def _same(a, b) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _tensors(x):
    """The tensors inside an argument (tuples, lists, named tuples), depth first."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def replay_key(q, k, v, scale: float) -> tuple:
    """What a :class:`ForwardReplay` of one step's mask and block tables depends on besides them:
    q, k, v's layouts (shape, strides, dtype, device, whether they need grad; FA4 keys its kernels by
    these) and the scale."""
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in (q, k, v)) + (float(scale),)


def replayable(q, k, v) -> bool:
    """Whether these tensors may enter a recorded call: 16-byte aligned, as the
    compiled kernel assumes (FA4's own path checks the layout it is given)."""
    return all(t.data_ptr() % 16 == 0 for t in (q, k, v))


class ForwardReplay:
    """FA4's compiled masked forward of one signature (:func:`replay_key`),
    called again without FA4's per-call Python: the recorded compiled
    function and its positional arguments, where q, k, v are the new ones
    and out, lse freshly allocated in the recorded layouts; every other
    argument (block tables, mask aux tensors, scalars) is the recorded one,
    as the step that holds this replay keeps them. Returns (out, lse) as
    :func:`masked_forward`."""

    def __init__(self, fn, args: tuple, slots: dict, out, lse):
        # the recorded q, k, v, out, lse are not kept (they would stay allocated as long as the step)
        self.fn, self.slots = fn, slots
        self.args = tuple(None if i in slots else a for i, a in enumerate(args))
        self.out_layout = (out.shape, out.stride(), out.dtype, out.device)
        self.lse_layout = (lse.shape, lse.stride(), lse.dtype, lse.device)

    def __call__(self, q, k, v):
        out, lse = (torch.empty_strided(s, st, dtype=dt, device=dev) for s, st, dt, dev in
                    (self.out_layout, self.lse_layout))
        new = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "out": out, "lse": lse}
        args = list(self.args)
        for i, name in self.slots.items():
            args[i] = new[name]
        self.fn(*args)
        return out, lse


def _replay_of(calls: list, q, k, v, out, lse) -> tuple[Optional[ForwardReplay], str]:
    """(the replay of a recorded masked forward, "") or (None, why it cannot be replayed)."""
    if len(calls) != 1 or calls[0][0] != "_flash_attn_fwd":
        return None, f"the call made {[c[0] for c in calls]} compiled calls, not one forward kernel"
    _, fn, args, kwargs = calls[0]
    if kwargs:
        return None, "the compiled forward took keyword arguments"
    known = {"q": q, "k": k, "v": v, "out": out, "lse": lse}
    slots, storages = {}, {t.untyped_storage().data_ptr() for t in known.values()}
    for i, a in enumerate(args):
        name = next((n for n, t in known.items() if isinstance(a, torch.Tensor) and _same(a, t)), None)
        if name is not None:
            slots[i] = name
            continue
        if any(t.untyped_storage().data_ptr() in storages for t in _tensors(a)):
            return None, f"argument {i} of the compiled forward is a view of q, k, v, out or lse"
    if sorted(slots.values()) != sorted(known):
        return None, f"the compiled forward's arguments hold {sorted(slots.values())} of q, k, v, out, lse"
    return ForwardReplay(fn, tuple(args), slots, out, lse), ""


def record_masked_forward(interface, q, k, v, scale: float, mask_mod, sparse, aux):
    """(out, lse, replay) of :func:`masked_forward`, recording its compiled
    kernel call: ``replay`` (a :class:`ForwardReplay`) repeats it for new q, k,
    v of the same :func:`replay_key`, or is the reason it cannot (a string:
    the call made other compiled calls, the arguments hold a tensor the replay
    would not renew, or the replay's results differed from the call's, checked
    here on these inputs)."""
    caches = _caches(interface)
    calls: list = []
    with _RECORDING:
        saved = {n: f.compile_cache for n, f in caches.items()}
        try:
            for n, f in caches.items():
                f.compile_cache = _Recorder(n, saved[n], calls)
            out, lse = masked_forward(interface, q, k, v, scale, mask_mod, sparse, aux)
        finally:
            for n, f in caches.items():
                f.compile_cache = saved[n]
    replay, why = _replay_of(calls, q, k, v, out, lse)
    if replay is None:
        return out, lse, why
    r_out, r_lse = replay(q, k, v)
    if not (torch.equal(r_out, out) and torch.equal(r_lse, lse)):
        return out, lse, "the replay's out or lse differed from the call's on the recorded inputs"
    return out, lse, replay
