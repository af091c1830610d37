"""The views and gather engines of dilated attention: each part through the
local backend layer.

Views (MHA; GQA whose rates and group size divide each other): every part is
a strided view of q/k/v (no copies; GQA: the kv heads the class reads, see
:meth:`Part.kv_view`), for MHA a branch's classes stacked into few calls
(:class:`Unit`; small branches whose classes do not stack, MHA or GQA, are
copied into one dense block: calls cost host time), and each result merges
into the output in place (one Triton pass on CUDA, float32 arithmetic, the
output kept in its dtype). Gather (GQA with other rates): parts copied into dense blocks, merged
into float32 accumulators.

The backward reruns each part's local backward with the *merged* output and
lse, so its gradients are exact pieces of the whole; they add into dQ/dK/dV in
place (GQA: within a branch the classes' kv views are disjoint, so adds never
race).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import backends as bk
from .._merge import empty_state, merge_, merge_into
from .._streams import has_side_stream, side_stream
from ..kernels import merge as kmerge
from .plan import DilatedPlan
from .schedule import Part, Unit, kv_heads_for, ordered_units, schedule


def _dense(x: torch.Tensor) -> torch.Tensor:
    """(B, nseg, m, h, D) view -> contiguous (B*nseg, m, h, D) block."""
    return x.reshape(-1, *x.shape[2:])


def _gather(part: Part, q, k, v):
    nheads, nheads_kv = q.shape[2], k.shape[2]
    kv_idx, _ = kv_heads_for(part, nheads, nheads_kv)
    idx = torch.tensor(kv_idx, device=q.device)
    qb = _dense(part.q_view(q))
    kb = _dense(part.rows(k).index_select(3, idx))
    vb = _dense(part.rows(v).index_select(3, idx))
    return qb, kb, vb, idx


def adoptable(nbase: int, x: torch.Tensor, limit: int) -> bool:
    """One base unit, batch 1: the backend's results for it, called on the
    whole unit (one piece, whatever the plan's piece size: nothing else is
    allocated for them), are the whole (1, S, H, D) output and gradients,
    taken as they are: no copy pass. At most ``limit`` elements: 2**31 in the
    forward, so every element index fits in int32 (1M tokens x 16 heads x 128
    is exactly 2**31; one H200: the same output, bit for bit, as the pieces),
    the plan's ``adopt_bwd_max_elems`` in the backward."""
    return nbase == 1 and x.shape[0] == 1 and x.numel() <= limit


def _pieces(u: Unit, v: torch.Tensor, esize: int, piece_bytes: int):
    """Slices of the unit's batch dim whose output stays under ``piece_bytes``;
    [None] for the whole unit (no slicing: host time)."""
    per = max(1, piece_bytes // max(1, v[0].numel() * esize))
    pieces = [slice(a, min(a + per, u.n)) for a in range(0, u.n, per)]
    return [None] if len(pieces) == 1 else pieces


def _cut(sl: Optional[slice], *xs: torch.Tensor):
    return xs if sl is None else tuple(x[sl] for x in xs)


def _gather_views(*xs: torch.Tensor) -> list[torch.Tensor]:
    """5-D (nseg, r, m, Hc, D) views (GQA keys and values: 6-D, see
    :meth:`Unit.kv_view`) -> dense (N, m, Hc, D) copies: on CUDA one Triton
    launch per shape for up to three 5-D views, torch's copy for the rest."""
    dense = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    _pairwise(dense, xs, xs[0].is_cuda and kmerge.usable(xs[0]), kmerge.copy_into, torch.Tensor.copy_)
    return [d.view(-1, *d.shape[-3:]) for d in dense]


def _pairwise(dsts, srcs, fused: bool, launch, each) -> None:
    """``each(dst, src)`` for every pair, where ``fused`` in one ``launch`` of
    :mod:`longattn.kernels.merge` per shape and up to three pairs (tensors of
    at most 5 dims, unit stride in D); torch's op for the rest."""
    same: dict = {}
    for d, s in zip(dsts, srcs):
        if fused and d.dim() <= 5 and d.stride(-1) == s.stride(-1) == 1:
            same.setdefault(d.shape, []).append((d, s))
        else:
            each(d, s)
    for pairs in same.values():
        for a in range(0, len(pairs), 3):
            launch([d for d, _ in pairs[a:a + 3]], [s for _, s in pairs[a:a + 3]])


# ------------------------------------------------------------------------ forward
def forward(plan: DilatedPlan, q, k, v, segment_lengths, dilation_rates, causal: bool, scale: float,
            backend: str = "auto", out_dtype=None):
    """out (in ``out_dtype``, default q's) and lse (B, H, S) float32."""
    if plan.fwd == "gather":
        return _gather_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype)
    b, s, h, d = q.shape
    # On CUDA one Triton pass merges in float32 registers into the output's dtype; torch's merge (CPU:
    # the interpreter is slow) needs a float32 output.
    acc = (out_dtype or q.dtype) if q.is_cuda and kmerge.usable(q) else torch.float32
    order, nbase = ordered_units(s, segment_lengths, dilation_rates, h, plan.gather_max_rows, k.shape[2] == h)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    ready = _ready(plan, q)
    if adoptable(nbase, q, 2 ** 31):  # the base unit's results are the output: nothing allocated before them
        out, lse = _adopt_forward(order[0], q, k, v, spec, backend, acc)
        order, start = order[1:], 1
    else:
        out, lse = (torch.empty(b, s, h, d, dtype=acc, device=q.device),
                    torch.empty((b, h, s), dtype=torch.float32, device=q.device)) if nbase else empty_state(q, acc)
        start = 0
    calls = [(i < nbase, _unit_calls(u, bi, q, k, v, out, lse, spec, backend, plan.piece_bytes))
             for i, u in enumerate(order, start=start) for bi in range(b)]
    for writes, res in side_streams(calls, ready):
        _land_forward(res, writes, q.is_cuda)
    return out.to(out_dtype or q.dtype), lse


def _adopt_forward(u: Unit, q, k, v, spec, backend, acc):
    b, s, h, d = q.shape
    ob, lb = bk.block_forward(*(u.view(x, 0, h) for x in (q, k, v)), spec, backend)
    if ob.dtype == acc and ob.is_contiguous():
        return ob.view(b, s, h, d), lb.transpose(0, 1).reshape(b, h, s)  # (nseg, H, m) -> (1, H, S)
    out = torch.empty(b, s, h, d, dtype=acc, device=q.device)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    u.view(out, 0, h).copy_(ob)
    u.view(lse, 0, h).copy_(lb.transpose(1, 2))
    return out, lse


def _unit_calls(u: Unit, bi: int, q, k, v, out, lse, spec, backend, piece_bytes: int):
    """A thunk running unit ``u`` of batch element ``bi``: a generator of (out
    view, lse view, out block, lse block) per backend call, for
    :func:`_land_forward` (see :func:`side_streams` for why lazy)."""
    h = q.shape[2]
    qv, kv, vv, ov, lv = (u.view(x, bi, h) for x in (q, k, v, out, lse))  # (N, M, Hc, D) / (N, M, Hc)

    def run():
        if u.gathered:  # 5-D (GQA keys and values: 6-D) views; one call on dense copies
            ob, lb = bk.block_forward(*_gather_views(qv, kv, vv), spec, backend)
            yield ov, lv, ob.view(ov.shape), lb.transpose(1, 2).view(lv.shape)
            return
        for sl in _pieces(u, qv, q.element_size(), piece_bytes):
            qs, ks, vs, os_, ls = _cut(sl, qv, kv, vv, ov, lv)
            ob, lb = bk.block_forward(qs, ks, vs, spec, backend)
            yield os_, ls, ob, lb.transpose(1, 2)
    return run


def _land_forward(res, writes: bool, cuda: bool) -> None:
    """A unit's results written into out/lse (a base unit) or merged into them."""
    for ov, lv, ob, lb in res:
        if writes:
            ov.copy_(ob)
            lv.copy_(lb)
        else:
            merge_into(ov, lv, ob, lb, use_triton=cuda)


def _ready(plan: DilatedPlan, q: torch.Tensor):
    """With concurrent calls, an event on the current stream after which the
    inputs are ready: side streams wait for it, not for the base call that
    the current stream runs next. None where the calls run in order (also
    inside a CUDA graph capture that starts before the side streams exist)."""
    if not (plan.concurrent and q.is_cuda):
        return None
    if torch.cuda.is_current_stream_capturing() and not has_side_stream(q.device, ("dilated views", 0)):
        return None
    return torch.cuda.current_stream().record_event()


def side_streams(calls, ready):
    """Run (writes, thunk) pairs and yield (writes, results) in order; a
    thunk returns a generator of its backend calls' results.

    ``None``: in order on the current stream, each call's results landed
    before the next call runs (lazily: a unit cut into pieces keeps the
    landed piece's blocks and the next one's alive, not the whole unit's; at
    1M tokens the base branch's gradient blocks alone are 12 GiB). ``ready`` an event (see
    :func:`_ready`): every thunk is run at once, each on a side stream after
    ``ready``, and the current stream waits for a call only when its results
    are landed: a short sequence's branch calls are a few waves each, side by
    side they fill each other's tails (``DilatedTuning.concurrent_calls``).
    All results are alive until landed: the tuning bounds where that memory
    is spent (graphed passes of short sequences).

    At the end the side streams wait for the current stream: a block the
    allocator frees from a side stream's results is reused only by later
    work on that side stream, which then runs after the landing that read
    it (this also joins the side streams back into a CUDA graph capture)."""
    if ready is None or len(calls) < 2:
        for writes, call in calls:
            yield writes, call()
        return
    main = torch.cuda.current_stream()
    pending, used = [], {}
    for i, (writes, call) in enumerate(calls):
        side = used.setdefault(i % _NSTREAMS, side_stream(main.device, ("dilated views", i % _NSTREAMS)))
        side.wait_event(ready)
        with torch.cuda.stream(side):
            pending.append((writes, side, list(call())))
    for writes, side, res in pending:
        main.wait_stream(side)
        yield writes, res
    del pending
    for side in used.values():
        side.wait_stream(main)


_NSTREAMS = 4


def _gather_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype):
    b, s, h, d = q.shape
    out, lse = empty_state(q, torch.float32)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    for part in schedule(s, segment_lengths, dilation_rates, h):
        qb, kb, vb, _ = _gather(part, q, k, v)
        ob, lb = bk.block_forward(qb, kb, vb, spec, backend)
        ob = ob.view(b, part.nseg, part.m, -1, d)
        lb = lb.view(b, part.nseg, -1, part.m).transpose(2, 3)
        merge_(part.q_view(out), part.lse_view(lse), ob, lb)
    return out.to(out_dtype or q.dtype), lse


# ----------------------------------------------------------------------- backward
def backward(plan: DilatedPlan, dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal: bool,
             scale: float, backend: str = "auto"):
    """(dq, dk, dv) in the inputs' dtypes, from the merged out and lse."""
    if plan.bwd == "gather":
        return _gather_backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale,
                                backend)
    b, s, h, d = q.shape
    fused_add = q.is_cuda and kmerge.usable(q)  # CPU keeps torch's add (the interpreter is slow)
    order, nbase = ordered_units(s, segment_lengths, dilation_rates, h, plan.gather_max_rows_bwd, k.shape[2] == h)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    tensors = (dout, q, k, v, out, lse, dlse)
    ready = _ready(plan, q)
    if adoptable(nbase, q, plan.adopt_bwd_max_elems):  # the base unit's gradients are the result
        grads = _adopt_backward(order[0], tensors, spec, backend)
        order, start = order[1:], 1
    else:
        new = torch.empty_like if nbase else torch.zeros_like
        grads = [new(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
        start = 0
    calls = [(i < nbase, _unit_grads(u, bi, tensors, grads, spec, backend, plan.piece_bytes))
             for i, u in enumerate(order, start=start) for bi in range(b)]
    for writes, res in side_streams(calls, ready):
        for gvs, gb in res:
            if writes:
                for gv, g in zip(gvs, gb):
                    gv.copy_(g)
            else:
                add_grads(gvs, gb, fused_add)
    return tuple(grads)


def _adopt_backward(u: Unit, tensors, spec, backend) -> list[torch.Tensor]:
    dout, q, k, v, out, lse, dlse = tensors
    h = q.shape[2]
    dov, qv, kv, vv, ov, lv = (u.view(x, 0, h) for x in (dout, q, k, v, out, lse))
    dlb = None if dlse is None else u.view(dlse, 0, h).transpose(1, 2)
    gb = bk.block_backward(dov, qv, kv, vv, ov, lv.transpose(1, 2), spec, backend, dlse=dlb)
    if all(g.is_contiguous() and g.dtype == x.dtype for g, x in zip(gb, (q, k, v))):
        return [g.view(x.shape) for g, x in zip(gb, (q, k, v))]
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
    for x, g in zip(grads, gb):
        u.view(x, 0, h).copy_(g)
    return grads


def _unit_grads(u: Unit, bi: int, tensors, grads, spec, backend, piece_bytes: int):
    """A thunk running the backward of unit ``u`` of batch element ``bi``: a
    generator of (gradient views, gradient blocks) per backend call."""
    dout, q, k, v, out, lse, dlse = tensors
    h = q.shape[2]
    qv, kv, vv, dov, ov, lv = (u.view(x, bi, h) for x in (q, k, v, dout, out, lse))
    dlv = None if dlse is None else u.view(dlse, bi, h)
    gvs = [u.view(x, bi, h) for x in grads]

    def run():
        if u.gathered:  # 5-D (GQA keys and values: 6-D) views; one call on dense copies, its gradients added back
            qg, kg, vg, dog, og = _gather_views(qv, kv, vv, dov, ov)
            lb, dlb = (None if x is None else x.reshape(u.n, *x.shape[2:]).transpose(1, 2) for x in (lv, dlv))
            gb = bk.block_backward(dog, qg, kg, vg, og, lb, spec, backend, dlse=dlb)
            yield gvs, [g.view(gv.shape) for g, gv in zip(gb, gvs)]
            return
        for sl in _pieces(u, qv, q.element_size(), piece_bytes):
            dos, qs, ks, vs, os_, ls = _cut(sl, dov, qv, kv, vv, ov, lv)
            dlb = None if dlv is None else _cut(sl, dlv)[0].transpose(1, 2)
            # lse as (n, Hc, m) views: the backends copy what they need
            gb = bk.block_backward(dos, qs, ks, vs, os_, ls.transpose(1, 2), spec, backend, dlse=dlb)
            yield _cut(sl, *gvs), gb
    return run


def add_grads(dsts, srcs, fused: bool) -> None:
    """dst += src for dQ, dK, dV views: one vectorised launch for the pairs of
    one shape (GQA: a class's kv view can have fewer heads than its query
    view, then dQ goes alone and dK/dV together); torch's add for the 6-D
    views of a gathered GQA branch's keys and values (:meth:`Unit.kv_view`)."""
    _pairwise(dsts, srcs, fused, kmerge.add_into, torch.Tensor.add_)


def _gather_backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, backend):
    b, s, h, d = q.shape
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in (q, k, v))
    spec = bk.BlockSpec(scale=scale, causal=causal)
    for part in schedule(s, segment_lengths, dilation_rates, h):
        qb, kb, vb, idx = _gather(part, q, k, v)
        ob = _dense(part.q_view(out))
        dob = _dense(part.q_view(dout))
        lb = _dense(part.lse_view(lse)).transpose(1, 2).contiguous()  # (B*nseg, Hc, m)
        dlb = None if dlse is None else _dense(part.lse_view(dlse)).transpose(1, 2).contiguous()
        dqb, dkb, dvb = bk.block_backward(dob, qb, kb, vb, ob, lb, spec, backend, dlse=dlb)
        part.q_view(dq).add_(dqb.view(b, part.nseg, part.m, -1, d))
        part.rows(dk).index_add_(3, idx, dkb.view(b, part.nseg, part.m, -1, d).float())
        part.rows(dv).index_add_(3, idx, dvb.view(b, part.nseg, part.m, -1, d).float())
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
