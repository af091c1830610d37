"""Whole dilated passes replayed from CUDA graphs, for short sequences.

A views pass issues 5 to 30 backend calls, merges and adds; on a short
sequence issuing them takes longer than running them (LongNet at 8K on one
H100: 2-4 ms of host time for a 0.3 ms forward, see
``DilatedTuning.graph_max_tokens``). Where the plan says so, a pass is
captured once per shape into a CUDA graph, on the second call of that shape
(one-off shapes never pay for a capture), and later calls copy their inputs
into the graph's own, replay it, and return copies of its outputs (the next
replay overwrites them). Inside another capture, and under torch.compile,
the pass runs as it is (the caller's graph takes its kernels).

:class:`GraphCache` (that policy: eager, then captured, then replayed, at
most so many graphs) also serves the decode steps of a
:class:`longattn.KVCache` (:class:`longattn.decode.graph_steps.StepGraphs`, one
cache of graphs per KV cache).

Memory: each captured shape holds its inputs, outputs and temporaries in
its own pool, up to :data:`MAX_GRAPHS` shapes per process (least recently
used dropped); :func:`clear` frees them.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

MAX_GRAPHS = 8


def usable(x: torch.Tensor) -> bool:
    """Whether a call on ``x`` may be captured or replayed: on CUDA, not inside
    another capture (the caller's graph takes the kernels) nor torch.compile."""
    return x.is_cuda and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling()


def replays(q: torch.Tensor, max_tokens: int) -> bool:
    """Whether a call on queries ``q`` (B, S, ...) replays its passes from
    graphs: at most ``max_tokens`` query tokens (B x S; a tuning's
    ``graph_max_tokens``) and :func:`usable`."""
    return q.shape[0] * q.shape[1] <= max_tokens and usable(q)


def _signature(x: Optional[torch.Tensor]):
    return None if x is None else (tuple(x.shape), x.dtype, x.device)


class Graph:
    """``fn`` captured once over copies of ``inputs`` (its kernels already
    warmed up by an eager call); calling it copies new inputs in, replays and
    returns copies of the outputs (the next replay overwrites them). ``pool``:
    a memory pool shared with other graphs replayed one after another."""

    def __init__(self, fn: Callable, inputs: Sequence[Optional[torch.Tensor]], pool=None):
        self.inputs = [None if x is None else torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs]
        self._load(inputs)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (a DataLoader's pinned-memory thread) stay legal during capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn(*self.inputs)

    def _load(self, inputs, copies: Optional[tuple] = None) -> None:
        dst = [d for d in self.inputs if d is not None]
        src = [x for x in inputs if x is not None]
        if copies is not None:  # the caller's own copies in the same launch
            dst, src = list(copies[0]) + dst, list(copies[1]) + src
        if len(dst) == 1:  # a decode step's query: a copy engine's memcpy, not a multi-tensor kernel
            dst[0].copy_(src[0])
            return
        # one dispatch for all inputs: 1-6 µs less host time than a copy_ each for a forward's three,
        # 6-10 µs for a backward's six (benchmarks/graph_copy_ab.py, one H200)
        torch._foreach_copy_(dst, src)

    def __call__(self, inputs, copies: Optional[tuple] = None):
        self._load(inputs, copies)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


_shared_pool = None


def _pool():
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = torch.cuda.graph_pool_handle()
    return _shared_pool


class GraphCache:
    """Calls replayed from CUDA graphs, one per key and input shapes (the
    caller checks :func:`usable` first). A shape's first call runs eagerly (it
    also compiles kernels and warms plans up; one-off shapes never pay for a
    capture), its second is captured (:class:`Graph`), later ones replay.

    ``max_graphs``: graphs kept, the least recently used dropped past it.
    ``max_captures``: no capture after that many (a caller alternating
    between more shapes than it keeps would capture on every call); None: no
    limit. ``shared_pool``: the graphs share one memory pool with every other
    cache made so (their calls run one after another on one stream); else
    each graph has its own."""

    MAX_SEEN = 4096  # shapes that never repeat cannot grow the set of first calls past it

    def __init__(self, max_graphs: int, max_captures: Optional[int] = None, shared_pool: bool = False):
        self.max_graphs, self.max_captures, self.shared_pool = max_graphs, max_captures, shared_pool
        self.graphs: "collections.OrderedDict[tuple, Graph]" = collections.OrderedDict()
        self.seen: set = set()
        self.captures = 0

    def clear(self) -> None:
        """Drop every graph (and its memory), the record of first calls and
        the count of captures (a KV cache clears its graphs each time its
        storage grows: a long generation keeps capturing)."""
        self.graphs.clear()
        self.seen.clear()
        self.captures = 0

    def run(self, key: tuple, fn: Callable, inputs: Sequence[Optional[torch.Tensor]], copies: Optional[tuple] = None):
        """``fn(*inputs)``, from the graph of ``key`` and the inputs' shapes
        where one is (or, on this shape's second call, can be) made.
        ``copies``: (destinations, sources) copied first (``fn`` reads them),
        in the launch that copies the inputs into a replayed graph."""
        # inference mode in the key: buffers made under it cannot be written outside it
        key = (key, torch.is_inference_mode_enabled(), tuple(_signature(x) for x in inputs))
        g = self.graphs.get(key)
        if g is None:
            if copies is not None:  # an eager call or a capture's: run here, in no graph
                torch._foreach_copy_(*copies)
                copies = None
            # the graph reads contiguous copies of its inputs, so the eager call does too: a kernel compiled
            # per stride (FA4's) is then compiled here, never inside the capture
            inputs = [None if x is None else x.contiguous() for x in inputs]
            if key not in self.seen or (self.max_captures is not None and self.captures >= self.max_captures):
                if len(self.seen) >= self.MAX_SEEN:
                    self.seen.clear()
                self.seen.add(key)
                return fn(*inputs)
            self.captures += 1
            with torch.cuda.device(inputs[0].device):  # the inputs' device, whichever is current
                g = self.graphs[key] = Graph(fn, inputs, pool=_pool() if self.shared_pool else None)
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return g(inputs, copies)


_passes = GraphCache(MAX_GRAPHS)
_graphs = _passes.graphs  # the dilated passes' graphs (tests read how many)


def clear() -> None:
    """Drop every captured pass (and its memory)."""
    _passes.clear()


def run(key: tuple, fn: Callable, inputs: Sequence[Optional[torch.Tensor]]):
    """``fn(*inputs)`` of a dilated pass, replayed from a graph where
    :func:`usable` (:class:`GraphCache`, up to :data:`MAX_GRAPHS` shapes)."""
    return _passes.run(key, fn, inputs) if usable(inputs[0]) else fn(*inputs)
