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

:func:`record` records the compiled kernel calls one call of FA4 makes (a
forward, dense or masked: one kernel; a backward: preprocessing, main and
conversion kernels) and returns a :class:`Replay` that makes them again for
new tensors of the same layout without FA4's per-call Python (its argument checks,
block-table normalization and compile keys: about 0.3 ms of host time per
call; 1.28 of the 3.13 ms an H200's host took to issue a 32K block-sparse
fwd+bwd's four calls, ``fa4_host_time_h200_039606c.json``), checked against
the call itself when recorded.

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


# ---------------------------------------------------------------------------- replaying compiled calls
class _Recorder:
    """Stands in for one FA4 JIT cache while a call is recorded: every lookup
    passes through, and each compiled function is handed to ``note`` with its
    arguments before it runs."""

    def __init__(self, cache, note):
        self.cache, self.note = cache, note
        self.thread = threading.get_ident()

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        if threading.get_ident() != self.thread:
            return fn  # another thread's FA4 call while this one records: not part of the recording

        def call(*args, **kwargs):
            self.note(fn, args, kwargs)
            return fn(*args, **kwargs)
        return call

    def __getattr__(self, name):
        return getattr(self.cache, name)


_RECORDING = threading.Lock()


def _caches(interface) -> dict:
    """The interface's functions that keep a JIT cache, by name."""
    return {n: f for n in dir(interface) if hasattr(f := getattr(interface, n, None), "compile_cache")}


def _layout(t) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _tensors(x):
    """The tensors inside an argument (tuples, lists, named tuples), depth first."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


def replay_key(*tensors, scale: float) -> tuple:
    """What a :class:`Replay` of one step's mask and block tables depends on
    besides them: its tensors' layouts (shape, strides, dtype, device, whether
    they need grad; FA4 keys its kernels by these; None stays None) and the scale."""
    return tuple(None if t is None else (*_layout(t), t.requires_grad) for t in tensors) + (float(scale),)


def kept(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t``, or a contiguous copy where FA4's entries would copy it before their kernels (a last stride
    other than 1, an address or a stride not 16-byte aligned; the rule of FA4's ``maybe_contiguous``): a
    recording names the tensors its compiled calls take, which must be the ones passed, not FA4's copies."""
    if t is None:
        return None
    aligned = t.data_ptr() % 16 == 0
    if t.is_contiguous():
        return t if aligned else t.clone(memory_format=torch.contiguous_format)
    if aligned and t.stride(-1) == 1 and all(s == 0 or s * t.element_size() % 16 == 0 for s in t.stride()[:-1]):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def replayable(*tensors) -> bool:
    """Whether these tensors may enter a recorded call: 16-byte aligned, as the
    compiled kernels assume (FA4's own path checks the layout it is given)."""
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


class Replay:
    """The compiled kernel calls one FA4 entry made for one layout
    (:func:`replay_key`), made again without FA4's per-call Python (argument
    checks, block-table normalization, compile keys: about 0.3 ms of host time
    per entry on an H200's host, ``fa4_host_time_h200_039606c.json``).

    ``calls``: (compiled function, its positional arguments with None where a
    slot goes, {position: slot}); a slot is ``("in", name)``, one of the
    entry's tensors given per call, or ``("tmp", i)``, a buffer allocated per
    call in the recorded layout (``temps[i]``; those in ``zeros`` start as
    zeros) that the calls write and read: the entry's results among them
    (``outputs``). Every other argument (block tables, mask aux tensors,
    scalars) is the recorded one, as the step that holds the replay keeps
    them. ``__call__(**tensors)`` returns the outputs as the entry does."""

    def __init__(self, calls: list, temps: list, zeros: frozenset, outputs: tuple):
        self.calls, self.temps, self.zeros, self.outputs = calls, temps, zeros, outputs

    def _buffers(self, poison: bool) -> list:
        bufs = []
        for i, (shape, stride, dtype, device) in enumerate(self.temps):
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if i in self.zeros:
                t.zero_()
            elif poison:  # a buffer the calls read before they write shows up in the results
                t.fill_(float("nan") if dtype.is_floating_point else -(2 ** 30))
            bufs.append(t)
        return bufs

    def __call__(self, _poison: bool = False, **tensors):
        bufs = self._buffers(_poison)
        new = {n: None if t is None else t.detach() for n, t in tensors.items()}
        for fn, args, slots in self.calls:
            a = list(args)
            for i, (kind, key) in slots.items():
                a[i] = new[key] if kind == "in" else bufs[key]
            fn(*a)
        return tuple(None if o is None else bufs[o] for o in self.outputs)


def _close(got, want, exact: bool) -> bool:
    for g, w in zip(got, want):
        if (g is None) != (w is None):
            return False
        if g is None:
            continue
        if exact:
            if g.shape != w.shape or not bool(((g == w) | (g.isnan() & w.isnan())).all()):  # NaN inputs: NaN alike
                return False
        elif not (torch.isfinite(g) == torch.isfinite(w)).all() or \
                (g.double() - w.double()).nan_to_num(0).norm() > 1e-2 * w.double().nan_to_num(0).norm() + 1e-6:
            # bf16 results of float32 atomics differ by roundings from run to run; a buffer read before
            # it is written, or a step left out, differs by the results' own size
            return False
    return True


def record(interface, entry, tensors: dict, exact: bool):
    """(results, replay) of ``entry()``, a call of FA4's ``interface`` on
    ``tensors`` (by name; the exact tensors it passes to FA4), recording its
    compiled kernel calls: ``replay`` (a :class:`Replay`) makes them again for
    new tensors of the same :func:`replay_key`, or is the reason it cannot (a
    string): two of ``tensors`` the same, an argument that views one of them
    otherwise than whole, buffers sharing memory, a result no compiled call wrote, keyword arguments, or a replay whose results
    differ from the call's on these tensors (``exact``: bit for bit, else
    within 1e-2 in norm), checked here with every buffer the replay allocates
    filled with NaN unless the recorded call's was all zeros (then zeros)."""
    caches = _caches(interface)
    calls, temps, bufs, nonzero, problems = [], [], [], [], []
    named = {n: t for n, t in tensors.items() if t is not None}
    storages = {t.untyped_storage().data_ptr() for t in named.values()}
    if len({t.data_ptr() for t in named.values()}) < len(named):
        # a slot found by address would stand for both; a later call may pass two tensors there
        return entry(), "two of the inputs are the same tensor"
    temp_storages = set()

    def slot(t):
        for n, x in named.items():
            if t.data_ptr() == x.data_ptr() and _layout(t) == _layout(x):
                return ("in", n)
        for i, x in enumerate(bufs):
            if t.data_ptr() == x.data_ptr() and _layout(t) == _layout(x):
                return ("tmp", i)
        if t.untyped_storage().data_ptr() in storages:
            problems.append("an argument views an input otherwise than whole")
        if t.untyped_storage().data_ptr() in temp_storages:
            problems.append("two buffers of the compiled calls share memory")  # allocated apart, they would not
        temp_storages.add(t.untyped_storage().data_ptr())
        bufs.append(t)
        temps.append(_layout(t))
        # whether it starts as zeros, read after the call (queued here, before the kernel writes it: no wait now)
        nonzero.append(t.any() if t.numel() else torch.zeros((), dtype=torch.bool, device=t.device))
        return ("tmp", len(bufs) - 1)

    def note(fn, args, kwargs):
        if kwargs:
            problems.append("a compiled call took keyword arguments")
        slots = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                slots[i] = slot(a)
            elif any(t.untyped_storage().data_ptr() in storages |
                     {b.untyped_storage().data_ptr() for b in bufs} for t in _tensors(a)):
                problems.append(f"argument {i} of a compiled call holds an input or a buffer inside")
        calls.append((fn, tuple(None if i in slots else a for i, a in enumerate(args)), slots))

    with _RECORDING:
        saved = {n: f.compile_cache for n, f in caches.items()}
        try:
            for n, f in caches.items():
                f.compile_cache = _Recorder(saved[n], note)
            results = entry()
        finally:
            for n, f in caches.items():
                f.compile_cache = saved[n]
    if not calls:
        return results, "the call made no compiled call"
    taken = {key for _, _, slots in calls for kind, key in slots.values() if kind == "in"}
    for n in named:
        if n not in taken:
            # FA4 copied or converted it first (a layout its kernels do not take; a torch op): the recorded
            # buffer would stand for it, with the recorded call's contents (zeros stay zeros under the check)
            problems.append(f"input {n} reached no compiled call as itself")
    outputs = []
    for r in results:
        at = None if r is None else next((i for i, b in enumerate(bufs) if r.data_ptr() == b.data_ptr()
                                          and _layout(r) == _layout(b)), -1)
        if at == -1:
            problems.append("a result is not a buffer the compiled calls wrote")
        outputs.append(at)
    if problems:
        return results, problems[0]
    del bufs[:]  # the recorded call's buffers are not kept
    zero = frozenset(i for i, x in enumerate(torch.stack(nonzero).tolist() if nonzero else ()) if not x)
    for zeros in (frozenset(), zero):
        replay = Replay(calls, temps, zeros, tuple(outputs))
        try:
            same = _close(replay(_poison=True, **tensors), results, exact)
        except RuntimeError as e:  # out of memory among them: the check holds a second set of results
            return results, f"checking the replay failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        if same:
            return results, replay
    return results, "the replay's results differed from the call's on the recorded inputs"


def recordable(*tensors) -> bool:
    """Whether a call on these tensors may be recorded now: aligned (:func:`replayable`) and not inside a CUDA
    graph capture (recording reads results back, which a capture forbids)."""
    t = tensors[0]
    return replayable(*tensors) and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def replayed(store: dict, key, tensors: dict, allowed: bool, record, own, sightings: int = 1):
    """One FA4 entry on ``tensors`` (by name, as FA4 is handed them) through the replays kept in ``store``
    (a dict the caller owns, keyed by ``key``: the layouts and every argument the compiled calls were
    recorded with): the key's :class:`Replay` where one is recorded and the tensors are aligned; else
    ``record()`` (the results, then the replay or why not, kept under the key) where ``allowed`` and this
    is the key's ``sightings``-th call that could record (earlier ones are counted in the store and run
    ``own()``; a key whose recording failed keeps its reason and never records again); else FA4's own
    call, ``own()``. The one place that decides between a replay, a recording and FA4's own path."""
    got = store.get(key)
    if isinstance(got, Replay) and replayable(*tensors.values()):
        return got(**tensors)
    if allowed and not isinstance(got, (Replay, str)) and recordable(*tensors.values()):
        seen = (got or 0) + 1
        if seen >= sightings:
            *results, store[key] = record()
            return tuple(results)
        store[key] = seen
    return own()


def record_forward(q, k, v, scale: float, causal: bool, window: tuple[int, int], *, softcap: float = 0.0,
                   pack_gqa: Optional[bool] = None):
    """(out, lse, replay) of the dense :func:`forward` (no ``cu``) with its compiled calls recorded
    (:func:`record`, checked bit for bit); ``replay(q=, k=, v=)`` with the tensors of :func:`forward_inputs`."""
    t = forward_inputs(q, k, v)
    (out, lse), replay = record(
        _interface(), lambda: forward(t["q"], t["k"], t["v"], scale, causal, window, softcap=softcap,
                                      pack_gqa=pack_gqa), t, exact=True)
    return out, lse, replay


def forward_inputs(q, k, v) -> dict:
    """The tensors the dense :func:`forward` hands FA4, by name (:func:`kept`)."""
    return dict(q=kept(q), k=kept(k), v=kept(v))


def record_backward(dout, q, k, v, out, lse, scale: float, causal: bool, window: tuple[int, int], dlse=None, *,
                    softcap: float = 0.0):
    """(dq, dk, dv, replay) of the dense :func:`backward` (no ``cu``) with its compiled calls recorded
    (:func:`record`; dQ is added by float32 atomics, so within 1e-2); ``replay(**backward_inputs(...))``."""
    t = backward_inputs(dout, q, k, v, out, lse, dlse)
    grads, replay = record(
        _interface(), lambda: backward(t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], scale, causal, window,
                                       t["dlse"], softcap=softcap), t, exact=False)
    return (*grads, replay)


def record_masked_forward(interface, q, k, v, scale: float, mask_mod, sparse, aux):
    """(out, lse, replay) of :func:`masked_forward` with its compiled calls
    recorded (:func:`record`, checked bit for bit); ``replay(q=, k=, v=)``."""
    (out, lse), replay = record(
        interface, lambda: masked_forward(interface, q, k, v, scale, mask_mod, sparse, aux), dict(q=q, k=k, v=v),
        exact=True)
    return out, lse, replay


def backward_inputs(dout, q, k, v, out, lse, dlse=None) -> dict:
    """The tensors :func:`masked_backward` hands FA4, by name (converted as it converts them, in layouts
    FA4 passes to its kernels as they are: :func:`kept`; an lse gradient autograd expanded from a scalar
    is one FA4 would copy)."""
    return dict(q=kept(q), k=kept(k), v=kept(v), out=kept(out.to(q.dtype)), dout=kept(dout.to(q.dtype)),
                lse=kept(lse.float()), dlse=None if dlse is None else kept(dlse.float()))


def record_masked_backward(interface, dout, q, k, v, out, lse, scale: float, mask_mod, sparse, aux, dlse=None):
    """(dq, dk, dv, replay) of :func:`masked_backward` with its compiled calls
    recorded (:func:`record`; FA4 adds dQ by float32 atomics, so within 1e-2);
    ``replay(**backward_inputs(...))``."""
    t = backward_inputs(dout, q, k, v, out, lse, dlse)
    grads, replay = record(
        interface, lambda: masked_backward(interface, t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], scale,
                                           mask_mod, sparse, aux, t["dlse"]), t, exact=False)
    return (*grads, replay)
