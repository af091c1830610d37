"""Decoding with a KV cache: the queries of the newest tokens against the
cached keys, dense or dilated, on one device or with the cache sharded over
the ranks of a group (each rank attends to its part; the parts merge by lse).

The public functions take the cache as tensors (flash-attn's
``flash_attn_with_kvcache`` convention); :class:`longattn.KVCache` owns such
tensors, knows where each token lives when sharded, and calls the parts below
(``dense_part``, ``dilated_part``, ``merge_over_ranks``). Inference only: no
autograd graph is built.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import backends as bk
from .. import tuning as _tuning
from .._merge import empty_state, merge_
from .._validation import check_dilation, check_flag, check_qkv, check_scale
from ..distributed import checks
from ..dilated import graphs
from ..kernels import decode as _kdec

__all__ = ["decode_attention", "dilated_decode_attention", "dilated_read_start"]


# ------------------------------------------------------------------ checks
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


def describe(x, capacity: bool = True):
    """What a cross-rank check compares of an argument (a cache's capacity, dim
    1, may differ across ranks)."""
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape) if capacity or x.dim() < 2 else (x.shape[0], *x.shape[2:])
        return (type(x).__name__, shape, str(x.dtype), x.device.type)
    return type(x).__name__


# ------------------------------------------------------------------ dense
def _split_kv_refusals(q, k_cache, v_cache, backend: str, tuning: _tuning.DecodeTuning) -> list[str]:
    """Why the split-KV kernel cannot run this call under ``backend`` (a name
    forced with :func:`longattn.use_backend` counts for ``auto``)."""
    name = bk.resolve(backend)
    why = [] if name in ("auto", "triton") else [f"backend {name!r} (use 'auto' or 'triton')"]
    return why + bk.BACKENDS["triton"].kernel_refusals(q) + _kdec.refusals(q, k_cache, v_cache,
                                                                           tuning.split_kv_max_rows)


def dense_engine(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str, ragged: bool,
                 tuning: _tuning.DecodeTuning = _tuning.DECODE, graph_steps: bool = False) -> str:
    """The engine of a dense decode call, decided once per call: the one
    place that picks it.

    * ``"graphs"`` (only with ``graph_steps``, a :class:`longattn.KVCache`
      step on one device): replayed from a CUDA graph (:class:`StepGraphs`)
      where ``tuning.graph_steps``, :func:`longattn.dilated.graphs.usable` and
      the split-KV kernel (the one engine a replay can feed new lengths) runs.
    * ``"split_kv"``: the split-KV kernel (:mod:`longattn.kernels.decode`).
      ``auto``: on CUDA, for ``ragged`` calls (rows of different lengths: one
      launch instead of one per row; or lengths given on the device: the
      launch a CUDA graph capture replays), or rows of one length where
      ``tuning.split_kv_equal_rows``, if the kernel takes the shapes;
      ``triton``: wherever the kernel runs (the CPU interpreter included).
    * ``"backend"``: a backend on views of the cache; always for any other
      backend name (or one forced with :func:`longattn.use_backend`).

    (Under CUDA graph capture the kernel is the only engine.)"""
    name = bk.resolve(backend)
    if name not in ("auto", "triton"):
        return "backend"
    graphed = graph_steps and tuning.graph_steps and graphs.usable(q)
    if not graphed and name == "auto" and not (q.device.type == "cuda" and (ragged or tuning.split_kv_equal_rows)):
        return "backend"
    if _split_kv_refusals(q, k_cache, v_cache, backend, tuning):
        return "backend"
    return "graphs" if graphed else "split_kv"


class StepGraphs:
    """One cache's dense decode steps on one device, replayed from CUDA graphs.

    An eager step is host-bound at long contexts (launches and checks take as
    long as reading a 128K cache, docs/performance.md 9). Steps run the
    split-KV kernel over the rows' lengths kept on the device (``lens``,
    advanced by every append). A step shape (the query's, the cache's
    storage) runs eagerly on its first call (compiling the kernels) and is
    captured on its second (:class:`longattn.dilated.graphs.GraphCache`: the
    query copied in, the outputs copied out), so one graph serves every step
    until the cache's storage grows (which drops the graphs). At most
    :attr:`MAX` shapes per cache; every cache's graphs share one memory pool
    (steps run one after another on one stream)."""

    MAX = 4
    MAX_CAPTURES = 16  # more, and the cache alternates between more shapes than it keeps: it stops capturing

    def __init__(self):
        self.lens: Optional[torch.Tensor] = None
        self.replays = graphs.GraphCache(self.MAX, self.MAX_CAPTURES, shared_pool=True)

    def clear(self) -> None:
        self.replays.clear()
        self.lens = None

    def advance(self, n: int) -> None:
        """``n`` tokens were appended to every row."""
        if self.lens is not None:
            self.lens += n

    def attend(self, q, k_cache, v_cache, lens: Sequence[int], scale: float, tuning: _tuning.DecodeTuning
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the step: replayed, or eager on a shape's first call."""
        if self.lens is None:
            with torch.inference_mode(False):  # appends advance it in and out of inference mode
                self.lens = torch.tensor(list(lens), dtype=torch.int32, device=q.device)
        run = lambda x: _kdec.decode(x, k_cache, v_cache, None, x.shape[1] > 1, scale, lens_tensor=self.lens,
                                     **tuning.kernel_args(False))
        # q's shape, dtype and device (and the inference mode) are added by the GraphCache
        key = (q.stride(), scale, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, tuning)
        return self.replays.run(key, run, [q])


def dense_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: Sequence[int], causal: bool,
               scale: float, backend: str, lens_tensor: Optional[torch.Tensor] = None,
               tuning: _tuning.DecodeTuning = _tuning.DECODE, *, engine: Optional[str] = None,
               ragged: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``(B, Lq, H, D)`` over the first ``lens[b]`` slots of each
    row; ``causal``: bottom-right (query i sees ``lens[b] - Lq + i + 1`` keys).
    Returns out in q's dtype and lse ``(B, H, Lq)`` float32; a row with no key
    gives 0 and -inf. The split-KV kernel takes the whole batch in one call
    (``lens_tensor``: the lengths on q's device, if the caller has them);
    otherwise one backend call when the rows have equal lengths, else one per
    row (views of the cache, never copies). ``engine`` (``"split_kv"`` or
    ``"backend"``) and ``ragged`` (rows of different lengths), when the caller
    has decided them (:func:`dense_engine`); else decided here."""
    b, lq, h, _ = q.shape
    masked = causal and lq > 1  # one query sees every cached key
    if ragged is None:
        ragged = len(set(lens)) > 1
    if engine is None:
        engine = dense_engine(q, k_cache, v_cache, backend, ragged or lens_tensor is not None, tuning)
    if engine == "split_kv":
        return _kdec.decode(q, k_cache, v_cache, lens, masked, scale, lens_tensor=lens_tensor, ragged=ragged,
                            **tuning.kernel_args(q.device.type == "cpu"))
    if not ragged:
        return _dense_rows(q, k_cache, v_cache, lens[0], masked, scale, backend, tuning)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        out[i:i + 1], lse[i:i + 1] = _dense_rows(q[i:i + 1], k_cache[i:i + 1], v_cache[i:i + 1], n, masked, scale,
                                                 backend, tuning)
    return out, lse


def _dense_rows(q, k_cache, v_cache, n: int, masked: bool, scale: float, backend: str,
                tuning: _tuning.DecodeTuning):
    b, lq, h, _ = q.shape
    if n == 0:
        return empty_state(q, q.dtype)
    k, v = k_cache[:, :n], v_cache[:, :n]
    if masked:
        spec = bk.BlockSpec(scale, True, (-1, -1), n - lq)
        be = bk.select_backend(q, k, spec, backend, exclude=tuning.auto_excludes)
    else:
        spec = bk.BlockSpec(scale)
        be = _unmasked_backend(q, k, spec, backend, tuning)
    return be.forward(q, k, v, spec)


def _unmasked_backend(q, k, spec, backend: str, tuning: _tuning.DecodeTuning = _tuning.DECODE):
    # Chosen on one key row: an unmasked call's refusals do not depend on the
    # key count, and a shape that stays the same as the cache grows is looked
    # up once instead of walking every backend's refusals per token.
    return bk.select_backend(q, k[:, :1], spec, backend, exclude=tuning.auto_excludes)


# ------------------------------------------------------------------ dilated
def dilated_read_start(position: int, segment_lengths: Sequence[int]) -> int:
    """The first position that dilated decoding of a query at ``position`` (or
    any later one) reads: the start of the earliest current segment,
    ``min over branches of (position // w) * w``. Keys before it are never read
    again; the cache must hold every token from there on (all kv heads: each
    head reads its own offset class)."""
    return min((position // w) * w for w in segment_lengths)


def _kv_heads(c: int, r: int, h: int, hkv: int):
    """The kv heads query heads ``c, c + r, ...`` read, as an index into the
    cache's head dim, in the order the backend's GQA grouping expects."""
    g = h // hkv
    if g == 1:
        return slice(c, h, r)
    if r % g == 0:  # one kv head per query head of the class
        return slice(c // g, hkv, r // g)
    if g % r == 0:  # every kv head, each for g / r consecutive heads of the class
        return slice(0, hkv)
    return [hh // g for hh in range(c, h, r)]  # irregular: one (copied) kv head per query head


def dilated_part(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs, q_pos: Sequence[int],
                 segment_lengths: Sequence[int], dilation_rates: Sequence[int], scale: float, backend: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dilated attention of q ``(B, Lq, H, D)`` over the cached slots of each row.

    ``runs[b]``: ``(global_start, local_start, length)`` runs of row b's slots
    (:class:`longattn.distributed.cache.CacheLayout`; one device: one run
    ``(0, 0, length)``); ``q_pos[b]``: global position of row b's first query.
    Query i at position p = q_pos[b] + i, branch (w, r): heads h with
    ``h % r == (p % w) % r`` read the keys at p, p - r, ... down to the segment
    start ``(p // w) * w``; all branches are one softmax (merged by lse). Each
    (query, branch, run) is one backend call on strided views of the cache.
    Returns out float32 ``(B, Lq, H, D)`` and lse ``(B, H, Lq)``.
    """
    b, lq, h, _ = q.shape
    hkv = k_cache.shape[2]
    out, lse = empty_state(q, torch.float32)
    lse_q = lse.transpose(1, 2)  # (B, Lq, H) view: merge_ aligns lse with out's leading dims
    spec = bk.BlockSpec(scale)
    for row in range(b):
        for i in range(lq):
            p = q_pos[row] + i
            for w, r in zip(segment_lengths, dilation_rates):
                s0 = (p // w) * w
                c = (p - s0) % r
                if c >= h:
                    continue
                qs = q[row:row + 1, i:i + 1, c::r]
                heads = _kv_heads(c, r, h, hkv)
                for g0, l0, n in runs[row]:
                    lo, hi = max(g0, s0), min(g0 + n - 1, p)
                    if lo > hi:
                        continue
                    j0 = lo + (p - lo) % r  # first position >= lo in p's class
                    if j0 > hi:
                        continue
                    a = l0 + j0 - g0
                    e = a + (hi - j0) // r * r + 1
                    k = k_cache[row:row + 1, a:e:r][:, :, heads]
                    v = v_cache[row:row + 1, a:e:r][:, :, heads]
                    o, l = _unmasked_backend(qs, k, spec, backend).forward(qs, k, v, spec)
                    merge_(out[row:row + 1, i:i + 1, c::r], lse_q[row:row + 1, i:i + 1, c::r], o, l.transpose(1, 2))
    return out, lse


# ------------------------------------------------------------------ over ranks
def gather_partials(part: Optional[tuple[torch.Tensor, torch.Tensor]], shape: Optional[tuple[int, int, int, int]],
                    header: Sequence[int], group, device) -> tuple[list[list[int]], Callable]:
    """One all-gather of every rank's ``header`` (ints in ``[0, 2**31)``) and,
    where ``shape`` ``(B, Lq, H, D)`` is given, its partial result ``part`` =
    (out ``(B, Lq, H, D)``, lse ``(B, H, Lq)``); a rank with no result
    (``part`` None: its call failed or differs) sends zeros of ``shape``, so
    every rank's block has the same size whatever its arguments. ``shape`` must
    be the same on every rank (agreed before).

    Returns (the headers of every rank, as host ints: one device-to-host copy
    when there is a header; a thunk giving the merge by lse in float32 of the
    gathered results, (out, lse), the same bits on every rank).
    """
    nh = len(header)
    b, lq, h, d = shape if shape is not None else (0, 0, 0, 0)
    n_out, n_lse = b * lq * h * d, b * h * lq
    # one int32 block: the header, then the float32 partials viewed in place
    buf = torch.empty(nh + n_out + n_lse, dtype=torch.int32, device=device)
    if nh:
        buf[:nh].copy_(torch.tensor(list(header), dtype=torch.int32))
    pay = buf[nh:].view(torch.float32)
    if part is None:
        pay.zero_()
    else:
        pay[:n_out].copy_(part[0].reshape(-1))
        pay[n_out:].copy_(part[1].reshape(-1))
    got = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, buf, group=group)
    heads = torch.stack([x[:nh] for x in got]).tolist() if nh else [[] for _ in got]

    def merge() -> tuple[torch.Tensor, torch.Tensor]:
        xs = [x[nh:].view(torch.float32) for x in got]
        acc_out = xs[0][:n_out].view(b, lq, h, d).clone()
        acc_lse = xs[0][n_out:].view(b, h, lq).clone()
        for x in xs[1:]:  # the same order on every rank: bitwise the same result everywhere
            # lse (B, H, Lq) as (B, Lq, H) views: merge_ aligns lse with out's leading dims
            merge_(acc_out, acc_lse.transpose(1, 2), x[:n_out].view(b, lq, h, d),
                   x[n_out:].view(b, h, lq).transpose(1, 2))
        return acc_out, acc_lse

    return heads, merge


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group, problem: Optional[Exception] = None,
                     check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial (out ``(B, Lq, H, D)``, lse ``(B, H, Lq)``) merged by
    lse in float32, the same on every rank: one all-gather of
    ``B * Lq * H * (D + 1)`` floats per rank, whatever the context length.

    ``check``: the gathered block also carries a flag per rank, and every rank
    raises when one reported a ``problem`` (that rank joins the all-gather
    with zeros first, so no rank waits); reading the flags costs a device sync.
    """
    heads, merge = gather_partials((out, lse), tuple(out.shape), [int(problem is not None)] if check else [], group,
                                   out.device)
    if check:
        checks.raise_flagged("decode_attention", problem, [r for r, f in enumerate(heads) if f[0]])
    return merge()


# ------------------------------------------------------------------ public
@torch.no_grad()
def _check_decode_args(q, k_cache, v_cache, cache_seqlens, causal, return_lse, softmax_scale, backend) -> None:
    check_cache_tensors(q, k_cache, v_cache)
    check_seqlens_tensor(cache_seqlens, q.shape[0])
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    bk.check_backend_name(backend)


def _captured(q, k_cache, v_cache, cache_seqlens, causal: bool, scale: float, backend: str):
    """Inside CUDA graph capture: the lengths stay on the device (a host read
    cannot be captured, and a replay sees the lengths of its own step), so
    only the split-KV kernel, whose launch does not depend on them, can run;
    keeping them within [q_len, capacity] is the caller's part."""
    why = _split_kv_refusals(q, k_cache, v_cache, backend, _tuning.DECODE)
    if cache_seqlens.device != q.device:
        why.append(f"cache_seqlens is on {cache_seqlens.device} (put it on {q.device})")
    if why:
        raise ValueError("decode_attention under CUDA graph capture runs the split-KV kernel over lengths read on "
                         f"the device; it cannot here: {'; '.join(why)}")
    return _kdec.decode(q, k_cache, v_cache, None, causal and q.shape[1] > 1, scale, lens_tensor=cache_seqlens,
                        **_tuning.DECODE.kernel_args(False))


def _no_capture(q: torch.Tensor, what: str) -> None:
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"{what} reads the lengths on the host and cannot run under CUDA graph capture; capture "
                         f"decode_attention on one device with cache_seqlens on the GPU instead")


def _on_device(lens: torch.Tensor, q: torch.Tensor) -> Optional[torch.Tensor]:
    return lens if lens.device == q.device else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, cache_seqlens: torch.Tensor,
                     causal: bool = True, softmax_scale: Optional[float] = None, return_lse: bool = False,
                     backend: str = "auto", group=None):
    """Attention of the newest tokens' queries over a KV cache (decoding).

    Args:
        q: ``(batch, q_len, nheads, headdim)``, usually ``q_len == 1``.
        k_cache, v_cache: ``(batch, capacity, nheads_kv, headdim)``; row ``b``'s
            keys are its first ``cache_seqlens[b]`` slots (the rest is unused
            capacity). GQA: query head ``h`` reads kv head ``h // (nheads // nheads_kv)``.
        cache_seqlens: int32 ``(batch,)`` valid lengths (rows may differ); they are
            read on the host, so a CPU tensor saves a device sync per call.
            Inside CUDA graph capture (one device) they must be on q's device
            and are read there only: the captured step replays with whatever
            lengths the tensor holds (the split-KV kernel; see Notes).
        causal: bottom-right as :func:`longattn.attention`: the queries are the
            last ``q_len`` tokens of the cache, query ``i`` at position
            ``cache_seqlens[b] - q_len + i`` sees the keys up to it (so
            ``cache_seqlens >= q_len``). False: every valid key (e.g. a cache of
            another sequence). With one query both are the same.
        softmax_scale, return_lse, backend: as :func:`longattn.attention`.
        group: a ProcessGroup: the cache is sharded, ``k_cache``/``v_cache``/
            ``cache_seqlens`` are this rank's part and q is the same on every
            rank. Each rank attends to its part (``causal`` applies to the part:
            True on the rank whose part ends with the queries' own keys, False
            on the others, whose keys all precede the queries; a part may be
            empty) and the parts merge by lse in float32 with one all-gather of
            ``(batch, q_len, nheads, headdim + 1)`` floats per rank, whatever the
            context length; the result is the same on every rank. The
            all-gather carries a flag so that lengths out of range on one rank
            raise on every rank. :class:`longattn.KVCache` manages such parts.

    Returns:
        ``out`` ``(batch, q_len, nheads, headdim)`` in q's dtype, and lse
        ``(batch, nheads, q_len)`` float32 when asked. Rows that see no key: 0
        and -inf.

    Equivalent PyTorch (one row ``b``, ``n = cache_seqlens[b]``)::

        longattn.attention(q[b:b+1], k_cache[b:b+1, :n], v_cache[b:b+1, :n], causal=causal)

    Notes:
        Engines (``backend="auto"``, :func:`dense_engine`): on CUDA, rows of
        different lengths, or lengths given on the device, go to the split-KV
        kernel (:mod:`longattn.kernels.decode`: the cache's tokens cut into
        splits over the whole GPU, all rows in one launch); rows of one length
        given on the host to the flash kernel on views of the cache (one
        launch, the least host time; ``DecodeTuning``). A whole decode
        step can be captured in a CUDA graph and replayed with new lengths
        (the split-KV kernel, lengths read on the device)::

            lens = torch.tensor([n], dtype=torch.int32, device="cuda")
            longattn.decode_attention(q, k_cache, v_cache, cache_seqlens=lens)  # compiles the kernels
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = longattn.decode_attention(q, k_cache, v_cache, cache_seqlens=lens)
            lens += 1; q.copy_(q_next); g.replay()  # out now holds the next step's output
    """
    backend = bk.resolve(backend) if backend == "auto" else backend  # a bad name is raised by the checks below
    check = lambda: _check_decode_args(q, k_cache, v_cache, cache_seqlens, causal, return_lse, softmax_scale, backend)
    if group is None:
        check()
        scale = bk.default_scale(q.shape[-1], softmax_scale)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            out, lse = _captured(q, k_cache, v_cache, cache_seqlens, causal, scale, backend)
        else:
            lens = cache_seqlens.tolist()
            check_lengths(lens, k_cache.shape[1], q.shape[1], causal)
            out, lse = dense_part(q, k_cache, v_cache, lens, causal, scale, backend, _on_device(cache_seqlens, q))
        return (out, lse) if return_lse else out
    _no_capture(q, "decode_attention(..., group=...)")
    g = checks.resolve_group(group)
    problem = None
    try:
        check()
    except (TypeError, ValueError) as e:
        problem = e
    # the capacity and the lengths may differ across ranks; everything else may not
    checks.agree(g, "decode_attention", problem, q=describe(q), k=describe(k_cache, capacity=False),
          v=describe(v_cache, capacity=False), seqlens=describe(cache_seqlens), scale=softmax_scale,
          lse=return_lse, backend=backend)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    lens = cache_seqlens.tolist()
    try:
        check_lengths(lens, k_cache.shape[1], q.shape[1], causal)
        out, lse = dense_part(q, k_cache, v_cache, lens, causal, scale, backend, _on_device(cache_seqlens, q))
    except ValueError as e:
        problem = e
        out, lse = empty_state(q, q.dtype)
    out, lse = merge_over_ranks(out, lse, g, problem, check=True)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


@torch.no_grad()
def dilated_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                             cache_seqlens: torch.Tensor, segment_lengths: Sequence[int],
                             dilation_rates: Sequence[int], softmax_scale: Optional[float] = None,
                             return_lse: bool = False, backend: str = "auto"):
    """LongNet dilated attention of the newest tokens over a KV cache on one
    device: exactly the last ``q_len`` rows of
    ``dilated_attention(..., causal=True)`` on each row's whole sequence
    (the cache's first ``cache_seqlens[b]`` tokens, the queries being the last
    ``q_len`` of them).

    A query at position p, branch ``(w, r)``: the heads h with
    ``h % r == (p % w) % r`` read the keys at p, p - r, p - 2r, ... down to its
    segment's start ``(p // w) * w``; the other heads get nothing from that
    branch. All branches are one softmax over the union (a key given twice
    counts twice). What must stay cached: every token (all kv heads) from
    :func:`dilated_read_start` on. Sharded caches: :meth:`longattn.KVCache.attend`.

    Args:
        q: ``(batch, q_len, nheads, headdim)``.
        k_cache, v_cache, cache_seqlens: as :func:`decode_attention`
            (``cache_seqlens >= q_len``).
        segment_lengths, dilation_rates: one ``(w, r)`` per branch.
        softmax_scale, return_lse, backend: as :func:`longattn.attention`.

    Returns:
        ``out`` like q (and lse ``(batch, nheads, q_len)`` float32 if asked).

    Equivalent PyTorch (row ``b``, ``n = cache_seqlens[b]``, ``Q`` the queries of
    all n tokens)::

        longattn.dilated_attention(Q, k_cache[b:b+1, :n], v_cache[b:b+1, :n], causal=True,
                                   segment_lengths=segment_lengths, dilation_rates=dilation_rates)[:, -q_len:]
    """
    check_cache_tensors(q, k_cache, v_cache)
    _no_capture(q, "dilated_decode_attention")
    check_seqlens_tensor(cache_seqlens, q.shape[0])
    segs, rates = check_dilation(segment_lengths, dilation_rates)
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    backend = bk.resolve(backend)
    lens = cache_seqlens.tolist()
    lq = q.shape[1]
    check_lengths(lens, k_cache.shape[1], lq, True)
    out, lse = dilated_part(q, k_cache, v_cache, [[(0, 0, n)] for n in lens], [n - lq for n in lens], segs, rates,
                            bk.default_scale(q.shape[-1], softmax_scale), backend)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
