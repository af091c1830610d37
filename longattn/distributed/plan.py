"""Ring planning: which dense calls each rank makes on each visiting K/V block.

Pure functions of positions and shapes (no torch.distributed): every rank
holds one or two chunks of known global position (or, for packed documents,
pieces of documents). For each (query chunk, key chunk) pair the planner
decides: no key visible (skip, no compute), all visible (plain dense call),
or partial (a masked call with the right position offset). Causal on the
contiguous layout skips the blocks above the diagonal; zigzag gives every rank
the same work at every step; sliding windows skip blocks outside the window
and stop the ring after the last step any rank needs; packed documents pair
only pieces of the same document (or, with a chunk size, of the same chunk
of a document: Llama 4's chunked attention). Logit soft-capping is a field
of every call's :class:`longattn.backends.BlockSpec` (elementwise on the
scores, so each block's lse still merges with the others').
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from .. import backends as bk
from .. import tuning as _tuning
from .layout import chunks


NONE, FULL, PARTIAL = 0, 1, 2


def classify(qs: int, ql: int, ks: int, kl: int, causal: bool, window) -> int:
    """Visibility of keys [ks, ks+kl) from queries [qs, qs+ql) (global positions)."""
    left, right = window
    q_lo, q_hi, k_lo, k_hi = qs, qs + ql - 1, ks, ks + kl - 1
    none = False
    if causal:
        none |= k_lo > q_hi
        full_c = k_hi <= q_lo
    else:
        full_c = True
    full_l = full_r = True
    if left >= 0:
        none |= q_lo - k_hi > left
        full_l = q_hi - k_lo <= left
    if right >= 0:
        none |= k_lo - q_hi > right
        full_r = k_hi - q_lo <= right
    if none:
        return NONE
    return FULL if (full_c and full_l and full_r) else PARTIAL


@dataclasses.dataclass(frozen=True)
class Call:
    q0: int
    q1: int
    k0: int
    k1: int
    spec: bk.BlockSpec
    # Optional executor replacing the backend call for this block (forward(q, k, v)
    # and backward(dout, q, k, v, out, lse, dlse) on the sliced tensors): a step of
    # many small document blocks fused into one varlen kernel launch. Its backward
    # may return None (e.g. given an lse gradient); its plain blocks ``run.calls``
    # then go through the backend one by one.
    run: Optional[object] = dataclasses.field(default=None, compare=False)


def masked_call(qg: int, q0: int, ql: int, kg: int, k0: int, kl: int, causal: bool, window, scale: float,
                softcap: float) -> Optional["Call"]:
    """The call of a PARTIAL block (queries at global ``qg`` .. ``qg + ql``, local
    ``q0``; keys likewise): cropped to the rows and keys that see / are seen
    (None where none are), its mask restated bottom-right aligned (query row
    ``i`` at key ``i + sk - sq``), as flash-attn's kernels (FA4, FA2) take
    masks. Visible: ``lo <= qpos - kpos <= hi`` (``lo`` 0 causal or ``-right``,
    ``hi`` ``left``, unbounded where -1). The cropped box's last row and
    last key are ``b - e`` apart with ``lo <= b - e <= hi`` (the band's
    corner, or the block's last key where the band runs past it), so the
    window ``(hi - (b - e), (b - e) - lo)`` of the box in that frame is the
    same mask. A block of a window across chunks (Gemma 2's sliding layers in
    the ring) would otherwise carry an offset only the math backend applies
    with soft-capping."""
    left, right = window
    lo = 0 if causal else (-right if right >= 0 else None)
    hi = left if left >= 0 else None
    a = qg if lo is None else max(qg, kg + lo)
    b = qg + ql if hi is None else min(qg + ql, kg + kl + hi)
    c = kg if hi is None else max(kg, qg - hi)
    e = kg + kl if lo is None else min(kg + kl, qg + ql - lo)
    if a >= b or c >= e:
        return None
    if qg - kg == kl - ql and (a, b, c, e) == (qg, qg + ql, kg, kg + kl):  # bottom-right already: unchanged
        return Call(q0, q0 + ql, k0, k0 + kl, bk.BlockSpec(scale, causal, tuple(window), qg - kg, softcap))
    d = b - e
    win_l = -1 if hi is None else hi - d
    win_r = -1 if lo is None else d - lo
    off = (e - c) - (b - a)
    spec = (bk.BlockSpec(scale, True, (win_l, -1), off, softcap) if causal and win_r == 0
            else bk.BlockSpec(scale, False, (win_l, win_r), off, softcap))
    return Call(q0 + a - qg, q0 + b - qg, k0 + c - kg, k0 + e - kg, spec)


@functools.lru_cache(maxsize=4096)  # pure function of its arguments, called every step of every call
def plan(layout: str, rank: int, src: int, world: int, local_len: int, causal: bool, window, scale: float,
         softcap: float = 0.0) -> tuple[Call, ...]:
    """Dense calls rank ``rank`` makes on the K/V block of rank ``src``."""
    return tuple(_plan(layout, rank, src, world, local_len, causal, tuple(window), scale, softcap))


def _plan(layout, rank, src, world, local_len, causal, window, scale, softcap) -> list[Call]:
    qc = chunks(layout, rank, world, local_len)
    kc = chunks(layout, src, world, local_len)
    kinds = [[classify(qg, ql, kg, kl, causal, window) for kg, _, kl in kc] for qg, _, ql in qc]
    dense = bk.BlockSpec(scale, softcap=softcap)
    flat = [x for row in kinds for x in row]
    if all(x == FULL for x in flat):
        return [Call(0, local_len, 0, local_len, dense)]
    if all(x == NONE for x in flat):
        return []
    n = len(qc)
    # Causal over the concatenated local order (zigzag's diagonal step): one call.
    if (causal and window == (-1, -1) and rank == src and n > 1
            and all(kinds[i][j] == (FULL if i > j else NONE if i < j else PARTIAL)
                    for i in range(n) for j in range(n))):
        return [Call(0, local_len, 0, local_len, bk.BlockSpec(scale, causal=True, softcap=softcap))]
    # One key chunk seen fully by every query chunk, the others by none.
    for j in range(len(kc)):
        if all(kinds[i][j] == FULL for i in range(n)) and all(
                kinds[i][jj] == NONE for i in range(n) for jj in range(len(kc)) if jj != j):
            return [Call(0, local_len, kc[j][1], kc[j][1] + kc[j][2], dense)]
    calls = []
    for i, (qg, q0, ql) in enumerate(qc):
        row = kinds[i]
        if all(x == FULL for x in row):
            calls.append(Call(q0, q0 + ql, 0, local_len, dense))
            continue
        for j, (kg, k0, kl) in enumerate(kc):
            if row[j] == FULL:
                calls.append(Call(q0, q0 + ql, k0, k0 + kl, dense))
            elif row[j] == PARTIAL:
                call = masked_call(qg, q0, ql, kg, k0, kl, causal, window, scale, softcap)
                if call is not None:
                    calls.append(call)
    return calls


@functools.lru_cache(maxsize=1024)
def num_steps(layout: str, world: int, local_len: int, causal: bool, window) -> int:
    """Ring steps needed: the last step at which any rank has a block to compute."""
    return _steps(world, lambda r, src: plan(layout, r, src, world, local_len, causal, window, 1.0))


def _steps(world: int, calls_of) -> int:
    """1 + the last step s at which some rank r has calls on the block of rank r - s."""
    return 1 + max((s for s in range(world) if any(calls_of(r, (r - s) % world) for r in range(world))), default=0)


# ------------------------------------------------------------------ packed documents
def _lens(cu) -> list[int]:
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


@functools.lru_cache(maxsize=64)
def pieces(cu: tuple, layout: str, world: int, rank: int) -> tuple:
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
    return pieces(tuple(int(x) for x in cu), layout, world, 0)[1]


def chunk_cu(cu: tuple, chunk: int) -> tuple:
    """Document boundaries ``cu`` cut at every multiple of ``chunk`` positions
    inside each document (chunked attention's documents); ``chunk`` 0: ``cu``."""
    if not chunk:
        return cu
    out = [0]
    for a, b in zip(cu[:-1], cu[1:]):
        out += list(range(a + chunk, b, chunk)) + ([b] if b > a else [])
    return tuple(out)


@functools.lru_cache(maxsize=64)
def chunk_pieces(cu: tuple, layout: str, world: int, rank: int, chunk: int) -> tuple:
    """:func:`pieces` of the attention's documents: with ``chunk`` > 0 each
    document is cut at every multiple of ``chunk`` of its positions (chunked
    attention), so a piece that spans a chunk edge becomes one piece per
    chunk, whose document is ``(doc, chunk index)``; the tokens stay where
    the layout of ``cu`` put them. ``chunk`` 0: :func:`pieces`."""
    parts, _ = pieces(cu, layout, world, rank)
    if not chunk:
        return parts
    out = []
    for d, g, l0, _, n in parts:
        at = g
        while at < g + n:
            c = at // chunk
            end = min(g + n, (c + 1) * chunk)
            out.append(((d, c), at - c * chunk, l0 + at - g, end - at, end - at))
            at = end
    return tuple(out)


@functools.lru_cache(maxsize=256)
def plan_varlen(cu: tuple, layout: str, world: int, rank: int, src: int, causal: bool, window: tuple,
                scale: float, softcap: float = 0.0, chunk: int = 0) -> tuple:
    """Dense calls of ``rank`` on the K/V block of ``src``: same-document pairs
    only (same chunk of a document with ``chunk``, see :func:`chunk_pieces`)."""
    qp = chunk_pieces(cu, layout, world, rank, chunk)
    kp = chunk_pieces(cu, layout, world, src, chunk)
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
            if kind == FULL:
                calls.append(Call(q0, q0 + qn, k0, k0 + kn, bk.BlockSpec(scale, softcap=softcap)))
            elif kind == PARTIAL:
                call = masked_call(qg, q0, qn, kg, k0, kn, causal, window, scale, softcap)
                if call is not None:
                    calls.append(call)
    return tuple(calls)


@functools.lru_cache(maxsize=64)
def num_steps_varlen(cu: tuple, layout: str, world: int, causal: bool, window: tuple, chunk: int = 0) -> int:
    return _steps(world, lambda r, src: plan_varlen(cu, layout, world, r, src, causal, window, 1.0, 0.0, chunk))


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


def worth_fusing(calls, heads_x_dim: int, tuning: _tuning.RingVarlenTuning = _tuning.RING_VARLEN) -> bool:
    """Whether a step's document blocks run faster as one varlen launch than as one backend call each (cost model in ``tuning``:
    many short documents fuse, a few long ones run one cuDNN call each)."""
    flops = [4.0 * heads_x_dim * (c.q1 - c.q0) * (c.k1 - c.k0) * (0.5 if c.spec.causal else 1.0) for c in calls]
    t_calls = sum(max(tuning.call_seconds, f / tuning.call_flops) for f in flops)
    t_fused = 2 * tuning.call_seconds + sum(flops) / tuning.fused_flops
    return t_fused < t_calls
