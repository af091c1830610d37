"""``KVCache``: one attention layer's key/value cache for decoding, on one
device or sharded over the ranks of a process group (context-parallel
inference: a prompt too long for one GPU's memory)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from . import backends as bk
from . import tuning as _tuning
from ._sinks import apply_sinks, sinks_meta
from ._validation import check_dilation, check_flag, check_qkv, check_scale, check_softcap_sinks
from .distributed import checks
from .distributed.cache import CacheLayout, prefill_pieces
from .distributed.layout import check_layout
from .decode.bounded import bounded_part, check_bounds
from .decode.checks import check_cache_tensors, describe, no_capture
from .decode.dilated import dilated_part
from .decode.engine import dense_engine, dense_launch, dense_part
from .decode.graph_steps import StepGraphs
from .decode.sharded import checks_apart, gather_checks, gather_partials

__all__ = ["KVCache"]


def _check_kv(k, v, batch: Optional[int], nheads_kv: Optional[int], headdim: Optional[int], names=("k", "v")):
    check_qkv(None, k, v, names=(None, *names))
    want = (batch, nheads_kv, headdim)
    got = (k.shape[0], k.shape[2], k.shape[3])
    if any(w is not None and w != x for w, x in zip(want, got)):
        raise ValueError(f"{names[0]}/{names[1]} must be (batch={batch}, n, nheads_kv={nheads_kv}, "
                         f"headdim={headdim}), got {tuple(k.shape)}")


def _seqlens(seqlens, batch: int, total: int) -> list[int]:
    if seqlens is None:
        return [total] * batch
    vals = seqlens.tolist() if isinstance(seqlens, torch.Tensor) else list(seqlens)
    if len(vals) != batch or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= total
                                 for x in vals):
        raise ValueError(f"seqlens must hold {batch} ints in [0, {total}] (the real tokens of each row, right "
                         f"padding after them), got {vals}")
    return vals


class KVCache:
    """One attention layer's K/V cache for decoding, on one device or sharded
    over the ranks of ``group`` (every rank holds a part; the query is the
    same on every rank).

    What is stored: ``k``/``v`` ``(batch, capacity, nheads_kv, headdim)`` on each
    rank, its part (kv heads only: GQA), slot ``j`` of row ``b`` valid for
    ``j < local_seqlens[b]``; ``layout`` (:class:`~longattn.distributed.cache.CacheLayout`)
    says which global position every rank's slots hold, the same object on
    every rank. Dense decoding needs every token. Dilated decoding reads, for
    each branch (w, r), the keys of the query's current segment in its offset
    class: every token (all kv heads, since heads differ in class) from
    :func:`longattn.decode.dilated_read_start` on; the cache keeps all
    tokens, so one cache serves both and a model may mix them.

    * Build it from a context-parallel prefill: :meth:`from_prefill` (each rank
      passes its shard, contiguous or zigzag as the ring used) or
      :meth:`from_sequence` (every rank passes the whole prompt's K/V, each
      keeps its pieces); or empty (``KVCache(batch, nheads_kv, headdim, ...)``)
      and :meth:`append` the prompt.
    * :meth:`append` ``(batch, n, nheads_kv, headdim)`` puts the new tokens on one
      rank, chosen the same way on every rank to keep the parts balanced
      (within ``block`` tokens; see :class:`~longattn.distributed.cache.CacheLayout`).
      Capacity is preallocated (``reserve``) and grows by an eighth when full (a copy).
    * :meth:`attend` runs the queries of the tokens appended last over every
      part, dense or dilated: each rank attends to its part, the partial
      results merge by lse with one all-gather of ``(batch, q_len, nheads,
      headdim + 1)`` floats per call.

    Rows may hold different lengths (right-padded prompts: padding is never
    stored). Inference only (no autograd).

    On one CUDA device a dense step (``attend`` without branches, backend
    auto or triton) is replayed from a CUDA graph from its shape's second
    call on (:class:`longattn.decode.graph_steps.StepGraphs`: an eager step is
    host-bound at long contexts); steps of one cache run on one stream. The
    engines follow ``cache.tuning`` (:class:`longattn.tuning.DecodeTuning`),
    e.g. ``cache.tuning = DecodeTuning(graph_steps=False)`` to run every step
    eagerly.
    """

    def __init__(self, batch: int, nheads_kv: int, headdim: int, *, dtype: torch.dtype = torch.float32,
                 device=None, capacity: int = 0, group=None, block: int = 256):
        for name, val in (("batch", batch), ("nheads_kv", nheads_kv), ("headdim", headdim), ("capacity", capacity),
                          ("block", block)):
            if not isinstance(val, int) or isinstance(val, bool) or val < (0 if name == "capacity" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'capacity' else 'positive'} int, "
                                 f"got {val!r}")
        self.group = None if group is None else checks.resolve_group(group)
        self.world = 1 if self.group is None else dist.get_world_size(self.group)
        self.rank = 0 if self.group is None else dist.get_rank(self.group)
        self.layout = CacheLayout(self.world, batch, block)
        self.k = torch.empty(batch, capacity, nheads_kv, headdim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        # the signature of the last append/attend arguments that passed the
        # checks on one device: a decode step is host-bound, and a step like
        # the last is not checked again
        self._checked: dict = {}
        # sharded: the attend call every rank agreed on last ((digest, q shape):
        # the size of the one all-gather of a step), an append's problem that the
        # next attend reports on every rank, and the placement before the
        # appends since the last attend (undone when that attend finds a problem)
        self._agreed: Optional[tuple] = None
        self._pending: Optional[Exception] = None
        self._since_attend: Optional[tuple] = None
        self._steps = StepGraphs()
        self.tuning = _tuning.DECODE
        # attend(q, k_new=, v_new=): the append's copies (destinations, sources), run with the query's copy
        # into a replayed step's graph (one launch), else before the step's first kernel (_flush)
        self._defer = False
        self._deferred: Optional[tuple] = None

    # ------------------------------------------------------------ construction
    @classmethod
    def from_prefill(cls, k: torch.Tensor, v: torch.Tensor, *, seqlens=None, layout: str = "contiguous",
                     group=None, reserve: int = 0, block: int = 256) -> "KVCache":
        """The cache after a context-parallel prefill: ``k``/``v`` ``(batch,
        seqlen_local, nheads_kv, headdim)`` are this rank's shard of the prompt,
        split by ``layout`` as :func:`longattn.shard` does (what
        :func:`longattn.ring_attention` and ``dilated_attention(..., group=)``
        take); without ``group``, the whole prompt. ``seqlens``: real tokens per
        row (right padding after them; default all). ``reserve``: tokens to be
        appended, preallocated."""
        g = None if group is None else checks.resolve_group(group)
        world = 1 if g is None else dist.get_world_size(g)
        lens = _checked_build(g, "KVCache.from_prefill", k, v, seqlens, k.shape[1] * world, layout, reserve, block,
                              zigzag_local=True)
        cache = cls._empty_like(k, g, block)
        cache.layout = CacheLayout.from_prefill(lens, k.shape[1] * world, layout=layout, world=world, block=block)
        cache._alloc(max(cache.layout.fullest()[cache.rank], k.shape[1]) + cache._reserve_local(reserve))
        cache.k[:, :k.shape[1]] = k
        cache.v[:, :v.shape[1]] = v
        return cache

    @classmethod
    def from_sequence(cls, k: torch.Tensor, v: torch.Tensor, *, seqlens=None, layout: str = "zigzag", group=None,
                      reserve: int = 0, block: int = 256) -> "KVCache":
        """The cache of a prompt whose K/V ``(batch, seqlen, nheads_kv, headdim)``
        every rank holds whole (e.g. computed replicated): each rank keeps the
        pieces ``layout`` gives it (:func:`longattn.distributed.cache.prefill_pieces`;
        any length). ``seqlens``, ``reserve`` as :meth:`from_prefill`."""
        g = None if group is None else checks.resolve_group(group)
        lens = _checked_build(g, "KVCache.from_sequence", k, v, seqlens, k.shape[1], layout, reserve, block,
                              zigzag_local=False)
        cache = cls._empty_like(k, g, block)
        s = k.shape[1]
        cache.layout = CacheLayout.from_prefill(lens, s, layout=layout, world=cache.world, block=block)
        pieces = prefill_pieces(layout, cache.rank, cache.world, s)
        cache._alloc(sum(n for _, n in pieces) + cache._reserve_local(reserve))
        slot = 0
        for g0, n in pieces:
            cache.k[:, slot:slot + n] = k[:, g0:g0 + n]
            cache.v[:, slot:slot + n] = v[:, g0:g0 + n]
            slot += n
        return cache

    @classmethod
    def _empty_like(cls, k, group, block):
        return cls(k.shape[0], k.shape[2], k.shape[3], dtype=k.dtype, device=k.device, group=group, block=block)

    def _reserve_local(self, reserve: int) -> int:
        # Appends reach a rank a block at a time and the parts stay within a
        # block of each other.
        return reserve if self.world == 1 else -(-reserve // self.world) + self.layout.block

    def _alloc(self, capacity: int) -> None:
        b, _, hkv, d = self.k.shape
        self.k = self.k.new_empty(b, capacity, hkv, d)
        self.v = self.v.new_empty(b, capacity, hkv, d)

    def _grow(self, needed: int) -> None:
        # By an eighth (at least two blocks): a part of a context that barely
        # fits must not double; the copy is amortised over many appends.
        old = self.k.shape[1]
        k, v = self.k, self.v
        self._steps.clear()  # the graphs read the old storage
        self._alloc(max(needed, old + max(old // 8, 2 * self.layout.block)))
        self.k[:, :old] = k
        self.v[:, :old] = v

    # ------------------------------------------------------------ state
    @property
    def capacity(self) -> int:
        """Slots allocated on this rank."""
        return self.k.shape[1]

    @property
    def seqlens(self) -> torch.Tensor:
        """Tokens of each row, all ranks together: int32 ``(batch,)`` on the CPU."""
        return torch.tensor(self.layout.seqlens, dtype=torch.int32, device="cpu")

    @property
    def local_seqlens(self) -> torch.Tensor:
        """Tokens of each row stored on this rank: int32 ``(batch,)`` on the CPU."""
        return torch.tensor(self.layout.local[self.rank], dtype=torch.int32, device="cpu")

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.k.shape[0]}, nheads_kv={self.k.shape[2]}, headdim={self.k.shape[3]}, "
                f"seqlens={self.layout.seqlens}, rank={self.rank}/{self.world}, local={self.layout.local[self.rank]}, "
                f"capacity={self.capacity}, dtype={self.k.dtype})")

    # ------------------------------------------------------------ decoding
    @torch.no_grad()
    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> Optional[int]:
        """Append ``(batch, n, nheads_kv, headdim)`` new tokens (position
        ``seqlens[b] + i`` of row b), the same on every rank; one rank stores them
        (returned), chosen the same way on every rank.

        Sharded, an append runs no collective: a problem with its arguments on
        any rank (or appends that differ across ranks) is raised by the next
        :meth:`attend`, on every rank, and every append since the last attend
        that succeeded is undone there (the cache stays usable); this rank's
        append with a problem returns None. One device: raised here."""
        sig = None
        if self.group is None and isinstance(k_new, torch.Tensor) and isinstance(v_new, torch.Tensor):
            sig = (k_new.shape, v_new.shape, k_new.dtype, v_new.dtype, k_new.device, v_new.device)
            if sig == self._checked.get("append"):
                return self._store(k_new, v_new)
        problem = None
        try:
            b, _, hkv, d = self.k.shape
            _check_kv(k_new, v_new, b, hkv, d, ("k_new", "v_new"))
            if k_new.dtype != self.k.dtype or k_new.device != self.k.device:
                raise TypeError(f"k_new/v_new must be {self.k.dtype} on {self.k.device} like the cache, got "
                                f"{k_new.dtype} on {k_new.device}")
            if k_new.shape[1] == 0:
                raise ValueError("k_new/v_new hold no token (n = 0)")
        except (TypeError, ValueError) as e:
            problem = e
        if self.group is None:
            if problem is not None:
                raise problem
            self._checked["append"] = sig
            return self._store(k_new, v_new)
        if self._since_attend is None:
            self._since_attend = self.layout.state()
        if problem is not None or self._pending is not None:
            self._pending = self._pending or problem
            return None
        return self._store(k_new, v_new)

    def _store(self, k_new: torch.Tensor, v_new: torch.Tensor) -> int:
        n = k_new.shape[1]
        start = list(self.layout.local[self.rank])
        owner = self.layout.place(n)
        if owner == self.rank:
            if max(start) + n > self.capacity:
                self._grow(max(start) + n)
            if len(set(start)) == 1:  # one launch for both where strides allow (batch 1): one launch's host time
                copies = ([self.k.narrow(1, start[0], n), self.v.narrow(1, start[0], n)], [k_new, v_new])
                if self._defer:
                    self._deferred = copies
                else:
                    torch._foreach_copy_(*copies)
            else:
                for b, s in enumerate(start):
                    self.k[b, s:s + n] = k_new[b]
                    self.v[b, s:s + n] = v_new[b]
            self._steps.advance(n)  # one device: every row grew by n
        return owner

    def _flush(self) -> None:
        """Run the copies of an append deferred by ``attend(q, k_new=, v_new=)``."""
        if self._deferred is not None:
            copies, self._deferred = self._deferred, None
            torch._foreach_copy_(*copies)

    @torch.no_grad()
    def attend(self, q: torch.Tensor, *, k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None,
               segment_lengths: Optional[Sequence[int]] = None, dilation_rates: Optional[Sequence[int]] = None,
               softmax_scale: Optional[float] = None, return_lse: bool = False, softcap: float = 0.0,
               sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
               window_size: tuple[int, int] = (-1, -1), backend: str = "auto"):
        """Attention of the queries ``(batch, q_len, nheads, headdim)`` of the
        tokens appended last (``q_len`` at most the last :meth:`append`'s ``n``)
        over the whole cache, causal: query i of row b sits at position
        ``seqlens[b] - q_len + i``. With ``k_new`` and ``v_new`` ``(batch, n,
        nheads_kv, headdim)``: :meth:`append` them first, in the same call (as
        flash-attn's ``flash_attn_with_kvcache(..., k=, v=)``): on one GPU,
        where the step replays from a CUDA graph, their copies into the cache
        and the query's into the graph are one launch (``cache.append(k, v);
        cache.attend(q)`` is two). Dense (:func:`longattn.decode_attention`
        semantics), or dilated with ``segment_lengths``/``dilation_rates``
        (:func:`longattn.dilated_decode_attention` semantics: the last rows of
        ``dilated_attention(..., causal=True)``). Sharded: every rank calls it
        with the same q and gets the same result: each rank's check of the
        call and of its cache's placement, then the partial results, through
        all-gathers (on a GPU two per call, the checks' issued before the
        part's kernels; on the CPU one, the checks in its header, a call whose
        shape differs from the last agreed one agreeing on it first:
        ``DecodeTuning.sharded_checks``).

        Dense only: ``softcap`` and ``sinks`` as :func:`longattn.attention`
        (the sinks merge once, after every rank's part); ``chunk_size``:
        chunked attention (Llama 4), a query at position p sees the keys from
        ``p - p % chunk_size`` on; ``window_size`` ``(left, right)``: from
        ``p - left`` on (right has no effect: causal)
        (:mod:`longattn.decode.bounded`)."""
        if k_new is not None or v_new is not None:
            if k_new is None or v_new is None:
                problem = ValueError("KVCache.attend: k_new and v_new go together (the keys and values of the "
                                     "tokens whose queries q holds); pass both, or append them first")
                if self.group is None:
                    raise problem
                # sharded: an append's problem, raised by this call's checks on every rank (no rank leaves alone)
                if self._since_attend is None:
                    self._since_attend = self.layout.state()
                self._pending = self._pending or problem
            else:
                self._defer = self.group is None
                try:
                    self.append(k_new, v_new)
                finally:
                    self._defer = False
        try:
            return self._attend(q, segment_lengths, dilation_rates, softmax_scale, return_lse, softcap, sinks,
                                chunk_size, window_size, backend)
        finally:
            # copies no step ran (a call that raised anywhere): the append stands, as if made apart; a copy the
            # step ran already runs again, to the same values
            self._flush()

    def _attend(self, q, segment_lengths, dilation_rates, softmax_scale, return_lse, softcap, sinks, chunk_size,
                window_size, backend):
        dilated = segment_lengths is not None or dilation_rates is not None
        backend = bk.resolve(backend) if backend == "auto" else backend  # a bad name is raised by the checks below
        sig = None
        if self.group is None and not dilated and isinstance(q, torch.Tensor) and chunk_size is None:
            sig = (q.shape, q.dtype, q.device, type(softmax_scale), softmax_scale, type(return_lse), return_lse,
                   backend, type(softcap), softcap, sinks_meta(sinks), getattr(sinks, "device", None), window_size)
            if sig == self._checked.get("attend") and window_size == (-1, -1):
                self._check_q_len(q.shape[1])
                out, lse = self._attend_dense(q, bk.default_scale(q.shape[-1], softmax_scale), backend, softcap,
                                              return_lse or sinks is not None)
                return _returned(q, out, lse, return_lse, sinks)
        problem = None
        segs = rates = chunk = None
        left = -1
        try:
            check_cache_tensors(q, self.k, self.v)
            if dilated:
                segs, rates = check_dilation(segment_lengths, dilation_rates)
            check_flag(return_lse, "return_lse")
            check_scale(softmax_scale)
            bk.check_backend_name(backend)
            softcap = check_softcap_sinks(softcap, sinks, q)
            chunk, left = check_bounds(chunk_size, window_size)
            if dilated and (softcap or sinks is not None or chunk is not None or left >= 0):
                raise ValueError("KVCache.attend: dilated decoding (segment_lengths) takes no softcap, sinks, "
                                 "chunk_size or window_size; pass them to dense decoding only")
            self._check_q_len(q.shape[1])
        except (TypeError, ValueError) as e:
            problem = e
        scale = bk.default_scale(q.shape[-1], softmax_scale) if problem is None else None
        launch = lambda: self._launch(q, segs, rates, scale, backend, softcap, chunk, left)
        part = lambda: launch()()
        if problem is not None or dilated or chunk is not None or left >= 0:
            self._flush()  # the appended tokens in the cache before any path but a dense step's reads it
        if self.group is not None:
            if isinstance(q, torch.Tensor):  # under capture on every rank alike: raised before any collective
                no_capture(q, "KVCache.attend (sharded)")
            fields = dict(q=describe(q), segs=segs, rates=rates, scale=softmax_scale, lse=return_lse,
                          backend=backend, softcap=softcap, sinks=sinks_meta(sinks), chunk=chunk_size,
                          window=window_size)
            return _returned(q, *self._attend_sharded(q, fields, problem, launch), return_lse, sinks)
        if problem is not None:
            raise problem
        if dilated or chunk is not None or left >= 0:
            return _returned(q, *part(), return_lse, sinks)
        self._checked["attend"] = sig
        return _returned(q, *self._attend_dense(q, scale, backend, softcap, return_lse or sinks is not None),
                         return_lse, sinks)

    def _check_q_len(self, lq: int) -> None:
        if lq > self.layout.last_count:
            raise ValueError(f"attend() runs the queries of the tokens appended last: q_len ({lq}) exceeds the last "
                             f"append ({self.layout.last_count} tokens); append their keys and values in one call "
                             f"first")

    def _launch(self, q, segs, rates, scale: float, backend: str, softcap: float, chunk: Optional[int], left: int):
        """This rank's part of the call, dense (each query from its first seen
        key with ``chunk``/``left``) or dilated with ``segs``, in two steps:
        here what can refuse it (ValueError); the returned function queues
        its kernels and returns (out, lse). Dense decoding decides first
        (:func:`.decode.engine.dense_launch`); the others run here."""
        lay, me, lq = self.layout, self.rank, q.shape[1]
        if segs is None and (chunk is not None or left >= 0):
            res = bounded_part(q, self.k, self.v, lay.runs[me], [s - lq for s in lay.seqlens], chunk, left, scale,
                               softcap, backend, self.tuning)
            return lambda: res
        if segs is None:
            lens = lay.local[me]
            return dense_launch(q, self.k, self.v, lens, me == lay.last_owner, scale, backend, tuning=self.tuning,
                                ragged=len(set(lens)) > 1, softcap=softcap)
        res = dilated_part(q, self.k, self.v, lay.runs[me], [s - lq for s in lay.seqlens], segs, rates, scale,
                           backend)
        return lambda: res

    def _attend_dense(self, q, scale: float, backend: str, softcap: float, need_lse: bool = True):
        """One device: a step replayed from a CUDA graph where the engine allows
        (its lse None there unless ``need_lse``: one copy fewer per step)."""
        lens = self.layout.local[0]
        engine = dense_engine(q, self.k, self.v, backend, len(set(lens)) > 1, self.tuning, graph_steps=True,
                              softcap=softcap, keys=max(lens, default=0))
        if engine == "graphs":
            res = self._steps.attend(q, self.k, self.v, lens, scale, self.tuning, need_lse, copies=self._deferred)
            self._deferred = None  # taken by the step (until it returns, attend's flush runs them if it raised)
            return res
        self._flush()
        return dense_part(q, self.k, self.v, lens, True, scale, backend, tuning=self.tuning, engine=engine,
                          ragged=len(set(lens)) > 1, softcap=softcap)

    def _attend_sharded(self, q, fields: dict, problem: Optional[Exception], launch):
        """The merged (out, lse) of every rank's part (``launch()()``, see
        :meth:`_launch`), with each rank's digest of the call and of its
        placement and its problems judged alike on every rank
        (:meth:`_judge`): exchanged in the header of the partials' one
        all-gather, or apart before it, between the part's checks and its
        kernels (:func:`.decode.sharded.checks_apart`)."""
        call = checks.digest(fields)
        part = lambda: launch()()
        if checks_apart(self.k.device, self.tuning):
            run = None
            if problem is None and self._pending is None:
                run, problem = checks.local_problem(launch)
            heads = gather_checks(self._header(call, problem, True), self.group, self.k.device)
            self._judge(heads, problem, fields)
            try:
                result = run()
            except Exception:
                # not a refusal (those are raised before the checks went out): the other ranks are in the
                # partials' all-gather; NaN partials make their result visibly invalid, then this rank raises
                nan = torch.full_like(q, float("nan"))
                gather_partials((nan, nan[..., 0].transpose(1, 2).float()), tuple(q.shape), [], self.group,
                                self.k.device)
                raise
            merge = gather_partials(result, tuple(q.shape), [], self.group, self.k.device)[1]
            self._since_attend = None
            return merge()
        shape = tuple(q.shape) if problem is None else None
        same = problem is None and self._pending is None and self._agreed == (call, shape)
        result = None
        if same:  # a part that raises (a forced backend refusing this rank's keys) is this rank's problem
            result, problem = checks.local_problem(part)
            same = problem is None
        header = self._header(call, problem, same)
        agreed_shape = None if self._agreed is None else self._agreed[1]
        heads, merge = gather_partials(result, agreed_shape, header, self.group, self.k.device)
        self._judge(heads, problem, fields)
        if any(h[6] for h in heads):  # every rank made this same call, another than the one agreed before
            self._agreed = (call, shape)
            result, problem = checks.local_problem(part)
            heads, merge = gather_partials(result, shape, [int(problem is not None)], self.group, self.k.device)
            checks.raise_flagged("KVCache.attend", problem, [r for r, h in enumerate(heads) if h[0]])
        self._since_attend = None
        return merge()

    def _header(self, call: int, problem: Optional[Exception], same: bool) -> list:
        """This rank's checks of an attend, as ints in [0, 2**31) (:meth:`_judge` reads them)."""
        placed = self.layout.digest()
        return [call & _MASK, call >> 28, placed & _MASK, placed >> 28, int(problem is not None),
                int(self._pending is not None), int(not same)]

    def _judge(self, heads: list, problem: Optional[Exception], fields: dict) -> None:
        """Raise alike on every rank (they all read the same ``heads``) when an
        append had a problem or the placements differ (the appends since the
        last attend undone first), when the calls differ, or when a rank's call
        had a problem."""
        me = self.rank
        pending = [r for r, h in enumerate(heads) if h[5]]
        placed = [r for r, h in enumerate(heads) if h[2:4] != heads[me][2:4]]
        if pending or placed:
            mine, self._pending = self._pending, None
            if self._since_attend is not None:
                self.layout.restore(self._since_attend)
            self._since_attend = None
            if pending:
                checks.raise_flagged("KVCache.append (the appends since the last attend were undone)", mine, pending)
            raise ValueError(f"KVCache.append: ranks {placed} placed the appends since the last attend differently "
                             f"from this rank {me} (every rank must append the same tokens: the same n); those "
                             f"appends were undone")
        differ = [r for r, h in enumerate(heads) if h[:2] != heads[me][:2]]
        if differ and problem is None:  # a rank with a problem names it (its fields differ through it)
            raise checks.differ("KVCache.attend", me, fields, differ)
        checks.raise_flagged("KVCache.attend", problem, [r for r, h in enumerate(heads) if h[4]])


_MASK = (1 << 28) - 1  # a 56-bit digest travels as two int32 halves


def _returned(q, out, lse, return_lse: bool, sinks=None):
    if sinks is not None:  # once, after every part merged
        out, lse = apply_sinks(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _checked_build(g, what: str, k, v, seqlens, total: int, layout: str, reserve, block: int, zigzag_local: bool):
    """The arguments of a cache build, checked (on every rank of ``g`` together:
    one rank's bad input raises everywhere); returns the per-row lengths."""
    problem = lens = None
    try:
        _check_kv(k, v, None, None, None)
        check_layout(layout)
        if zigzag_local and layout == "zigzag" and k.shape[1] % 2:
            raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {k.shape[1]}")
        lens = _seqlens(seqlens, k.shape[0], total)
        if not isinstance(reserve, int) or reserve < 0:
            raise ValueError(f"reserve must be a non-negative int (tokens to be appended), got {reserve!r}")
    except (TypeError, ValueError) as e:
        problem = e
    if g is not None:
        checks.agree(g, what, problem, k=describe(k), v=describe(v),
                     seqlens=None if lens is None else tuple(lens), layout=layout, reserve=reserve, block=block)
    elif problem is not None:
        raise problem
    return lens
