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

:class:`Graph` (one captured call) also serves the decode steps of a
:class:`longattn.KVCache` (:class:`longattn.ops.decode.StepGraphs`, which owns
its graphs per cache).

Memory: each captured shape holds its inputs, outputs and temporaries in
its own pool, up to :data:`MAX_GRAPHS` shapes per process (least recently
used dropped); :func:`clear` frees them.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

MAX_GRAPHS = 8

_graphs: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_seen: set = set()


def clear() -> None:
    """Drop every captured pass (and its memory)."""
    _graphs.clear()
    _seen.clear()


def _usable(inputs) -> bool:
    x = inputs[0]
    return x.is_cuda and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling()


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

    def _load(self, inputs) -> None:
        for dst, src in zip(self.inputs, inputs):
            if dst is not None:
                dst.copy_(src)

    def __call__(self, inputs):
        self._load(inputs)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


def run(key: tuple, fn: Callable, inputs: Sequence[Optional[torch.Tensor]]):
    """``fn(*inputs)``, from a graph captured for ``key`` and the inputs'
    shapes where one is (or, on this shape's second call, can be) made."""
    if not _usable(inputs):
        return fn(*inputs)
    # inference mode in the key: buffers made under it cannot be written outside it
    key = (key, torch.is_inference_mode_enabled(), tuple(_signature(x) for x in inputs))
    g = _graphs.get(key)
    if g is None:
        if key not in _seen:  # first call of a shape: eager, it also warms kernels and plans up
            if len(_seen) >= 4096:  # shapes that never repeat cannot grow it
                _seen.clear()
            _seen.add(key)
            return fn(*inputs)
        g = _graphs[key] = Graph(fn, inputs)
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    _graphs.move_to_end(key)
    return g(inputs)
