"""LongNet dilated attention on one device: the schedule, the views path and
the gather path.

Semantics (pinned by tests/reference.py):
  branch i has segment length w_i and dilation rate r_i; for query head h it
  selects position p when ``(p % w_i) % r_i == h % r_i``. A selected query
  attends to the selected keys of its own segment ``p // w_i`` (with
  ``causal``, keys at positions <= p). The branches merge as one softmax over
  the union of the keys each branch gives (merge by lse). GQA: query head h
  reads kv head ``h // (H // Hkv)`` at the positions its own offset selects.

The schedule cuts every branch into *parts*: for each offset class
``c = h % r`` the full segments (batched as one dense call) and the partial
last segment. A part's rows are ``c, c + r, ...`` inside each segment, which
are plain strided views of (B, S, H, D) tensors. The views path hands those
views to the local backend without copies, for MHA a branch's classes
stacked into few calls (:class:`Unit`; small branches whose classes do not
stack are copied into one dense block instead: calls cost host time), for
GQA one call per part (its kv heads are a strided view when the rates and
the group size divide each other, :func:`kv_views_ok`), and merges each
result into the output in place (one Triton pass, float32 arithmetic); the
gather path (GQA with other rates) copies parts into dense blocks and merges
into float32 accumulators. The
backward reruns each part's local backward with the *merged* output and lse,
so its gradients are exact pieces of the whole.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from . import backends as bk
from ._merge import empty_state, merge_, merge_into


@dataclasses.dataclass(frozen=True)
class Part:
    """Rows ``start + s*seg_len + c + i*r`` for s < nseg, i < m, query heads c::r."""

    w: int
    r: int
    c: int
    start: int
    nseg: int
    seg_len: int

    def nheads(self, h: int) -> int:
        """Query heads of this part's offset class among ``h``: c, c + r, ..."""
        return len(range(self.c, h, self.r))

    @property
    def m(self) -> int:
        return -(-(self.seg_len - self.c) // self.r)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H, D) -> strided view (B, nseg, m, H, D)."""
        b, _, h, d = x.shape
        span = x[:, self.start : self.start + self.nseg * self.seg_len]
        return span.view(b, self.nseg, self.seg_len, h, d)[:, :, self.c :: self.r]

    def q_view(self, x: torch.Tensor, bi: Optional[int] = None) -> torch.Tensor:
        """(B, S, H, D) -> strided view (B, nseg, m, Hc, D) of the part's rows and
        heads, or (nseg, m, Hc, D) of batch element ``bi``. One ``as_strided``
        call: the views path makes these for every tensor of every call, and
        short sequences are bound by host time."""
        sb, ss, sh, sd = x.stride()
        size = (self.nseg, self.m, self.nheads(x.shape[2]), x.shape[3])
        stride = (self.seg_len * ss, self.r * ss, self.r * sh, sd)
        return self._view(x, sb, ss, sh, size, stride, bi)

    def lse_view(self, lse: torch.Tensor, bi: Optional[int] = None) -> torch.Tensor:
        """(B, H, S) -> strided view (B, nseg, m, Hc) aligned with q_view (or
        (nseg, m, Hc) of batch element ``bi``)."""
        sb, sh, ss = lse.stride()
        size = (self.nseg, self.m, self.nheads(lse.shape[1]))
        stride = (self.seg_len * ss, self.r * ss, self.r * sh)
        return self._view(lse, sb, ss, sh, size, stride, bi)

    def kv_view(self, x: torch.Tensor, nheads: int, bi: Optional[int] = None) -> torch.Tensor:
        """(B, S, Hkv, D) -> strided view (B, nseg, m, Hk, D) of the part's rows
        and the kv heads its query heads (c::r of ``nheads``) read, or
        (nseg, m, Hk, D) of batch element ``bi``. With g = nheads / Hkv:
        r % g == 0: kv heads c // g, c // g + r / g, ... one per query head
        (an MHA call); g % r == 0: every kv head, each for g / r consecutive
        query heads of the class (a GQA call). See :func:`kv_views_ok`."""
        hkv = x.shape[2]
        g = nheads // hkv
        if g == 1:
            return self.q_view(x, bi)
        sb, ss, sh, sd = x.stride()
        if self.r % g == 0:
            head0, step, count = self.c // g, self.r // g, self.nheads(nheads)
        else:
            head0, step, count = 0, 1, hkv
        size = (self.nseg, self.m, count, x.shape[3])
        stride = (self.seg_len * ss, self.r * ss, step * sh, sd)
        first = x.storage_offset() + (self.start + self.c) * ss + head0 * sh
        if bi is None:
            return x.as_strided((x.shape[0], *size), (sb, *stride), first)
        return x.as_strided(size, stride, first + bi * sb)

    def _view(self, x, sb, ss, sh, size, stride, bi):
        first = x.storage_offset() + (self.start + self.c) * ss + self.c * sh  # row start + c, head c
        if bi is None:
            return x.as_strided((x.shape[0], *size), (sb, *stride), first)
        return x.as_strided(size, stride, first + bi * sb)


def schedule(seqlen: int, segment_lengths, dilation_rates, nheads: int) -> list[Part]:
    parts = []
    for w, r in zip(segment_lengths, dilation_rates):
        nfull = seqlen // w
        tail = seqlen - nfull * w
        for c in range(min(r, nheads)):
            if nfull and c < w:
                parts.append(Part(w, r, c, 0, nfull, w))
            if tail and c < tail:
                parts.append(Part(w, r, c, nfull * w, 1, tail))
    return parts


def kv_views_ok(dilation_rates, nheads: int, nheads_kv: int) -> bool:
    """Every part's kv heads are a strided view (see :meth:`Part.kv_view`):
    with g = nheads / nheads_kv, each rate is a multiple or a divisor of g
    (always for MHA; for powers of two always)."""
    g = nheads // nheads_kv
    return all(r % g == 0 or g % r == 0 for r in dilation_rates)


def kv_heads_for(part: Part, nheads: int, nheads_kv: int) -> tuple[list[int], bool]:
    """The kv heads the part's query heads read, and whether they form a
    regular GQA grouping (each listed kv head serving an equal run of
    consecutive query heads) so the backend can read them without expansion."""
    g = nheads // nheads_kv
    per_q = [h // g for h in range(part.c, nheads, part.r)]
    uniq = list(dict.fromkeys(per_q))
    run = len(per_q) // len(uniq)
    regular = len(per_q) % len(uniq) == 0 and per_q == [u for u in uniq for _ in range(run)]
    return (uniq if regular else per_q), regular


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


# A part's cuDNN call is cut into pieces of at most this many bytes of output, so
# the transient per-call tensors stay small beside the (B, S, H, D) result.
PIECE_BYTES = 128 << 20


# A branch (full segments) of at most this many (row, head) pairs, S * H / r, runs
# as one call on gathered copies when its classes do not stack into one view:
# 128 squares of 2048 rows. LongNet config: every such branch at 32K, rate 8 at
# 128K, none at 1M. Measured on one H200 (docs/performance.md): gathering the
# rate-4 branch at 128K too (256 squares) cost more in copies than it saved in
# host time; at 32K the forward and the causal backward are host-bound and each
# call saved counts, the non-causal backward is not (it does not gather).
GATHER_MAX_ROWS = 128 * 2048


@dataclasses.dataclass(frozen=True)
class Unit:
    """One local-backend call of the MHA views path: a (N, M, Hc, D) strided
    view of every (B, S, H, D) tensor and (N, M, Hc) of every (B, H, S) one.

    ``part`` set: the part's (nseg, m, Hc, D) rows. Otherwise the full segments
    of a whole branch (w, r) whose offset classes share m = w / r and Hc = H / r:
    class c reads rows ``s*w + c + i*r`` of heads ``c + j*r``, an address linear
    in (s, c, i, j), so the classes stack into one view with the class as a
    batch (``seg`` = s: one call per segment, (r, m, Hc)) or, with one head per
    class, as the head dim (``seg`` = -1: (nseg, m, r)). Fewer, larger calls
    than one per class: the high-rate branches are tiny per class. Where
    neither fits and the branch is small (``gathered``, see GATHER_MAX_ROWS),
    its rows are copied into dense (nseg * r, m, Hc, D) blocks, one call: on
    short sequences a call's host time (100-300 us on the H200 hosts) outweighs
    copying 1/r of q, k and v.
    """

    part: Optional[Part] = None
    w: int = 0
    r: int = 0
    nseg: int = 0
    seg: int = -1
    gathered: bool = False

    @property
    def n(self) -> int:
        if self.part is not None:
            return self.part.nseg
        if self.gathered:
            return self.nseg * self.r
        return self.nseg if self.seg < 0 else self.r

    def _five(self, x: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        """(B, S, H, D) -> (nseg, r, m, Hc, D); (B, H, S) -> (nseg, r, m, Hc)."""
        w, r, m, hc = self.w, self.r, self.w // self.r, h // self.r
        if x.dim() == 4:
            sb, ss, sh, sd = x.stride()
            return x.as_strided((self.nseg, r, m, hc, x.shape[3]), (w * ss, ss + sh, r * ss, r * sh, sd),
                                x.storage_offset() + bi * sb)
        sb, sh, ss = x.stride()
        return x.as_strided((self.nseg, r, m, hc), (w * ss, ss + sh, r * ss, r * sh), x.storage_offset() + bi * sb)

    def view(self, x: torch.Tensor, bi: int, h: int) -> torch.Tensor:
        """The call's (N, M, Hc, D) / (N, M, Hc) view; a gathered unit's is the
        5-D (nseg, r, m, Hc, D) / (nseg, r, m, Hc) one its copies are made from."""
        if self.part is not None:
            if x.dim() == 3:
                return self.part.lse_view(x, bi)
            return self.part.q_view(x, bi) if x.shape[2] == h else self.part.kv_view(x, h, bi)
        v = self._five(x, bi, h)
        if self.gathered:
            return v
        if self.seg >= 0:
            return v[self.seg]
        return v[:, :, :, 0].transpose(1, 2)  # one head per class: the classes are the heads


def units(seqlen: int, segment_lengths, dilation_rates, nheads: int, gather: bool = True,
          mha: bool = True) -> list[Unit]:
    """The views path's calls: each branch's full segments as few stacked views
    as its shape allows (see :class:`Unit`), other parts (partial last
    segments, classes of unequal size) one call each. GQA (``mha`` False):
    one call per part (a class's kv heads do not step with the class, so
    classes do not stack)."""
    out = []
    for part in schedule(seqlen, segment_lengths, dilation_rates, nheads):
        w, r = part.w, part.r
        stack = mha and part.start == 0 and part.seg_len == w and w % r == 0 and nheads % r == 0 and r > 1
        if not stack:
            out.append(Unit(part))
        elif part.c == 0:  # the branch's first class stands for all of them
            nseg = part.nseg
            if nheads == r:
                out.append(Unit(w=w, r=r, nseg=nseg))
            elif gather and nseg * w * (nheads // r) <= GATHER_MAX_ROWS:
                out.append(Unit(w=w, r=r, nseg=nseg, gathered=True))
            elif nseg < r:
                out += [Unit(w=w, r=r, nseg=nseg, seg=i) for i in range(nseg)]
            else:
                out += [Unit(p) for p in schedule(seqlen, [w], [r], nheads) if p.start == 0]
    return out


def _pieces(u: Unit, v: torch.Tensor, esize: int):
    """Slices of the unit's batch dim whose output stays under PIECE_BYTES."""
    per = max(1, PIECE_BYTES // max(1, v[0].numel() * esize))
    return [slice(a, min(a + per, u.n)) for a in range(0, u.n, per)]


def _ordered_units(seqlen: int, segment_lengths, dilation_rates, nheads: int, gather: bool = True,
                   mha: bool = True) -> tuple[tuple[Unit, ...], int]:
    """The views path's units with the first rate-1 branch's parts first, and
    their count. Those parts cover every (row, head) exactly once, so their
    results are copied into the output (or become it) instead of merging with
    an empty one: no zero-fill pass, no read of it. Cached: planning is host
    time on every call."""
    return _ordered_units_cached(seqlen, tuple(segment_lengths), tuple(dilation_rates), nheads, gather, mha)


@functools.lru_cache(maxsize=256)
def _ordered_units_cached(seqlen: int, segment_lengths: tuple, dilation_rates: tuple, nheads: int, gather: bool,
                          mha: bool):
    us = units(seqlen, segment_lengths, dilation_rates, nheads, gather, mha)
    if 1 not in dilation_rates:
        return tuple(us), 0
    w = segment_lengths[dilation_rates.index(1)]
    base = [Unit(p) for p in schedule(seqlen, [w], [1], nheads)]
    for u in base:
        us.remove(u)  # its first occurrence: a repeated (w, 1) branch still merges
    return tuple(base + us), len(base)


# The backward adopts the base unit's gradients only up to this many elements:
# cuDNN keeps dQ in a float32 buffer of the call's size (2**29 elements: 2 GiB),
# where pieces of PIECE_BYTES keep it small. At 1M tokens (2**31 elements) the
# whole-unit call measured 5% faster and 7 GiB more peak (adopt_1m_h200_probe.json).
ADOPT_BWD_MAX_ELEMS = 2 ** 29


def _adoptable(nbase: int, x: torch.Tensor, backward: bool = False) -> bool:
    """One base unit, batch 1: the backend's results for it, called on the
    whole unit (one piece, whatever PIECE_BYTES says: nothing else is
    allocated for them), are the whole (1, S, H, D) output and gradients,
    taken as they are: no copy pass. At most 2**31 elements, so every element
    index fits in int32 (1M tokens x 16 heads x 128 is exactly 2**31; one H200:
    the same output, bit for bit, as the pieces); the backward stops at
    ADOPT_BWD_MAX_ELEMS."""
    limit = ADOPT_BWD_MAX_ELEMS if backward else 2 ** 31
    return nbase == 1 and x.shape[0] == 1 and x.numel() <= limit


def _unit_pieces(u: Unit, v: torch.Tensor, esize: int):
    """The unit's pieces (see _pieces); None for the whole unit (no slicing:
    host time)."""
    pieces = _pieces(u, v, esize)
    return [None] if len(pieces) == 1 else pieces


def _cut(sl: Optional[slice], *xs: torch.Tensor):
    return xs if sl is None else tuple(x[sl] for x in xs)


def _gather_views(*xs: torch.Tensor) -> list[torch.Tensor]:
    """5-D (nseg, r, m, Hc, D) views -> dense (nseg * r, m, Hc, D) copies (one
    Triton launch for up to three on CUDA)."""
    from .kernels import triton_merge

    dense = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    if xs[0].is_cuda and triton_merge.usable(xs[0]) and all(x.stride(-1) == 1 for x in xs):
        for a in range(0, len(xs), 3):
            triton_merge.copy_into(dense[a:a + 3], xs[a:a + 3])
    else:
        for d, x in zip(dense, xs):
            d.copy_(x)
    return [d.view(-1, *d.shape[2:]) for d in dense]


def forward(q, k, v, segment_lengths, dilation_rates, causal: bool, scale: float, backend: str = "auto",
            out_dtype=None):
    b, s, h, d = q.shape
    mha = k.shape[2] == h
    if not kv_views_ok(dilation_rates, h, k.shape[2]):
        return _gather_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype)
    # Every part is a strided view of q/k/v (no gathered copies; GQA: the kv
    # heads the class reads, see Part.kv_view); each piece's result merges into
    # the output in place (float32 arithmetic, the output kept in its dtype
    # where the Triton merge runs).
    from .kernels import triton_merge

    acc = (out_dtype or q.dtype) if triton_merge.usable(q) else torch.float32
    # Gathering trades copies (GPU time) for calls (host time). The forward
    # always gathers: at 32K its host time per call is comparable to its GPU
    # work, and how fast the host is varies by machine (one H200, several
    # starts: gathered 0.81-0.88 of dense every time, per-class calls 0.58-0.96;
    # docs/performance.md).
    order, nbase = _ordered_units(s, segment_lengths, dilation_rates, h, gather=True, mha=mha)
    adopt = _adoptable(nbase, q)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    new_out = lambda: (torch.empty(b, s, h, d, dtype=acc, device=q.device),
                       torch.empty((b, h, s), dtype=torch.float32, device=q.device))
    if adopt:  # the base unit's results are the output: nothing allocated before them
        u = order[0]
        ob, lb = bk.block_forward(*(u.view(x, 0, h) for x in (q, k, v)), spec, backend)
        if ob.dtype == acc and ob.is_contiguous():
            out, lse = ob.view(b, s, h, d), lb.transpose(0, 1).reshape(b, h, s)  # (nseg, H, m) -> (1, H, S)
        else:
            out, lse = new_out()
            u.view(out, 0, h).copy_(ob)
            u.view(lse, 0, h).copy_(lb.transpose(1, 2))
        order = order[1:]
    else:
        out, lse = new_out() if nbase else empty_state(q, acc)
    for i, u in enumerate(order, start=int(adopt)):
        for bi in range(b):
            qv, kv, vv, ov, lv = (u.view(x, bi, h) for x in (q, k, v, out, lse))  # (N, M, Hc, D) / (N, M, Hc)
            if u.gathered:  # 5-D views; one call on dense copies
                ob, lb = bk.block_forward(*_gather_views(qv, kv, vv), spec, backend)
                merge_into(ov, lv, ob.view(ov.shape), lb.transpose(1, 2).view(lv.shape), use_triton=True)
                continue
            for sl in _unit_pieces(u, qv, q.element_size()):
                qs, ks, vs, os_, ls = _cut(sl, qv, kv, vv, ov, lv)
                ob, lb = bk.block_forward(qs, ks, vs, spec, backend)
                if i < nbase:
                    os_.copy_(ob)
                    ls.copy_(lb.transpose(1, 2))
                else:
                    merge_into(os_, ls, ob, lb.transpose(1, 2), use_triton=True)
    return out.to(out_dtype or q.dtype), lse


def _gather_forward(q, k, v, segment_lengths, dilation_rates, causal, scale, backend, out_dtype):
    b, s, h, d = q.shape
    out, lse = empty_state(q, torch.float32)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    for part in schedule(s, segment_lengths, dilation_rates, h):
        qb, kb, vb, _ = _gather(part, q, k, v)
        ob, lb = bk.block_forward(qb, kb, vb, spec, backend)
        o_view = part.q_view(out)
        l_view = part.lse_view(lse)
        ob = ob.view(b, part.nseg, part.m, -1, d)
        lb = lb.view(b, part.nseg, -1, part.m).transpose(2, 3)
        merge_(o_view, l_view, ob, lb)
    return out.to(out_dtype or q.dtype), lse


def backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal: bool, scale: float,
             backend: str = "auto"):
    b, s, h, d = q.shape
    mha = k.shape[2] == h
    if not kv_views_ok(dilation_rates, h, k.shape[2]):
        return _gather_backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale,
                                backend)
    # Views of every tensor; each piece's gradients add into dQ/dK/dV in place,
    # in the input dtype (one rounding per branch, as the fused kernels); the
    # base branch's (see _ordered_units) are copied in. GQA: within a branch
    # the classes' kv views are disjoint (different rows), so adds never race.
    from .kernels import triton_merge

    fused_add = q.is_cuda and triton_merge.usable(q)  # CPU keeps torch's add (the interpreter is slow)
    # The non-causal backward is GPU-bound (gathering cost 0.1-0.2 ms at 32K in
    # in-process A/Bs), the causal one host-bound (gathering saved ~0.9 ms).
    order, nbase = _ordered_units(s, segment_lengths, dilation_rates, h, gather=causal, mha=mha)
    adopt = _adoptable(nbase, q, backward=True)
    spec = bk.BlockSpec(scale=scale, causal=causal)
    new_grads = lambda new: [new(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
    if adopt:  # the base unit's gradients, laid out as (1, S, H, D), are the result
        u = order[0]
        dov, qv, kv, vv, ov, lv = (u.view(x, 0, h) for x in (dout, q, k, v, out, lse))
        dlb = None if dlse is None else u.view(dlse, 0, h).transpose(1, 2)
        gb = bk.block_backward(dov, qv, kv, vv, ov, lv.transpose(1, 2), spec, backend, dlse=dlb)
        if all(g.is_contiguous() and g.dtype == x.dtype for g, x in zip(gb, (q, k, v))):
            grads = [g.view(x.shape) for g, x in zip(gb, (q, k, v))]
        else:
            grads = new_grads(torch.empty_like)
            for x, g in zip(grads, gb):
                u.view(x, 0, h).copy_(g)
        order = order[1:]
    else:
        grads = new_grads(torch.empty_like if nbase else torch.zeros_like)
    for i, u in enumerate(order, start=int(adopt)):
        for bi in range(b):
            qv, kv, vv, dov, ov, lv = (u.view(x, bi, h) for x in (q, k, v, dout, out, lse))
            dlv = None if dlse is None else u.view(dlse, bi, h)
            if u.gathered:  # 5-D views; one call on dense copies, its gradients added back
                qg, kg, vg, dog, og = _gather_views(qv, kv, vv, dov, ov)
                lb, dlb = (None if x is None else x.reshape(u.n, *x.shape[2:]).transpose(1, 2) for x in (lv, dlv))
                gb = bk.block_backward(dog, qg, kg, vg, og, lb, spec, backend, dlse=dlb)
                _add_grads([u.view(x, bi, h) for x in grads], [g.view(qv.shape) for g in gb], fused_add)
                continue
            for sl in _unit_pieces(u, qv, q.element_size()):
                dos, qs, ks, vs, os_, ls = _cut(sl, dov, qv, kv, vv, ov, lv)
                dlb = None if dlv is None else _cut(sl, dlv)[0].transpose(1, 2)
                # lse as (n, Hc, m) views: the backends copy what they need
                gb = bk.block_backward(dos, qs, ks, vs, os_, ls.transpose(1, 2), spec, backend, dlse=dlb)
                gvs = _cut(sl, *(u.view(x, bi, h) for x in grads))
                if i < nbase:
                    for gv, g in zip(gvs, gb):
                        gv.copy_(g)
                else:
                    _add_grads(gvs, gb, fused_add)
    return tuple(grads)


def _add_grads(dsts, srcs, fused: bool) -> None:
    """dst += src for dQ, dK, dV views: one vectorised launch for the pairs of
    one shape (GQA: a class's kv view can have fewer heads than its query
    view, then dQ goes alone and dK/dV together)."""
    from .kernels import triton_merge

    if fused and all(g.stride(-1) == 1 for g in srcs):
        for shape in dict.fromkeys(d.shape for d in dsts):
            pairs = [(d, g) for d, g in zip(dsts, srcs) if d.shape == shape]
            triton_merge.add_into([d for d, _ in pairs], [g for _, g in pairs])
    else:
        for d, g in zip(dsts, srcs):
            d.add_(g)


def _gather_backward(dout, q, k, v, out, lse, dlse, segment_lengths, dilation_rates, causal, scale, backend):
    b, s, h, d = q.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
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


def pair_count(seqlen: int, segment_lengths, dilation_rates, nheads: int, causal: bool) -> int:
    """(query, key) pairs computed, summed over heads and branches: the
    'useful' work FLOP counts are based on (x 4 x headdim for a forward)."""
    total = 0
    for part in schedule(seqlen, segment_lengths, dilation_rates, nheads):
        hc = part.nheads(nheads)
        m = part.m
        per_seg = m * (m + 1) // 2 if causal else m * m
        total += per_seg * part.nseg * hc
    return total
