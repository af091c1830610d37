"""``ulysses_attention`` and ``ulysses_attention_varlen``: head parallelism
by all-to-all (DeepSpeed-Ulysses) over the ranks of a group; the algorithm,
the GQA head plan and the pipelined schedule are in
:mod:`longattn.distributed.ulysses`.

No custom op of its own: the exchanges are PyTorch's functional collectives
(traced by ``torch.compile``) inside one autograd Function whose backward is
the transposed exchanges around the local backward; the local attention is
the ``attention`` / ``attention_varlen`` op's kernel pair, called on each
group of heads.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .. import tuning as _tuning
from .._autograd import direct
from .._sinks import apply_sinks, sinks_meta
from .._validation import check_chunk_size, check_attention_call, check_cu_seqlens, check_softcap_sinks
from ..backends import varlen as _varlen
from ..distributed import checks
from ..distributed import ulysses as U
from ..distributed.local import LocalOp
from ..distributed.layout import check_layout
from ..distributed.plan import chunk_cu, local_length
from .attention import _attention_bwd, _attention_fwd, attention
from .varlen import _kernel, _varlen_bwd, _varlen_fwd, attention_varlen

__all__ = ["ulysses_attention", "ulysses_attention_varlen"]


def check_call(q, k, v, causal, return_lse, softmax_scale, window_size, layout, backend, softcap, sinks, ndim=4):
    """The argument checks every Ulysses / hybrid entry point shares; returns
    (window, scale, backend resolved, softcap as a float, this rank's
    problem with softcap or sinks for the call's handshake)."""
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True, ndim=ndim)
    softcap, problem = checks.local_problem(check_softcap_sinks, softcap, sinks, q)
    check_layout(layout)
    return window, bk.default_scale(q.shape[-1], softmax_scale), bk.resolve(backend), softcap, problem


def with_sinks(res, sinks, return_lse: bool, varlen: bool = False):
    """A call's result ``(out, lse)`` with the sinks merged on this rank's
    rows (every head): ``out`` alone unless ``return_lse``."""
    out, lse = res
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, varlen=varlen)
    return (out, lse) if return_lse else out


def _run(op, tensors, *args):
    """A kernel custom op, or where nothing traces the call its function
    without the dispatcher (as :mod:`longattn._autograd` does)."""
    return (op._init_fn if direct(tensors) else op)(*args)


class _Dense(LocalOp):
    """``attention``'s kernels on one group of heads over the whole sequence."""

    def __init__(self, scale, causal, window, backend, softcap):
        self.args = (scale, causal, window[0], window[1], 0, backend, softcap)

    def forward(self, call, q, k, v):
        return _run(_attention_fwd, (q, k, v), q, k, v, *self.args)

    def backward(self, call, dout, q, k, v, out, lse, dlse):
        dlse = None if dlse is None else dlse.contiguous()
        return _run(_attention_bwd, (dout, q, k, v), dout.contiguous(), q, k, v, out, lse, dlse, *self.args)


class _Varlen(LocalOp):
    """``attention_varlen``'s kernels on one group of heads over every token.

    The exchange's rows are every rank's shard concatenated (p * L rows);
    ``layout`` "contiguous": the packed stream and its padding at the end (not
    sent back: ``send_rows``); "zigzag": ``rows`` gives each packed token's row.
    The per-document loop gets the bounds as a host tensor, so no call reads
    them back from the device."""

    def __init__(self, host_cu, dev_cu, cu, max_seqlen, kernel, scale, causal, window, softcap, backend, layout, rows,
                 world, rank, local_rows):
        self.total, self.layout, self.rows, self.padded = cu[-1], layout, rows, world * local_rows
        self.spec = bk.BlockSpec(scale, causal, window, 0, softcap)
        self.kernel, self.backend, self.max_seqlen = kernel, backend, max_seqlen
        self.host_cu, self.dev_cu = host_cu, dev_cu
        self.op_args = (max_seqlen, scale, causal, window[0], window[1], backend, kernel, softcap)
        if layout == "contiguous":
            self.send_rows = [max(0, min(local_rows, self.total - j * local_rows)) for j in range(world)]
            self.recv_rows = self.send_rows[rank]

    def _packed(self, x):  # (1, p*L, h, D) in the exchange's rows -> (T, h, D) packed
        return x[0, :self.total] if self.layout == "contiguous" else x[0].index_select(0, self.rows)

    def _scatter(self, y, fill, dim):  # the inverse of _packed, as (1, R, ...) to send back
        if self.layout == "contiguous":
            return y[None]
        shape = list(y.shape)
        shape[dim] = self.padded
        return y.new_full(shape, fill).index_copy_(dim, self.rows, y)[None]

    def forward(self, call, q, k, v):
        q, k, v = self._packed(q), self._packed(k), self._packed(v)
        if direct((q, k, v)):
            cu = self.host_cu if self.kernel == "loop" else self.dev_cu
            out, lse = _varlen.forward(self.kernel, q, k, v, cu, self.max_seqlen, self.spec, self.backend)
        else:
            out, lse = _varlen_fwd(q, k, v, self.dev_cu, *self.op_args)
        self._kept = (q, k, v, out, lse)
        return self._scatter(out, 0.0, 0), self._scatter(lse, float("-inf"), 1)

    def saved(self, q, k, v, out, lse) -> tuple:
        """The packed tensors of the forward just run (not the exchange's rows)."""
        kept, self._kept = self._kept, None
        return kept

    def backward(self, call, dout, q, k, v, out, lse, dlse):
        dout = self._packed(dout).contiguous()
        if dlse is not None:
            dlse = (dlse[0, :, :self.total] if self.layout == "contiguous" else dlse[0].index_select(1, self.rows))
            dlse = dlse.contiguous()
        if direct((dout, q, k, v)):
            cu = self.host_cu if self.kernel == "loop" else self.dev_cu
            grads = _varlen.backward(self.kernel, dout, q, k, v, out, lse, dlse, cu, self.max_seqlen, self.spec,
                                     self.backend)
        else:
            grads = _varlen_bwd(dout, q, k, v, out, lse, dlse, self.dev_cu, *self.op_args)
        del dout, dlse
        grads, res = list(grads), []
        for i in range(3):  # each packed gradient goes as soon as its rows are laid out for sending
            res.append(self._scatter(grads[i], 0.0, 0))
            grads[i] = None
        return tuple(res)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                      layout: str = "contiguous", return_lse: bool = False, softcap: float = 0.0,
                      sinks: Optional[torch.Tensor] = None, backend: str = "auto",
                      tuning: _tuning.UlyssesTuning = _tuning.ULYSSES, group=None):
    """Exact attention over a sequence sharded across the ranks of ``group``,
    by head parallelism: an all-to-all gives each rank the whole sequence for
    nheads/p heads, it attends locally, and an all-to-all returns the shards.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)``;
            ``nheads`` divisible by the group size p (else ValueError naming the
            sizes that fit; the hybrid :func:`context_parallel_attention` takes a
            Ulysses size that divides nheads with the ring over the rest).
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)``. GQA/MQA: a rank
            receives only the kv heads its query heads read (nheads_kv/p when p
            divides nheads_kv, else one or two, replicated on as many ranks as
            read them).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            global positions of the unsharded sequence.
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`longattn.shard`); the
            local attention always runs in sequence order, so any layout gives
            the same work; zigzag lets the same shards feed ``ring_attention``
            (and costs a copy per exchanged tensor that contiguous shards at
            batch 1 do not).
        return_lse: also return lse ``(batch, nheads, seqlen_local)`` float32, in
            the shard's row order.
        softcap: logit soft-capping, as :func:`longattn.attention` (the local
            attention's backend must apply it).
        sinks: ``(nheads,)``, as :func:`longattn.attention`: merged on this
            rank's shard after the exchange back (the lse travels with the
            output); each rank's gradient of ``sinks`` sums its rows, a partial
            gradient the group sums like any replicated parameter's
            (:func:`longattn.context_parallel.all_reduce_grads`).
        backend: local kernel (see :mod:`longattn.backends`).
        tuning: :class:`longattn.tuning.UlyssesTuning`: how many
            groups of heads the exchanges are pipelined over.
        group: a ProcessGroup, a 1-D DeviceMesh (e.g. ``mesh["ulysses"]``) or None (WORLD).

    Returns:
        This rank's shard of the output (and lse). Memory per rank: the whole
        sequence for nheads/p heads (the same bytes as the local shard of every head).

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.attention(full(q), full(k), full(v), causal=causal), layout=layout)
    """
    window, scale, backend, softcap, problem = check_call(q, k, v, causal, return_lse, softmax_scale, window_size,
                                                          layout, backend, softcap, sinks)
    g = checks.resolve_group(group)
    world = dist.get_world_size(g)
    U.check_heads(q.shape[2], world, "the group")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    heads = U.HeadPlan(q.shape[2], k.shape[2], world)
    b, s, _, d = q.shape
    chunks = tuning.chunks(heads, b * world * s)
    checks.consistent_call(g, "ulysses_attention", problem, q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                           causal=causal, window=window, layout=layout, scale=scale, backend=backend,
                           chunks=chunks, softcap=softcap, sinks=sinks_meta(sinks))
    if world == 1:
        return attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window, return_lse=return_lse,
                         softcap=softcap, sinks=sinks, backend=backend)
    ex = U.Exchange.of(g, heads, layout, chunks)
    if not torch.compiler.is_compiling():  # a forced backend that cannot run raises before any exchange
        a, e = heads.q_heads(ex.rank)
        idx = heads.local_kv_index(ex.rank)
        lo, hi = heads.kv_heads(ex.rank)
        wk = (hi - lo if idx is None else len(idx)) // chunks
        bk.select_backend(q[:, :1, :(e - a) // chunks].expand(b, world * s, -1, d),
                          k[:, :1, :wk].expand(b, world * s, -1, d), bk.BlockSpec(scale, causal, window, 0, softcap),
                          backend)
    res = U.ulysses(q, k, v, ex, _Dense(scale, causal, window, backend, softcap), return_lse or sinks is not None)
    return with_sinks(res, sinks, return_lse) if sinks is not None else res


def _host_cu(cu_seqlens) -> tuple[torch.Tensor, tuple]:
    """cu_seqlens on the host (the call's one device read when it lives on a GPU), checked, and as a tuple."""
    if not isinstance(cu_seqlens, torch.Tensor):
        check_cu_seqlens(cu_seqlens, 0)  # raises TypeError
    host = cu_seqlens.cpu()
    vals = host.tolist() if host.dim() == 1 and host.numel() else [0]
    check_cu_seqlens(host, vals[-1])
    return host, tuple(vals)


def ulysses_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                             layout: str = "contiguous", causal: bool = False, softmax_scale: Optional[float] = None,
                             window_size: tuple[int, int] = (-1, -1), return_lse: bool = False,
                             softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                             chunk_size: Optional[int] = None, backend: str = "auto",
                             tuning: _tuning.UlyssesTuning = _tuning.ULYSSES, group=None):
    """Packed documents over a token stream sharded across ranks, by head
    parallelism: after the all-to-all every rank holds every token for
    nheads/p heads and runs :func:`longattn.attention_varlen`'s kernel with the
    global ``cu_seqlens``: the same work on every rank whatever the document lengths.

    Args:
        q: this rank's tokens ``(total_tokens_local, nheads, headdim)`` as made by
            :func:`longattn.shard_varlen` with ``layout`` (padding rows included);
            k, v likewise with nheads_kv (GQA as :func:`ulysses_attention`).
        cu_seqlens: the *global* int32 cumulative document lengths (same on every
            rank). Read once per call on the host: a CPU tensor costs no device
            synchronisation; one on the GPU costs one, before any exchange.
        layout: ``"contiguous"`` (default: the packed stream cut into p parts,
            padded by at most p-1 tokens) or ``"zigzag"`` (every document padded
            to a multiple of 2p; the ring's packed layout, so its shards can be reused).
        causal, softmax_scale, window_size, return_lse, backend: as
            :func:`longattn.attention_varlen`.
        softcap, sinks: as :func:`ulysses_attention`.
        chunk_size: chunked attention, as :func:`longattn.ring_attention_varlen`
            (the local attention runs on the documents cut at the chunk edges).
        tuning: as :func:`ulysses_attention` (per-document kernel calls stay in
            one group of heads).
        group: a ProcessGroup, a 1-D DeviceMesh or None (WORLD).

    Every call checks across ranks (one small all-gather, not cached: the
    document lengths change from call to call) that every rank passed the same
    ``cu_seqlens``, shapes and flags, and raises on every rank if not.

    Returns:
        Local output ``(total_tokens_local, nheads, headdim)`` (and lse ``(nheads,
        total_tokens_local)``); padding rows hold 0 and lse -inf.
        ``unshard_varlen(out, cu_seqlens, layout=layout)`` equals ``attention_varlen``
        of the packed input.
    """
    window, scale, backend, softcap, problem = check_call(q, k, v, causal, return_lse, softmax_scale, window_size,
                                                          layout, backend, softcap, sinks, ndim=3)
    g = checks.resolve_group(group)
    world = dist.get_world_size(g)
    cu, chunk = None, None
    try:
        chunk = check_chunk_size(chunk_size)
        U.check_heads(q.shape[1], world, "the group")
        host, cu = _host_cu(cu_seqlens)
        want = local_length(cu, layout, world)
        if q.shape[0] != want:
            raise ValueError(f"q has {q.shape[0]} local tokens but cu_seqlens with layout={layout!r} over {world} "
                             f"ranks gives {want}; shard with longattn.shard_varlen(x, cu_seqlens, "
                             f"layout={layout!r})")
    except (ValueError, TypeError) as e:
        problem = problem or e
    if torch.compiler.is_compiling():
        if problem is not None:
            raise problem
    else:  # every call: the lengths are values, a cache keyed by them could let one rank skip the check
        checks.agree(g, "ulysses_attention_varlen", problem, q=tuple(q.shape), k=tuple(k.shape),
                     dtype=str(q.dtype), cu=cu, causal=causal, window=window, layout=layout, scale=scale,
                     backend=backend, tuning=tuning,  # the tuning sets the head groups: their collectives
                     softcap=softcap, sinks=sinks_meta(sinks), chunk=chunk)
    docs = chunk_cu(cu, chunk)  # the attention's documents; the tokens lie as cu_seqlens sharded them
    if docs != cu:
        host = cu_seqlens = torch.tensor(docs, dtype=torch.int32, device="cpu")
    if world == 1:
        return attention_varlen(q, k, v, cu_seqlens, causal=causal, softmax_scale=scale, window_size=window,
                                return_lse=return_lse, softcap=softcap, sinks=sinks, backend=backend)
    heads = U.HeadPlan(q.shape[1], k.shape[1], world)
    total, ndocs, d = cu[-1], len(docs) - 1, q.shape[-1]
    a, e = heads.q_heads(dist.get_rank(g))
    kernel = _kernel(q[:1, :e - a].expand(total, -1, d), backend, ndocs, softcap)
    chunks = tuning.chunks(heads, total // max(ndocs, 1) if kernel == "loop" else total)
    ex = U.Exchange.of(g, heads, "contiguous", chunks)
    dev_cu = cu_seqlens
    if cu_seqlens.device != q.device:  # a fresh pageable tensor: staged at once, no wait for the device
        dev_cu = torch.tensor(docs, dtype=torch.int32, device="cpu").to(q.device, non_blocking=True)
    rows = None if layout == "contiguous" else U.packed_rows(cu, layout, world, q.device)
    max_seqlen = max((y - x for x, y in zip(docs, docs[1:])), default=0)
    local = _Varlen(host, dev_cu, cu, max_seqlen, kernel, scale, causal, window, softcap, backend, layout, rows, world,
                    ex.rank, q.shape[0])
    res = U.ulysses(q[None], k[None], v[None], ex, local, return_lse or sinks is not None)
    # squeeze, not [0]: select's backward would zero-fill a buffer and copy the gradient in
    if sinks is not None:
        return with_sinks((res[0].squeeze(0), res[1].squeeze(0)), sinks, return_lse, varlen=True)
    return (res[0].squeeze(0), res[1].squeeze(0)) if return_lse else res.squeeze(0)
