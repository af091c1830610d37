"""``flex_attention`` and ``ring_flex_attention``: any attention pattern
(FlexAttention ``mask_mod`` / ``score_mod`` on global positions) on one device
or over a sequence sharded across ranks.

The ring is :mod:`longattn.distributed.ring` with one call per step whose
executor (:class:`FlexStep`) runs FlexAttention on (local queries x the
visiting K/V block) under that step's block mask
(:mod:`longattn.distributed.flex_plan`): empty blocks are skipped by the
kernel, empty steps are not computed (their exchange still runs), and the
ring ends after the last step any rank needs. Partial results merge by lse
in float32 as in every ring.

Backward. On one device FlexAttention's own autograd runs. In the ring each
step's forward records FlexAttention's autograd graph of its block but keeps
none of the tensors that graph saves (``saved_tensors_hooks``): q, the K/V
block, the block's out and lse are dropped as they are saved, and the
backward supplies them again, with the MERGED out and lse of all blocks in
place of the block's. FlexAttention's backward with the merged softmax
statistics gives the block's exact share of dQ, dK, dV (P = exp(S - L) and
delta = rowsum(dO * O) - dL over all keys, as a single-device backward uses
for each key block), so no forward is recomputed and no cotangent pass runs;
the graph holds only the block mask's tensors and small buffers, and the K/V
block comes back round the ring as in every ring backward. (Keeping each
step's graph with its tensors would keep every visiting K/V block: memory
O(seqlen) instead of O(seqlen / ranks).)

Local compute: FlexAttention's operator (what the public
``torch.nn.attention.flex_attention`` calls), compiled by inductor on CUDA
(its Triton backend, pinned: the FLASH backend has no lse gradient), in eager
mode elsewhere with the same autograd (dense scores per step: small shapes
only). lse is the natural log, as every longattn op returns.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import types
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch._higher_order_ops.flex_attention import flex_attention as _flex_hop
from torch.autograd.graph import get_gradient_edge
from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

from .. import backends as bk
from .._merge import empty_state
from .._validation import check_flag, check_qkv, check_scale
from ..distributed import checks
from ..distributed import flex_plan as fp
from ..distributed.layout import check_layout
from ..distributed.plan import Call
from ..distributed.ring import BackendOp, RingSchedule, ring_backward, ring_forward
from ..distributed.transport import ring_transport

__all__ = ["flex_attention", "ring_flex_attention", "FlexStep", "StepGraph", "ring_schedule"]

LN2 = math.log(2.0)
_OPTIONS = {"BACKEND": "TRITON"}  # the kernel with an lse gradient (the FLASH backend has none)


# ------------------------------------------------------------------ the local op
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


# ------------------------------------------------------------------ plans (cached)
class _LRU(collections.OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        val = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return val


_PLANS = _LRU(64)
"""Block masks and executors per (shape, pattern, rank): a training loop builds them once."""


def _key(fn):
    """A mask or score function as a cache key: its pattern_key (longattn.masks), else itself."""
    return None if fn is None else getattr(fn, "pattern_key", None) or fn


def _signature(fn) -> str:
    """What ranks compare: the pattern key, or the function's qualified name."""
    if fn is None:
        return "none"
    key = getattr(fn, "pattern_key", None)
    return repr(key) if key is not None else getattr(fn, "__qualname__", type(fn).__name__)


def _make_step(table, mask_mod, score_mod, scale, qmap, kmap, q, k) -> FlexStep:
    return FlexStep(fp.block_mask(table, mask_mod, qmap, kmap, (q.shape[1], k.shape[1])),
                    fp.localize_score(score_mod, qmap, kmap), scale, compile_backend(q.device),
                    (_key(mask_mod), _key(score_mod)))


def _single_step(q, k, mask_mod, score_mod, scale) -> Optional[FlexStep]:
    def make():
        qpos = torch.arange(q.shape[1], dtype=torch.int32, device=q.device)
        kpos = torch.arange(k.shape[1], dtype=torch.int32, device=q.device)
        table = fp.block_table(mask_mod, q.shape[0], q.shape[2], qpos, kpos)
        if table.empty:
            return None
        ident = fp.position_map("contiguous", 0, 1, q.shape[1], q.device)  # local index = global position
        kmap = fp.position_map("contiguous", 0, 1, k.shape[1], k.device)
        return _make_step(table, mask_mod, score_mod, scale, ident, kmap, q, k)
    key = ("single", _key(mask_mod), _key(score_mod), scale, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device))
    return _PLANS.get_or(key, make)


def _gather_steps(group, need: int, failed: bool) -> tuple[int, list[int]]:
    """Every rank's (steps needed, planning failed): the ring's step count and the failed ranks."""
    t = torch.tensor([need, int(failed)], dtype=torch.int64, device=checks._device_for(group))
    got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, t, group=group)
    return max(int(x[0]) for x in got), [r for r, x in enumerate(got) if int(x[1])]


def _ring_plan(q, k, mask_mod, score_mod, scale, layout, group) -> RingSchedule:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    b, length, h, _ = q.shape

    def make():
        err = None
        try:
            tables = fp.rank_tables(mask_mod, layout, rank, world, length, b, h, device=q.device)
            need = fp.steps_needed(tables)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            err, need = e, 0
        steps, failed = _gather_steps(group, need, err is not None)
        if err is not None:
            raise err
        if failed:
            raise ValueError(f"ring_flex_attention: mask_mod failed on ranks {failed} (see their errors); "
                             f"every rank raises")
        qmap = fp.position_map(layout, rank, world, length, q.device)
        calls = []
        for s in range(steps):
            if tables[s].empty:  # nothing visible: no compute at this step (the block still passes on)
                calls.append(())
                continue
            kmap = fp.position_map(layout, (rank - s) % world, world, length, q.device)
            step = _make_step(tables[s], mask_mod, score_mod, scale, qmap, kmap, q, k)
            calls.append((Call(0, length, 0, length, bk.BlockSpec(scale), run=step),))
        return RingSchedule(steps, lambda src: calls[(rank - src) % world])
    key = ("ring", _key(mask_mod), _key(score_mod), scale, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device),
           layout, checks.group_name(group))
    return _PLANS.get_or(key, make)


# ------------------------------------------------------------------ autograd
class _NoKeys(torch.autograd.Function):
    """The result where no query sees any key: output 0, lse -inf, zero gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.like = [(x.shape, x.dtype, x.device) for x in (q, k, v)]
        return empty_state(q, q.dtype)

    @staticmethod
    def backward(ctx, dout, dlse):
        return tuple(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.like)


_OP = BackendOp()  # every call of a flex ring carries its executor (Call.run)


class _RecordingOp(BackendOp):
    """The local op of one flex ring call that a backward will follow: each
    step's forward keeps its FlexAttention graph (without tensors,
    :meth:`FlexStep.record`) and the backward runs it."""

    def __init__(self):
        super().__init__()
        self.graphs: dict = {}

    def forward(self, c: Call, q, k, v):
        out, lse, self.graphs[c.run] = c.run.record(q, k, v)
        return out, lse

    def backward(self, c: Call, dout, q, k, v, out, lse, dlse):
        return c.run.backward(dout, q, k, v, out, lse, dlse, self.graphs[c.run])


class _RingFlex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, schedule, group, grad: bool):
        ctx.set_materialize_grads(False)
        op = _RecordingOp() if grad else _OP
        # keep_last: the block the backward starts on, kept only where a backward will run
        out, lse, kv_last = ring_forward(q, k, v, schedule, op, ring_transport(group), keep_last=grad)
        ctx.save_for_backward(q, k, v, out, lse, *(kv_last or ()))
        ctx.schedule, ctx.group, ctx.op = schedule, group, op
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *last = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, dlse, ctx.schedule, ctx.op, ring_transport(ctx.group),
                                   tuple(last) or None)
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------ public functions
def _check_mods(mask_mod, score_mod) -> None:
    for fn, name in ((mask_mod, "mask_mod"), (score_mod, "score_mod")):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function {name}(...) (FlexAttention's signature) or None, "
                            f"got {type(fn).__name__}")
    for cell in getattr(score_mod, "__closure__", None) or ():
        try:
            val = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(val, torch.Tensor) and val.requires_grad:
            raise ValueError("score_mod captures a tensor that requires grad; these ops give no gradient to "
                             "score_mod's tensors: detach it (or use torch's flex_attention on one device)")


def _check_common(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen: bool) -> float:
    check_qkv(q, k, v, same_seqlen=same_seqlen)
    _check_mods(mask_mod, score_mod)
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    if q.is_cuda and min(q.shape[-1], v.shape[-1]) < 16:  # Inductor's flex kernels refuse it at compile time
        raise ValueError(f"flex attention on CUDA needs head dims >= 16, got q/k {q.shape[-1]} and v {v.shape[-1]}: "
                         "pad them with zeros to 16 (pass softmax_scale=1/sqrt(original head dim)) and slice the "
                         "output, or run on CPU")
    return bk.default_scale(q.shape[-1], softmax_scale)


@torch.compiler.disable
def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_mod: Optional[Callable] = None,
                   score_mod: Optional[Callable] = None, softmax_scale: Optional[float] = None,
                   return_lse: bool = False):
    """Attention with any pattern: PyTorch's FlexAttention in longattn's layout.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)`` (GQA/MQA from the head counts).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: visible), e.g.
            from :mod:`longattn.masks`; None: every key.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to
            the scaled score before the softmax (a bias, a soft cap); None: none.
            Tensors it captures get no gradient.
        softmax_scale: default ``headdim ** -0.5``.
        return_lse: also return lse ``(batch, nheads, seqlen_q)`` float32 (natural log).

    Returns:
        out ``(batch, seqlen_q, nheads, headdim)``; rows that see no key hold 0
        (and lse -inf).

    Equivalent PyTorch (``mask``, ``bias`` the functions evaluated on every (b, h, i, j))::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k_expanded) * scale + bias
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v_expanded)

    On CUDA FlexAttention is compiled (once per shape and pattern; block masks
    cached per pattern, see :mod:`longattn.masks`); elsewhere torch's eager
    FlexAttention runs (dense scores: small shapes). Runs outside ``torch.compile``
    graphs (a graph break).
    """
    scale = _check_common(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen=False)
    step = _single_step(q, k, mask_mod, score_mod, scale)
    out, lse = _NoKeys.apply(q, k, v) if step is None else step.attend(q, k, v)  # FlexAttention's autograd
    return (out, lse) if return_lse else out


def ring_schedule(q, k, *, mask_mod=None, score_mod=None, layout: str = "zigzag", scale: float, group=None
                  ) -> RingSchedule:
    """The ring schedule ``ring_flex_attention`` runs (cached): ``steps`` (the
    same on every rank) and ``calls(src)``, one call with its :class:`FlexStep`
    or none where the step is empty. A collective on first use of a pattern."""
    return _ring_plan(q, k, mask_mod, score_mod, scale, layout, checks.resolve_group(group))


@torch.compiler.disable
def ring_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_mod: Optional[Callable] = None,
                        score_mod: Optional[Callable] = None, layout: str = "zigzag",
                        softmax_scale: Optional[float] = None, return_lse: bool = False, group=None):
    """Attention with any pattern over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)`` (see
            :func:`longattn.shard`); k, v: ``(batch, seqlen_local, nheads_kv, headdim)``.
        mask_mod, score_mod: as :func:`flex_attention`, on GLOBAL positions of
            the unsharded sequence (the same functions as on one device).
        layout: ``"zigzag"`` (rank r holds chunks r and 2p-1-r of 2p: balanced
            work for causal-like patterns) or ``"contiguous"``.
        softmax_scale, return_lse: as :func:`flex_attention`.
        group: a ProcessGroup (default WORLD).

    Returns:
        This rank's shard of the output (and lse). ``unshard(out)`` equals
        :func:`flex_attention` on the unsharded q, k, v.

    Each step attends to the visiting K/V block under the block mask of
    (local queries x that block) in global positions: empty blocks are
    skipped, a step with no visible key is not computed, and the ring ends
    after the last step any rank needs (a sliding window or documents that
    stay within a shard end it early). Block masks are built on the first call
    per (shape, pattern) and cached (one small collective then).

    Runs outside ``torch.compile`` graphs (a graph break); its local steps are compiled on CUDA.

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.flex_attention(full(q), full(k), full(v), mask_mod=mask_mod,
                                                     score_mod=score_mod), layout=layout)
    """
    scale = _check_common(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen=True)
    check_layout(layout)
    g = checks.resolve_group(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    checks.check_consistent(g, "ring_flex_attention", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                            layout=layout, scale=scale, mask=_signature(mask_mod), score=_signature(score_mod))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out, lse = _RingFlex.apply(q, k, v, _ring_plan(q, k, mask_mod, score_mod, scale, layout, g), g, grad)
    return (out, lse) if return_lse else out
