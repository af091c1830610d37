"""``packed_attention``: packed documents across ranks under document-aware
sharding (:func:`longattn.shard_documents`).

A rank runs the documents it holds whole in one ``attention_varlen`` launch
(no communication). The documents the plan split (too long or too much work
for one rank) are the only ones whose K/V travel: one all-gather of every
rank's split pieces, started before the local launch so that the two overlap;
then each local piece of a split document attends to the keys of its document
it can see (causal: the document's prefix up to the piece's end; a window: the
keys in reach) in one dense block call with the piece's position offset.
Every query row finds all its keys on this rank, so nothing is merged.
Soft-capping runs in every block; a sink merges once into the finished rows;
chunked attention cuts the whole documents' boundaries and the split pieces
at the chunk edges (the plan stays that of the documents).

Bytes per rank, with ``s`` the largest rank's count of split-document tokens
(about their total over ``world``), ``b = 2 * nheads_kv * headdim`` K and V
elements per token: the forward receives ``(world - 1) * s * b`` elements in
the input dtype (an all-gather; the ring moves every token's K/V ``world - 1``
times instead); the backward gathers them again (instead of keeping the gathered
K/V from the forward: ``world * s * b`` elements of memory) and returns the K/V
gradients to their owners with a reduce-scatter of ``(world - 1) * s * b``
float32 elements (sums of partial gradients from every rank, kept in float32 as
the ring's accumulators are). With no split document nothing moves at all;
with one document split over every rank the forward's bytes equal the ring's,
but each rank holds the whole gathered K/V while it runs.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from .. import backends as bk
from .._autograd import register_attention_autograd, varlen_out_lse_like
from .._sinks import apply_sinks
from .._validation import check_attention_call, check_chunk_size, check_softcap_sinks
from ..backends import varlen as _varlen
from ..distributed import checks
from ..distributed.doc_shard import DocumentShard, plan_documents
from ..distributed.plan import chunk_cu

__all__ = ["packed_attention"]

# torch >= 2.12 names the tensor collectives *_single (the older names warn there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@functools.lru_cache(maxsize=64)
def _split_layout(plan: DocumentShard):
    """Where the split documents' tokens sit in the gathered buffer, and this
    rank's pieces of them.

    The buffer is every rank's ``(2, s, Hkv, D)`` block of split pieces (K then
    V, padded to ``s`` rows) concatenated: K of rank r's t-th split token is
    row ``r * 2s + t``, its V row ``r * 2s + s + t``. Returns (s, ``index``:
    buffer K rows of the split documents concatenated in document order, the
    local pieces: (local rows a, b, document, first position, length, the
    document's first row in that concatenation))."""
    s = max(plan.split_tokens)
    where = {}  # a piece (document, first position, length) -> buffer K row of its first token
    for r, runs in enumerate(plan.runs):
        at = 0
        for d, p0, n in runs:
            if d in plan.split:
                where[(d, p0, n)] = r * 2 * s + at
                at += n
    index, doc_start, calls = [], {}, []
    for d in plan.split:
        doc_start[d] = sum(len(x) for x in index)
        for piece in sorted((x for rr in plan.runs for x in rr if x[0] == d), key=lambda x: x[1]):
            index.append(torch.arange(piece[2], device="cpu") + where[piece])
    at = plan.whole_tokens
    for d, p0, n in plan.runs[plan.rank]:
        if d in plan.split:
            calls.append((at, at + n, d, p0, n, doc_start[d]))
            at += n
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long, device="cpu")
    return s, index, tuple(calls)


def _key_range(p0: int, n: int, length: int, causal: bool, window: tuple) -> tuple[int, int]:
    """Keys of a document (length ``length``) that its rows [p0, p0 + n) can see."""
    left, right = window
    lo = max(0, p0 - left) if left >= 0 else 0
    hi = p0 + n if causal else (min(length, p0 + n + right) if right >= 0 else length)
    return lo, hi


@functools.lru_cache(maxsize=256)
def _pieces(plan, causal, window, scale, softcap=0.0, chunk=0):
    """(local rows a, b; key rows k0, k1 of the gathered documents; the block's spec) per local split piece;
    with ``chunk`` each piece cut at the chunk edges (positions in its document), its keys those of its chunk."""
    s, index, calls = _split_layout(plan)
    out = []
    for a, b, d, p0, n, start in calls:
        length = plan.cu[d + 1] - plan.cu[d]
        r0 = p0
        while r0 < p0 + n:
            c0 = (r0 // chunk) * chunk if chunk else 0  # the chunk of row r0: keys [c0, c1)
            c1 = min(length, c0 + chunk) if chunk else length
            r1 = min(p0 + n, c1)
            lo, hi = _key_range(r0, r1 - r0, length, causal, window)
            lo, hi = max(lo, c0), min(hi, c1)
            ra = a + r0 - p0
            out.append((ra, ra + r1 - r0, start + lo, start + hi, bk.BlockSpec(scale, causal, window, r0 - lo,
                                                                                  softcap)))
            r0 = r1
    return s, index, out


def _gather_kv(k, v, plan, s, group):
    """Start the all-gather of every rank's split pieces of K and V: (buffer, work handle)."""
    a = plan.whole_tokens
    n = plan.split_tokens[plan.rank]
    send = k.new_zeros((2 * s, *k.shape[1:]))
    send[:n], send[s:s + n] = k[a:a + n], v[a:a + n]
    buf = k.new_empty((plan.world * 2 * s, *k.shape[1:]))
    return buf, _all_gather(buf, send, group=group, async_op=True)


@functools.lru_cache(maxsize=64)
def _on_device(plan: DocumentShard, device: torch.device, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gathered-buffer index, local cu_seqlens of the whole documents, cut at the chunk edges with ``chunk``,
    the longest of them) on ``device``, copied once per plan rather than at every pass."""
    cu = torch.tensor(chunk_cu(tuple(plan.cu_seqlens_local.tolist()), chunk), dtype=torch.int32, device="cpu")
    lens = cu[1:] - cu[:-1]
    return _split_layout(plan)[1].to(device), cu.to(device), int(lens.max()) if lens.numel() else 0


def _setup(cu_seqlens, imbalance, group_name, q, k, v, scale, causal, window, softcap, chunk):
    """(group, plan, s, buffer index, pieces, (whole rows, their cu_seqlens, longest, spec), the split pieces'
    K/V all-gather started (buffer, work) or None) of a pass."""
    g = checks.group_from_name(group_name)
    plan = plan_documents(tuple(int(x) for x in cu_seqlens.tolist()), dist.get_world_size(g), dist.get_rank(g),
                          imbalance)
    s, _, pieces = _pieces(plan, causal, window, scale, softcap, chunk)
    index, cu, longest = _on_device(plan, q.device, chunk)
    whole = (plan.whole_tokens, cu, longest, bk.BlockSpec(scale, causal, window, 0, softcap))
    return g, plan, s, index, pieces, whole, _gather_kv(k, v, plan, s, g) if s else None


@torch.library.custom_op("longattn::packed_cp_fwd", mutates_args=(), device_types=None)
def _packed_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, imbalance: float,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str, kernel: str,
                group_name: str, softcap: float = 0.0, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    g, plan, s, index, pieces, (w, cu, longest, spec), gather = _setup(cu_seqlens, imbalance, group_name, q, k, v,
                                                                        scale, causal, window, softcap, chunk)
    # one launch over every local row: the whole documents end at row w (cu's last entry), so the kernel leaves
    # the split pieces' and the padding's rows alone; writing those afterwards costs their rows only, where
    # running on q[:w] and copying into a zeroed output cost two passes over all of them
    if w:
        out, lse = _varlen.forward(kernel, q, k, v, cu, longest, spec, backend)
    else:  # no document held whole here: no launch
        out, lse = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    out[w:].zero_()
    lse[:, w:] = float("-inf")
    if s:
        buf, work = gather
        work.wait()
        kf, vf = buf.index_select(0, index), buf.index_select(0, index + s)
        dense = _varlen._dense_name(backend)
        for a, b, k0, k1, sp in pieces:
            o, l = bk.block_forward(q[None, a:b], kf[None, k0:k1], vf[None, k0:k1], sp, dense)
            out[a:b], lse[:, a:b] = o[0], l[0]
    return out, lse


@torch.library.custom_op("longattn::packed_cp_bwd", mutates_args=(), device_types=None)
def _packed_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens: torch.Tensor, imbalance: float,
                scale: float, causal: bool, window_left: int, window_right: int, backend: str, kernel: str,
                group_name: str, softcap: float = 0.0,
                chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    g, plan, s, index, pieces, (w, cu, longest, spec), gather = _setup(cu_seqlens, imbalance, group_name, q, k, v,
                                                                        scale, causal, window, softcap, chunk)
    # as the forward: one launch over every row, the rows past the whole documents written afterwards
    if w:
        dq, dk, dv = _varlen.backward(kernel, dout, q, k, v, out, lse, dlse, cu, longest, spec, backend)
    else:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for t in (dq, dk, dv):
        t[w:].zero_()
    if not s:
        return dq, dk, dv
    buf, work = gather
    work.wait()
    kf, vf = buf.index_select(0, index), buf.index_select(0, index + s)
    gk = torch.zeros(kf.shape, dtype=torch.float32, device=k.device)
    gv = torch.zeros_like(gk)
    dense = _varlen._dense_name(backend)
    for a, b, k0, k1, sp in pieces:
        rows = lambda t: t[None, a:b]
        g_q, g_k, g_v = bk.block_backward(rows(dout), rows(q), kf[None, k0:k1], vf[None, k0:k1], rows(out),
                                          lse[None, :, a:b].contiguous(), sp, dense,
                                          dlse=None if dlse is None else dlse[None, :, a:b].contiguous())
        dq[a:b] = g_q[0]
        gk[k0:k1] += g_k[0].float()
        gv[k0:k1] += g_v[0].float()
    grads = torch.zeros((plan.world * 2 * s, *k.shape[1:]), dtype=torch.float32, device=k.device)
    grads.index_copy_(0, index, gk)
    grads.index_copy_(0, index + s, gv)
    mine = grads.new_empty((2 * s, *k.shape[1:]))
    _reduce_scatter(mine, grads, group=g)
    a, n = plan.whole_tokens, plan.split_tokens[plan.rank]
    dk[a:a + n], dv[a:a + n] = mine[:n].to(dk.dtype), mine[s:s + n].to(dv.dtype)
    return dq, dk, dv


_packed = register_attention_autograd(_packed_fwd, _packed_bwd,
                                      ("imbalance", "scale", "causal", "window_left", "window_right", "backend",
                                       "kernel", "group_name", "softcap", "chunk"),
                                      extra_tensors=1, fwd_fake=varlen_out_lse_like)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: DocumentShard, *,
                     causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: tuple[int, int] = (-1, -1), return_lse: bool = False, softcap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None, backend: str = "auto",
                     group=None):
    """Packed-document attention over ranks holding documents whole where they fit.

    Args:
        q: this rank's tokens ``(plan.local_tokens, nheads, headdim)`` as made by
            ``plan.shard(x)`` (padding rows included); k, v likewise with nheads_kv.
        plan: this rank's :class:`~longattn.distributed.doc_shard.DocumentShard`
            (:func:`longattn.shard_documents`), the same problem on every rank.
        causal, softmax_scale, window_size, return_lse, softcap, sinks, backend:
            as :func:`longattn.attention_varlen` (positions inside each document;
            soft-capping in every block, a sink merged once into each row's
            finished result, its gradient this rank's rows' share, summed over
            the group like any replicated parameter's).
        chunk_size: chunked attention (Llama 4's ``attention_chunk_size``), as
            :func:`longattn.ring_attention_varlen` takes it: a token sees the
            keys of its document in the same chunk of positions. The plan stays
            that of the documents; None: whole documents.
        group: ProcessGroup of ``plan.world`` ranks (default WORLD).

    Returns:
        Local output ``(local_tokens, nheads, headdim)`` (and lse ``(nheads,
        local_tokens)`` float32); padding rows hold 0 and lse -inf (with
        ``sinks``: the sink's logit, as for any row that sees no key).

    Equivalent PyTorch (``x`` the packed tensors every rank could hold)::

        out = plan.shard(longattn.attention_varlen(q_full, k_full, v_full, cu_seqlens, causal=causal,
                                                   softcap=softcap, sinks=sinks))

    Every rank checks the call with the others (one small all-gather): a plan
    or shapes that differ across ranks raise on every rank.
    """
    window = check_attention_call(q, k, v, causal, return_lse, softmax_scale, window_size, same_seqlen=True, ndim=3)
    if not isinstance(plan, DocumentShard):
        raise TypeError(f"plan must be a DocumentShard from longattn.shard_documents, got {type(plan).__name__}")
    backend = bk.resolve(backend)
    g = checks.resolve_group(group)
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    problem, kernel, chunk = None, "loop", 0
    try:
        softcap = check_softcap_sinks(softcap, sinks, q)
        chunk = check_chunk_size(chunk_size)
        if (plan.world, plan.rank) != (dist.get_world_size(g), dist.get_rank(g)):
            raise ValueError(f"plan is rank {plan.rank} of {plan.world} but this is rank {dist.get_rank(g)} of "
                             f"{dist.get_world_size(g)} in group: shard_documents(cu_seqlens, group=group)")
        if q.shape[0] != plan.local_tokens:
            raise ValueError(f"q has {q.shape[0]} local tokens but the plan gives {plan.local_tokens}: shard q, k "
                             f"and v with plan.shard")
        kernel = _varlen.choose(q[:max(plan.whole_tokens, 1)], backend,
                                len(chunk_cu(tuple(plan.cu_seqlens_local.tolist()), chunk)) - 1, softcap=softcap)
        # each split piece is one dense block: a backend that refuses one raises here, on every rank, not inside
        # the op after the K/V all-gather (the backward selects alike: the choice is a function of these shapes)
        dense = _varlen._dense_name(backend)
        for a, b, k0, k1, sp in _pieces(plan, causal, window, scale, softcap, chunk)[2]:
            kv = k.new_empty((1, 1, *k.shape[1:])).expand(1, k1 - k0, *k.shape[1:])
            bk.select_backend(q[None, a:b], kv, sp, dense)
    except (ValueError, TypeError) as e:
        problem = e
    if not torch.compiler.is_compiling():
        checks.agree(g, "packed_attention", problem, plan=plan.digest(), q=tuple(q.shape), k=tuple(k.shape),
                     dtype=str(q.dtype), causal=causal, window=window, scale=scale, backend=backend,
                     softcap=repr(softcap), sinks=repr(getattr(sinks, "shape", sinks)), chunk=repr(chunk_size))
    elif problem is not None:
        raise problem
    cu = torch.tensor(plan.cu, dtype=torch.int32, device="cpu")
    out, lse = _packed(q, k, v, cu, plan.imbalance, scale, causal, window[0], window[1], backend, kernel,
                       checks.group_name(g), softcap, chunk)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, varlen=True)
    return (out, lse) if return_lse else out
