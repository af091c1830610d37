"""Packed variable-length documents across ranks: ``ring_attention_varlen``.

Layouts of the packed stream (``cu_seqlens`` global, int32):

* ``"zigzag"``: every document is padded to a multiple of 2p and cut into 2p
  chunks; rank r holds chunks r and 2p-1-r of every document (balanced
  causal work per document). Padding is never a key and its query rows are
  dropped by ``unshard_varlen``.
* ``"contiguous"``: the packed stream (padded at the end to a multiple of p)
  cut into p equal parts; documents may straddle ranks.

The ring is the one of :mod:`longattn.distributed.ring`; only the planner
differs: at each step a rank attends, document by document, to the part of
the visiting K/V block that lies in the same document (with the causal or
window mask in document positions). Steps where no rank holds such a pair
are not run; pairs outside a document are never computed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .._ops import register_attention_autograd
from .._validation import check_flag, check_qkv, check_scale, check_window
from ..varlen import check_cu_seqlens
from . import _comm
from .layout import check_layout
from .ring import FULL, NONE, Call, classify, ring_backward, ring_forward


def _lens(cu) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


@functools.lru_cache(maxsize=64)
def _pieces(cu: tuple, layout: str, world: int, rank: int) -> tuple:
    """This rank's pieces: (doc, doc position start, local start, length incl. padding, valid length)."""
    out = []
    if layout == "zigzag":
        local = 0
        for d, n in enumerate(_lens(cu)):
            c = -(-n // (2 * world)) if n else 0
            for j in (rank, 2 * world - 1 - rank):
                g = j * c
                out.append((d, g, local, c, max(0, min(c, n - g))))
                local += c
        return tuple(out), local
    total = cu[-1]
    length = -(-total // world)
    lo, hi = rank * length, (rank + 1) * length
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        s, e = max(a, lo), min(b, hi)
        if e > s:
            out.append((d, s - a, s - lo, e - s, e - s))
    return tuple(out), length


def local_length(cu, layout: str, world: int) -> int:
    return _pieces(tuple(int(x) for x in cu), layout, world, 0)[1]


def _index(cu: tuple, layout: str, world: int, rank: int) -> torch.Tensor:
    """Global packed index of each local token, -1 for padding."""
    pieces, length = _pieces(cu, layout, world, rank)
    idx = torch.full((length,), -1, dtype=torch.long)
    for d, g, l0, n, valid in pieces:
        idx[l0:l0 + valid] = cu[d] + g + torch.arange(valid)
    return idx


@dataclasses.dataclass(frozen=True)
class VarlenShard:
    """Metadata of a rank's varlen shard."""

    layout: str
    world: int
    rank: int
    local_tokens: int
    global_index: torch.Tensor
    """(local_tokens,) int64: global packed position of each local token, -1 for padding."""
    position_ids: torch.Tensor
    """(local_tokens,) int64: position of each local token inside its document (0 for padding), for RoPE."""

    @property
    def valid(self) -> torch.Tensor:
        return self.global_index >= 0


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str = "zigzag", group=None):
    """This rank's tokens of a packed tensor ``x`` (total_tokens, ...) present on
    every rank, and their :class:`VarlenShard` metadata."""
    check_layout(layout)
    check_cu_seqlens(cu_seqlens, x.shape[0])
    g = _comm.resolve_group(group)
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    idx = _index(cu, layout, world, rank)
    pos = torch.zeros_like(idx)
    starts = torch.tensor(cu[:-1])
    valid = idx >= 0
    doc = torch.searchsorted(torch.tensor(cu), idx[valid], right=True) - 1
    pos[valid] = idx[valid] - starts[doc]
    local = x.new_zeros((idx.numel(), *x.shape[1:]))
    local[valid.to(x.device)] = x[idx[valid].to(x.device)]
    return local, VarlenShard(layout, world, rank, idx.numel(), idx, pos)


class _GatherVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cu, layout):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        out = x.new_zeros((cu[-1], *x.shape[1:]))
        ctx.idx = []
        for r, p in enumerate(parts):
            idx = _index(cu, layout, world, r).to(x.device)
            keep = idx >= 0
            out[idx[keep]] = p[keep]
            ctx.idx.append(idx)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        idx = ctx.idx[dist.get_rank(ctx.group)]
        keep = idx >= 0
        out = grad.new_zeros((idx.numel(), *grad.shape[1:]))
        out[keep] = grad[idx[keep]]
        return out, None, None, None


def unshard_varlen(x_local: torch.Tensor, cu_seqlens: torch.Tensor, *, layout: str = "zigzag", group=None):
    """The packed (total_tokens, ...) tensor from every rank's shard, padding
    dropped (differentiable: a shard's gradient is the sum over ranks)."""
    check_layout(layout)
    g = _comm.resolve_group(group)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    return _GatherVarlen.apply(x_local, g, cu, layout)


@functools.lru_cache(maxsize=256)
def plan_varlen(cu: tuple, layout: str, world: int, rank: int, src: int, causal: bool, window: tuple,
                scale: float) -> tuple:
    """Dense calls of ``rank`` on the K/V block of ``src``: same-document pairs only."""
    qp, _ = _pieces(cu, layout, world, rank)
    kp, _ = _pieces(cu, layout, world, src)
    by_doc = {}
    for piece in kp:
        by_doc.setdefault(piece[0], []).append(piece)
    calls = []
    for d, qg, q0, _, qn in qp:
        if qn == 0:
            continue
        for _, kg, k0, _, kn in by_doc.get(d, ()):
            if kn == 0:
                continue
            kind = classify(qg, qn, kg, kn, causal, window)
            if kind == NONE:
                continue
            spec = bk.BlockSpec(scale) if kind == FULL else bk.BlockSpec(scale, causal, tuple(window), qg - kg)
            calls.append(Call(q0, q0 + qn, k0, k0 + kn, spec))
    return tuple(calls)


class FusedVarlenStep:
    """The document blocks of one ring step as one flash-varlen launch per mask
    kind (full, causal), instead of one backend call (and merge) per block.

    Each segment is a range of local query rows with the key rows it sees in
    the visiting block, gathered by index (a query piece that sees two key
    pieces sees their concatenation, its causal part bottom-right aligned as
    FlashAttention-2 does). Rows in no segment get output 0 and lse -inf.
    """

    def __init__(self, calls, segs, scale: float, device):
        self.calls, self.scale = calls, scale
        self.launches = []
        for causal in (False, True):
            mine = [sg for sg in segs if sg[2] == causal]
            if not mine:
                continue
            q_idx = torch.cat([torch.arange(q0, q1) for (q0, q1), _, _ in mine])
            k_idx = torch.cat([torch.cat([torch.arange(a, b) for a, b in ks]) for _, ks, _ in mine])
            lq = [q1 - q0 for (q0, q1), _, _ in mine]
            lk = [sum(b - a for a, b in ks) for _, ks, _ in mine]
            cu = lambda ls: torch.tensor([0] + ls, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
            self.launches.append((q_idx.to(device), k_idx.to(device), cu(lq), cu(lk), max(lq), max(lk), causal))

    def forward(self, q, k, v):
        _, l, h, _ = q.shape
        out = torch.zeros_like(q)
        lse = torch.full((1, h, l), float("-inf"), dtype=torch.float32, device=q.device)
        for q_idx, k_idx, cu_q, cu_k, mq, mk, causal in self.launches:
            o, ls = self._kernel_fwd(q[0].index_select(0, q_idx), k[0].index_select(0, k_idx),
                                     v[0].index_select(0, k_idx), cu_q, cu_k, mq, mk, causal)
            out[0].index_copy_(0, q_idx, o)
            lse[0].index_copy_(1, q_idx, ls)
        return out, lse

    def _kernel_fwd(self, q, k, v, cu_q, cu_k, mq, mk, causal):
        """FlashAttention-2 varlen: (total_q, H, D) -> out, lse (H, total_q) with -inf for dead rows."""
        o, ls, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, mq, mk, 0.0, causal, False, scale=self.scale, window_size_left=-1,
            window_size_right=0 if causal else -1)
        return o, bk._pos_inf_rows_to_dead(ls.float())

    def _kernel_bwd(self, do, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal):
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            do, q, k, v, o, bk._dead_rows_to_pos_inf(lse).contiguous(), cu_q, cu_k, mq, mk, 0.0, causal, rng,
            torch.empty(0, device=q.device), scale=self.scale, window_size_left=-1,
            window_size_right=0 if causal else -1)

    def backward(self, dout, q, k, v, out, lse, dlse):
        if dlse is not None:  # FlashAttention-2 has no lse gradient: the ring runs self.calls one by one
            return None
        dq = torch.zeros_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for q_idx, k_idx, cu_q, cu_k, mq, mk, causal in self.launches:
            sel = lambda t: t[0].index_select(0, q_idx)
            g_q, g_k, g_v = self._kernel_bwd(sel(dout), sel(q), k[0].index_select(0, k_idx),
                                             v[0].index_select(0, k_idx), sel(out), lse[0].index_select(1, q_idx),
                                             cu_q, cu_k, mq, mk, causal)
            dq[0].index_copy_(0, q_idx, g_q)
            dk[0].index_add_(0, k_idx, g_k.float())  # a key row may serve two segments: add
            dv[0].index_add_(0, k_idx, g_v.float())
        return dq, dk, dv


def fuse_segments(calls) -> Optional[list]:
    """Group a step's calls into segments ((q0, q1), [(k0, k1), ...], causal) one
    flash-varlen launch can run, or None when some block's mask does not fit
    (windows, a causal block that is not bottom-right over its keys)."""
    groups: dict = {}
    for c in calls:
        groups.setdefault((c.q0, c.q1), []).append(c)
    segs, last = [], -1
    for (q0, q1), cs in sorted(groups.items()):
        if q0 < last:
            return None  # overlapping query ranges would write the same rows twice
        last = q1
        if any(c.spec.has_window for c in cs):
            return None
        full = [c for c in cs if not c.spec.causal]
        masked = [c for c in cs if c.spec.causal]
        ks = [(c.k0, c.k1) for c in full + masked]  # the masked block last: its mask is the bottom-right one
        klen = sum(b - a for a, b in ks)
        if len(masked) > 1:
            return None
        if masked:
            m = masked[0]
            if m.spec.q_offset < 0 or m.spec.q_offset + (klen - (m.k1 - m.k0)) != klen - (q1 - q0):
                return None
        segs.append(((q0, q1), ks, bool(masked)))
    return segs


# Cost model of one ring step, from H200 measurements (docs/performance.md):
# a backend call costs ~0.2 ms of host time (dispatch + merge) and runs near
# cuDNN's ~500 TF/s; one FlashAttention-2 varlen launch runs these blocks at
# ~260 TF/s. Many short documents: fuse; a few long ones: one cuDNN call each.
_CALL_S, _CALL_FLOPS, _FUSED_FLOPS = 2e-4, 500e12, 260e12


def _worth_fusing(calls, heads_x_dim: int) -> bool:
    flops = [4.0 * heads_x_dim * (c.q1 - c.q0) * (c.k1 - c.k0) * (0.5 if c.spec.causal else 1.0) for c in calls]
    t_calls = sum(max(_CALL_S, f / _CALL_FLOPS) for f in flops)
    t_fused = 2 * _CALL_S + sum(flops) / _FUSED_FLOPS
    return t_fused < t_calls


@functools.lru_cache(maxsize=256)
def _fused_call(cu: tuple, layout: str, world: int, rank: int, src: int, causal: bool, window: tuple, scale: float,
                device: str, heads_x_dim: int) -> Optional[tuple]:
    calls = plan_varlen(cu, layout, world, rank, src, causal, window, scale)
    if len(calls) < 2 or not _worth_fusing(calls, heads_x_dim):
        return None
    segs = fuse_segments(calls)
    if segs is None:
        return None
    length = local_length(cu, layout, world)
    step = FusedVarlenStep(calls, segs, scale, torch.device(device))
    return (Call(0, length, 0, length, bk.BlockSpec(scale), run=step),)


def _fusable(q: torch.Tensor, k: torch.Tensor, window: tuple, backend: str) -> bool:
    """One flash-varlen launch per step: CUDA (sm80+), fp16/bf16, head dim % 8 == 0 and <= 256,
    no window, and the backend left to ``auto`` (or ``flash``)."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and window == (-1, -1) and backend in ("auto", "flash")
            and bk._forced() in (None, "flash") and torch.cuda.get_device_capability(q.device) >= (8, 0))


@functools.lru_cache(maxsize=64)
def num_steps_varlen(cu: tuple, layout: str, world: int, causal: bool, window: tuple) -> int:
    last = 0
    for s in range(world):
        if any(plan_varlen(cu, layout, world, r, (r - s) % world, causal, window, 1.0) for r in range(world)):
            last = s
    return last + 1


def _run(cu_seqlens, layout, causal, window, scale, group_name, fused: bool, q):
    g = _comm.group_from_name(group_name)
    comm = _comm.exchange(g)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    steps = num_steps_varlen(cu, layout, comm.size, causal, window)

    def plan_fn(src):
        one = fused and _fused_call(cu, layout, comm.size, comm.rank, src, causal, window, scale, str(q.device),
                                    q.shape[1] * q.shape[2])
        return one or plan_varlen(cu, layout, comm.size, comm.rank, src, causal, window, scale)
    return comm, plan_fn, steps


@torch.library.custom_op("longattn::ring_varlen_fwd", mutates_args=(), device_types=None)
def _ring_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    comm, plan_fn, steps = _run(cu_seqlens, layout, causal, window, scale, group_name,
                                _fusable(q, k, window, backend), q)
    out, lse, _ = ring_forward(q[None], k[None], v[None], comm, plan_fn, steps, backend)
    return out[0], lse[0]


@_ring_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, scale, causal, window_left, window_right, layout, group_name, backend):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longattn::ring_varlen_bwd", mutates_args=(), device_types=None)
def _ring_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    comm, plan_fn, steps = _run(cu_seqlens, layout, causal, window, scale, group_name,
                                _fusable(q, k, window, backend), q)
    dq, dk, dv = ring_backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                               None if dlse is None else dlse[None], comm, plan_fn, steps, backend)
    return dq[0], dk[0], dv[0]


@_ring_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, scale, causal, window_left, window_right, layout, group_name,
      backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_ring_varlen_fwd, _ring_varlen_bwd,
                            ("scale", "causal", "window_left", "window_right", "layout", "group_name", "backend"),
                            extra_tensors=1)


def ring_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                          layout: str = "zigzag", causal: bool = False, softmax_scale: Optional[float] = None,
                          window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, backend: str = "auto",
                          group=None):
    """Packed-document attention over a token stream sharded across ranks.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`shard_varlen` (padding rows included); k, v likewise with nheads_kv.
        cu_seqlens: the *global* int32 cumulative document lengths (same on every rank).
        layout: ``"zigzag"`` (per document) or ``"contiguous"`` (see module docstring).
        causal, softmax_scale, window_size, return_lse, backend: as :func:`longattn.attention_varlen`.
        group: ProcessGroup (default WORLD).

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf.
        ``unshard_varlen(out, cu_seqlens)`` equals ``attention_varlen`` of the packed input.
    """
    check_qkv(q, k, v, same_seqlen=True, ndim=3)
    check_layout(layout)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    window = check_window(window_size)
    bk.check_backend_name(backend)
    g = _comm.resolve_group(group)
    check_cu_seqlens(cu_seqlens, int(cu_seqlens[-1]))
    want = local_length(cu_seqlens.tolist(), layout, dist.get_world_size(g))
    if q.shape[0] != want:
        raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over "
                         f"{dist.get_world_size(g)} ranks gives {want}; shard with longattn.shard_varlen")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if not torch.compiler.is_compiling():
        _comm.check_consistent(g, "ring_attention_varlen", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                               cu=tuple(cu_seqlens.tolist()), causal=causal, window=window, layout=layout,
                               scale=scale, backend=backend)
    out, lse = _ring_varlen_fwd(q, k, v, cu_seqlens.cpu(), scale, causal, window[0], window[1], layout,
                                _comm.group_name(g), backend)
    return (out, lse) if return_lse else out
