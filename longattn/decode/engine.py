"""Dense decoding on one device: the engine of a call (chosen once, in
:func:`dense_engine`), the dense part of a cache (:func:`dense_part`, what a
:class:`longattn.KVCache` rank and :func:`longattn.decode_attention` run) and
the call under CUDA graph capture."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from .. import backends as bk
from .. import tuning as _tuning
from .._merge import empty_state
from ..backends import _fa4_api
from .._sinks import apply_sinks
from ..dilated import graphs
from ..kernels import decode as _kdec
from .checks import check_decode_args, check_lengths


@functools.lru_cache(maxsize=None)
def _name(kind: str, index: Optional[int]) -> str:
    return torch.cuda.get_device_name(index) if kind == "cuda" else kind


def split_kv_args(q: torch.Tensor, tuning: _tuning.DecodeTuning, replayed: bool = False) -> dict:
    """The split kernel's tiles for ``q``'s head dim and dtype on ``q``'s device (the tuning keys some on the
    GPU's name); ``replayed``: a step replayed from a CUDA graph (``DecodeTuning.descriptor_loads``)."""
    return tuning.kernel_args(q.device.type == "cpu", q.shape[-1], _name(q.device.type, q.device.index),
                              q.element_size(), replayed)


def split_kv_refusals(q, k_cache, v_cache, backend: str, tuning: _tuning.DecodeTuning, softcap: float = 0.0
                      ) -> list[str]:
    """Why the split-KV kernel cannot run this call under ``backend`` (resolved
    at the public call); it applies no logit soft-capping."""
    why = [] if backend in ("auto", "triton") else [f"backend {backend!r} (use 'auto' or 'triton')"]
    if softcap:
        why.append(f"softcap={softcap} (the split-KV kernel does not soft-cap)")
    return why + bk.BACKENDS["triton"].kernel_refusals(q) + _kdec.refusals(q, k_cache, v_cache,
                                                                           tuning.split_kv_max_rows)


def fa4_refusals(q, k_cache) -> list[str]:
    """Why FA4's split-KV forward (:func:`longattn.backends._fa4_api.decode`)
    cannot run this call: the capabilities of FA4's kernels (it soft-caps)."""
    b = bk.BACKENDS["fa4"]
    why = b.varlen_refusals(q)
    if not why and q.device.type == "cuda" and b.capability(q.device)[0] == 9:
        # flash-attn-4 4.0.0b36 asserts "SplitKV not supported on SM 9.0"; unsplit, one query row per (row,
        # kv head) leaves most of the SMs idle, so the backend path (views of the cache) runs instead
        why.append("FA4's split-KV forward runs on sm_100 only (4.0.0b36 has none on sm_90)")
    if k_cache.dtype != q.dtype:
        why.append(f"cache dtype {k_cache.dtype} != query dtype {q.dtype}")
    return why


def dense_engine(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str, ragged: bool,
                 tuning: _tuning.DecodeTuning = _tuning.DECODE, graph_steps: bool = False, softcap: float = 0.0,
                 keys: Optional[int] = None) -> str:
    """The engine of a dense decode call, decided once per call: the one
    place that picks it (``backend`` as resolved at the public call; ``keys``:
    the longest row's length, None: the cache's capacity).

    * ``"fa4"``: FlashAttention-4's split-KV forward, one launch for the batch
      (rows of any lengths, soft-capping included): always for
      ``backend="fa4"`` where FA4 runs; under ``auto`` on calls of at least
      ``tuning.fa4_min_keys`` keys (None: never).
    * ``"graphs"`` (only with ``graph_steps``, a :class:`longattn.KVCache`
      step on one device): replayed from a CUDA graph
      (:class:`longattn.decode.graph_steps.StepGraphs`) where
      ``tuning.graph_steps``, :func:`longattn.dilated.graphs.usable` and the
      split-KV kernel (the one engine a replay can feed new lengths) runs.
    * ``"split_kv"``: the split-KV kernel (:mod:`longattn.kernels.decode`).
      ``auto``: on CUDA, for ``ragged`` calls (rows of different lengths: one
      launch instead of one per row; or lengths given on the device: the
      launch a CUDA graph capture replays), or rows of one length where
      ``tuning.split_kv_equal_rows``, if the kernel takes the shapes;
      ``triton``: wherever the kernel runs (the CPU interpreter included).
    * ``"backend"``: a backend on views of the cache; always for any other
      backend name (and for ``fa4`` where FA4 cannot run: the backend then
      says why), and for a call with ``softcap`` (logit soft-capping,
      which the split-KV kernel, and so the graphs, do not apply: the backend
      chosen then is one that soft-caps, e.g. math).

    (Under CUDA graph capture the kernel is the only engine.)"""
    keys = k_cache.shape[1] if keys is None else keys
    fa4_wanted = backend == "fa4" or (backend == "auto" and tuning.fa4_min_keys is not None
                                      and keys >= tuning.fa4_min_keys)
    if fa4_wanted and not fa4_refusals(q, k_cache):
        return "fa4"
    if backend not in ("auto", "triton"):
        return "backend"
    graphed = graph_steps and tuning.graph_steps and graphs.usable(q)
    if not graphed and backend == "auto" and not (q.device.type == "cuda" and (ragged or tuning.split_kv_equal_rows)):
        return "backend"
    if split_kv_refusals(q, k_cache, v_cache, backend, tuning, softcap):
        return "backend"
    return "graphs" if graphed else "split_kv"


def dense_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: Sequence[int], causal: bool,
               scale: float, backend: str, lens_tensor: Optional[torch.Tensor] = None,
               tuning: _tuning.DecodeTuning = _tuning.DECODE, *, engine: Optional[str] = None,
               ragged: Optional[bool] = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``(B, Lq, H, D)`` over the first ``lens[b]`` slots of each
    row; ``causal``: bottom-right (query i sees ``lens[b] - Lq + i + 1`` keys).
    Returns out in q's dtype and lse ``(B, H, Lq)`` float32; a row with no key
    gives 0 and -inf. The split-KV kernel and FA4 take the whole batch in one
    call (``lens_tensor``: the lengths on q's device, if the caller has them);
    otherwise one backend call when the rows have equal lengths, else one per
    row (views of the cache, never copies). ``engine`` (``"fa4"``,
    ``"split_kv"`` or ``"backend"``) and ``ragged`` (rows of different lengths), when the caller
    has decided them (:func:`dense_engine`); else decided here. ``softcap``:
    logit soft-capping (in the block spec: only backends that apply it run).
    ``dense_launch(...)()``."""
    return dense_launch(q, k_cache, v_cache, lens, causal, scale, backend, lens_tensor, tuning, engine=engine,
                        ragged=ragged, softcap=softcap)()


def dense_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: Sequence[int], causal: bool,
                 scale: float, backend: str, lens_tensor: Optional[torch.Tensor] = None,
                 tuning: _tuning.DecodeTuning = _tuning.DECODE, *, engine: Optional[str] = None,
                 ragged: Optional[bool] = None, softcap: float = 0.0) -> Callable[[], tuple]:
    """:func:`dense_part` in two steps: here every decision that can refuse
    the call (the engine, each row's backend: ValueError), on the host; the
    returned function queues the kernels and returns (out, lse). A sharded
    step exchanges its checks between the two, before its attention takes
    the GPU."""
    b, lq, h, _ = q.shape
    masked = causal and lq > 1  # one query sees every cached key
    if ragged is None:
        ragged = len(set(lens)) > 1
    if engine is None:
        engine = dense_engine(q, k_cache, v_cache, backend, ragged or lens_tensor is not None, tuning,
                              softcap=softcap, keys=max(lens, default=0))
    if engine == "fa4":
        if max(lens, default=0) == 0:  # no key in any row (a rank of a sharded cache): nothing to launch
            return lambda: empty_state(q, q.dtype)
        dev_lens = (torch.tensor(lens, dtype=torch.int32, device=q.device) if lens_tensor is None
                    else lens_tensor.to(torch.int32).contiguous())
        return lambda: _fa4_api.decode(q, k_cache, v_cache, dev_lens, max(lens, default=0), scale, masked, softcap,
                                       tuning.fa4_num_splits)
    if engine == "split_kv":
        return lambda: _kdec.decode(q, k_cache, v_cache, lens, masked, scale, lens_tensor=lens_tensor,
                                    ragged=ragged, **split_kv_args(q, tuning))
    if not ragged:
        return _rows_launch(q, k_cache, v_cache, lens[0], masked, scale, backend, tuning, softcap)
    rows = [_rows_launch(q[i:i + 1], k_cache[i:i + 1], v_cache[i:i + 1], n, masked, scale, backend, tuning, softcap)
            for i, n in enumerate(lens)]

    def launch():
        out = torch.empty_like(q)
        lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
        for i, row in enumerate(rows):
            out[i:i + 1], lse[i:i + 1] = row()
        return out, lse
    return launch


def _rows_launch(q, k_cache, v_cache, n: int, masked: bool, scale: float, backend: str,
                 tuning: _tuning.DecodeTuning, softcap: float) -> Callable[[], tuple]:
    if n == 0:
        return lambda: empty_state(q, q.dtype)
    k, v = k_cache[:, :n], v_cache[:, :n]
    if masked:
        spec = bk.BlockSpec(scale, True, (-1, -1), n - q.shape[1], softcap)
        be = bk.select_backend(q, k, spec, backend, exclude=tuning.auto_excludes)
    else:
        spec = bk.BlockSpec(scale, softcap=softcap)
        be = unmasked_backend(q, k, spec, backend, tuning)
    return lambda: be.forward(q, k, v, spec)


def unmasked_backend(q, k, spec, backend: str, tuning: _tuning.DecodeTuning = _tuning.DECODE):
    # Chosen on at most two key rows: a shape that stays the same as the cache
    # grows is looked up once instead of walking every backend's refusals per
    # token. Two, not one: cuDNN refuses seqlen_q = seqlen_k = 1, so one key
    # row would refuse it for a one-query step over any cache.
    return bk.select_backend(q, k[:, :min(k.shape[1], 2)], spec, backend, exclude=tuning.auto_excludes)


def captured(q, k_cache, v_cache, cache_seqlens, causal: bool, scale: float, backend: str, softcap: float = 0.0):
    """Inside CUDA graph capture: the lengths stay on the device (a host read
    cannot be captured, and a replay sees the lengths of its own step), so
    only the split-KV kernel, whose launch does not depend on them, can run;
    keeping them within [q_len, capacity] is the caller's part."""
    why = split_kv_refusals(q, k_cache, v_cache, backend, _tuning.DECODE, softcap)
    if cache_seqlens.device != q.device:
        why.append(f"cache_seqlens is on {cache_seqlens.device} (put it on {q.device})")
    if why:
        raise ValueError("decode_attention under CUDA graph capture runs the split-KV kernel over lengths read on "
                         f"the device; it cannot here: {'; '.join(why)}")
    return _kdec.decode(q, k_cache, v_cache, None, causal and q.shape[1] > 1, scale, lens_tensor=cache_seqlens,
                        **split_kv_args(q, _tuning.DECODE))


def on_device(lens: torch.Tensor, q: torch.Tensor) -> Optional[torch.Tensor]:
    """The lengths tensor where the split-KV kernel can read it (q's device), else None."""
    return lens if lens.device == q.device else None


def decode_call(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, return_lse, backend: str,
                softcap=0.0, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`longattn.decode_attention` on one device: checked, then captured
    or eager, the sinks merged last; (out in q's dtype, lse)."""
    softcap = check_decode_args(q, k_cache, v_cache, cache_seqlens, causal, return_lse, softmax_scale, backend,
                                softcap, sinks)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        out, lse = captured(q, k_cache, v_cache, cache_seqlens, causal, scale, backend, softcap)
    else:
        lens = cache_seqlens.tolist()
        check_lengths(lens, k_cache.shape[1], q.shape[1], causal)
        out, lse = dense_part(q, k_cache, v_cache, lens, causal, scale, backend, on_device(cache_seqlens, q),
                              softcap=softcap)
    return (out, lse) if sinks is None else apply_sinks(out, lse, sinks)
