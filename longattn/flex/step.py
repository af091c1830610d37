"""The local op of FlexAttention in longattn: one call on one device, or one
ring step (:class:`FlexStep`), with its autograd graph kept for a backward
that supplies the merged softmax statistics (see :mod:`longattn.flex`).

FlexAttention's operator (what the public
``torch.nn.attention.flex_attention`` calls) runs compiled by inductor on
CUDA (its Triton backend, pinned: the FLASH backend has no lse gradient), in
eager mode elsewhere with the same autograd (dense scores per step: small
shapes only). lse is the natural log, as every longattn op returns.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
import types
from typing import Callable, Optional

import torch
from torch._higher_order_ops.flex_attention import flex_attention as _flex_hop
from torch.autograd.graph import get_gradient_edge
from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

from .. import backends as bk
from ..distributed.plan import Call

LN2 = math.log(2.0)
_OPTIONS = {"BACKEND": "TRITON"}  # the kernel with an lse gradient (the FLASH backend has none)


def _attend(q, k, v, score_mod, block_mask, scale):
    """FlexAttention's operator on (B, H, L, D), with its autograd: out, lse
    (base 2, as the operator returns it), max_scores. The public function
    calls the same operator (under torch.compile: this graph); it is called
    directly so that the lse a backward needs is an output seen here (the
    ring swaps it for the merged one), and on CPU, where the public function
    refuses inputs that require grad."""
    opts = _apply_kernel_options(q, k, v, True, dict(_OPTIONS))
    return _flex_hop(q, k, v, score_mod or _identity, block_mask.as_tuple(), scale, opts)


@functools.lru_cache(maxsize=None)
def _compiled(backend, pattern, grad: bool):
    """The compiled FlexAttention of one pattern, with (grad) or without
    autograd. Dynamo keeps graphs, and counts them against its recompile limit
    (8; past it the eager implementation runs: dense scores), per code object:
    each (pattern, grad) gets a copy of the function's code, so they do not
    share that budget (each shape is one graph)."""
    own = types.FunctionType(_attend.__code__.replace(), _attend.__globals__, _attend.__name__)
    return torch.compile(own, backend=backend, fullgraph=True, dynamic=False)


def compile_backend(device: torch.device) -> Optional[str]:
    """How FlexAttention runs on ``device``: inductor's kernels on CUDA; None
    (the eager operator) elsewhere (inductor's CPU FlexAttention is inference only)."""
    return "inductor" if device.type == "cuda" else None


class _Saved:
    """A tensor FlexAttention's autograd saved for its backward (through
    ``saved_tensors_hooks``): kept as is, or, where ``name`` is set, dropped
    and supplied again when the backward runs (see :meth:`FlexStep.record`)."""

    __slots__ = ("tensor", "name", "shape", "stride", "dtype")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.name, self.shape, self.stride, self.dtype = t, None, t.shape, t.stride(), t.dtype

    def supply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the layout the backward was compiled for (a view where only
        strides of size-1 dims differ, else a copy)."""
        same = x.shape == self.shape and all(a == b or n == 1 for a, b, n in zip(x.stride(), self.stride, x.shape))
        if same and x.dtype == self.dtype:
            return x.as_strided(self.shape, self.stride, x.storage_offset())
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=x.device).copy_(x)


class _Recording(threading.local):
    """Where :func:`_pack` puts what FlexAttention's autograd saves during one
    :meth:`FlexStep.record` (one pair of hook functions for every call: a
    compiled graph never sees new hooks)."""

    saved: Optional[list] = None


_RECORDING = _Recording()


def _pack(t: torch.Tensor) -> _Saved:
    s = _Saved(t)
    _RECORDING.saved.append(s)
    return s


def _unpack(s: _Saved) -> torch.Tensor:
    return s.tensor


class _Entry(torch.autograd.Function):
    """``x`` as an input of a recorded graph that holds no reference to it:
    the gradient is read at this node's edge (so a step's graph does not keep
    the visiting K/V block alive). ``anchor`` is any tensor that requires grad."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, grad


@dataclasses.dataclass
class StepGraph:
    """One ring step's FlexAttention graph, kept from the forward for the
    backward: the tensors it saved (``_Saved``; q, k, v, out, lse and
    max_scores named, not held) and the gradient edges of its inputs and outputs."""

    saved: list
    inputs: list
    outputs: list


class FlexStep:
    """The local op of one ring step (``Call.run``): FlexAttention of the
    local queries against one K/V block under ``block_mask`` (local indices),
    on (B, L, H, D) tensors; lse natural-log float32, -inf where a row sees no key.

    ``compile``: a ``torch.compile`` backend for FlexAttention ("inductor" on
    CUDA; "aot_eager" traces the same graphs elsewhere) or None for the eager
    operator; ``pattern``: a hashable name of the (mask, score) pattern, whose
    compiled graphs the steps of every call with it share.
    """

    def __init__(self, block_mask, score_mod: Optional[Callable], scale: float, compile: Optional[str],
                 pattern=None):
        self.block_mask, self.score_mod, self.scale, self.compile = block_mask, score_mod, scale, compile
        self.pattern = pattern
        lq, lk = block_mask.seq_lengths
        # The rows and keys it covers as a plain call: the ring sizes its accumulators from these. They never
        # run in its place (the backward below never declines, see Call.run).
        self.calls = (Call(0, lq, 0, lk, bk.BlockSpec(scale)),)

    def _run(self, q, k, v):
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        run = _compiled(self.compile, self.pattern, grad) if self.compile else _attend
        return run(q, k, v, self.score_mod, self.block_mask, self.scale)

    def attend(self, q, k, v):
        """(out, lse) of q against this block, differentiable through
        FlexAttention's autograd where the inputs require grad."""
        out, lse2, _ = self._run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2), lse2 * LN2

    def forward(self, q, k, v):
        with torch.no_grad():
            return self.attend(q, k, v)

    def record(self, q, k, v):
        """(out, lse, graph): the forward of this block with FlexAttention's
        autograd graph kept for :meth:`backward`, but none of the tensors that
        graph saved for it: q, this K/V block, the block's out and lse are
        dropped as they are saved (``saved_tensors_hooks``) and supplied again
        by the backward, the merged out and lse in place of the block's. The
        graph holds the block mask's tensors and small buffers only; ``out``
        may be modified in place (the ring merges into it)."""
        anchor = torch.zeros((), requires_grad=True)
        saved = _RECORDING.saved = []
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                xs = [_Entry.apply(anchor, x.transpose(1, 2)) for x in (q, k, v)]
                out, lse2, mx = self._run(*xs)
        finally:
            _RECORDING.saved = None
        names = {_where(t): n for n, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse2), ("max", mx))
                 if t.numel()}
        for s in saved:
            s.name = names.get(_where(s.tensor)) if s.tensor.numel() else None
            if s.name is not None:
                s.tensor = None
            elif any(s.tensor.shape == t.shape and s.tensor.dtype == t.dtype for t in (out, lse2)):
                # a copy of the block's out or lse: its backward would use the block's statistics, not the merged
                # (a buffer a score_mod captured has its own shape, unless it is exactly out's or lse's)
                raise RuntimeError("ring_flex_attention: FlexAttention's autograd saved a tensor shaped like its "
                                   "out or lse that is neither; the flex ring's backward (which supplies the merged "
                                   "out and lse in their place) does not support this torch version")
        graph = StepGraph(saved, [get_gradient_edge(x) for x in xs], [get_gradient_edge(out), get_gradient_edge(lse2)])
        return out.detach().transpose(1, 2), lse2.detach() * LN2, graph

    def backward(self, dout, q, k, v, out, lse, dlse, graph: StepGraph):
        """(dq, dk, dv) of this block given the MERGED out and lse (natural
        log) of every block and their gradients (dlse None: zero): the
        recorded graph's backward (FlexAttention's backward operator, a kernel
        on CUDA) with the merged (out, lse) in place of the block's. With the
        softmax statistics of all keys it gives this block's exact share of
        every gradient, as a single-device backward's key blocks do; nothing is
        recomputed."""
        lse2 = (lse / LN2).contiguous()
        supply = dict(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), out=out.transpose(1, 2),
                      lse=lse2, max=lse2)
        for s in graph.saved:
            if s.name is not None:
                s.tensor = s.supply(supply[s.name])
        dl2 = torch.zeros_like(lse2) if dlse is None else dlse * LN2  # d lse / d lse2 = ln 2
        try:
            # retain_graph: a second backward through the same ring output (retain_graph=True) runs this again
            grads = torch.autograd.grad(graph.outputs, graph.inputs, [dout.transpose(1, 2), dl2], retain_graph=True)
        finally:
            for s in graph.saved:
                if s.name is not None:
                    s.tensor = None
        return tuple(g.transpose(1, 2) for g in grads)


def _where(t: torch.Tensor) -> tuple:
    """Which tensor a saved one is (a view of it: the same first element and
    size; q, k, v given as views of one packed tensor differ in the first)."""
    return t.data_ptr(), t.numel()
