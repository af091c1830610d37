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


@functools.lru_cache(maxsize=64)
def num_steps_varlen(cu: tuple, layout: str, world: int, causal: bool, window: tuple) -> int:
    last = 0
    for s in range(world):
        if any(plan_varlen(cu, layout, world, r, (r - s) % world, causal, window, 1.0) for r in range(world)):
            last = s
    return last + 1


def _run(cu_seqlens, layout, causal, window, scale, group_name):
    g = _comm.group_from_name(group_name)
    comm = _comm.P2P(g)
    cu = tuple(int(v) for v in cu_seqlens.tolist())
    steps = num_steps_varlen(cu, layout, comm.size, causal, window)
    plan_fn = lambda src: plan_varlen(cu, layout, comm.size, comm.rank, src, causal, window, scale)
    return comm, plan_fn, steps


@torch.library.custom_op("longattn::ring_varlen_fwd", mutates_args=(), device_types=None)
def _ring_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    comm, plan_fn, steps = _run(cu_seqlens, layout, causal, (window_left, window_right), scale, group_name)
    out, lse = ring_forward(q[None], k[None], v[None], comm, plan_fn, steps, backend)
    return out[0], lse[0]


@_ring_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, scale, causal, window_left, window_right, layout, group_name, backend):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("longattn::ring_varlen_bwd", mutates_args=(), device_types=None)
def _ring_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, scale: float,
                     causal: bool, window_left: int, window_right: int, layout: str, group_name: str, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    comm, plan_fn, steps = _run(cu_seqlens, layout, causal, (window_left, window_right), scale, group_name)
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
