"""Ring attention: exact attention over a sequence sharded on p ranks.

Each step sends this rank's current K/V block to the next rank and receives
the previous rank's (batched P2P, two buffers), while the local backend
attends to the block in hand; partial results merge by lse in float32.
Memory per rank stays O(seqlen / p): the local shard, one K/V block in
flight and the float32 accumulators. The ring carries only ``nheads_kv``
heads (GQA/MQA send 1/g of MHA's bytes).

Backward: K/V go round again; each step's local backward uses the merged
output and lse (exact pieces of the full gradient); dK/dV accumulate in
float32 in buffers that travel with their K/V and are sent home at the end.

Block planning: every rank holds one or two chunks of known global
position. For each (query chunk, key chunk) pair the planner decides: no
key visible (skip, no compute), all visible (plain dense call), or partial
(a masked call with the right position offset). Causal on the contiguous
layout skips the blocks above the diagonal; zigzag gives every rank the
same work at every step; sliding windows skip blocks outside the window and
stop the ring after the last step any rank needs.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

from .. import backends as bk
from .._merge import empty_state, merge_into
from .._ops import register_attention_autograd
from .._validation import check_flag, check_qkv, check_scale, check_window
from . import _comm
from .layout import check_layout, chunks

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


@functools.lru_cache(maxsize=4096)  # pure function of its arguments, called every step of every call
def plan(layout: str, rank: int, src: int, world: int, local_len: int, causal: bool, window, scale: float
         ) -> tuple[Call, ...]:
    """Dense calls rank ``rank`` makes on the K/V block of rank ``src``."""
    return tuple(_plan(layout, rank, src, world, local_len, causal, tuple(window), scale))


def _plan(layout, rank, src, world, local_len, causal, window, scale) -> list[Call]:
    qc = chunks(layout, rank, world, local_len)
    kc = chunks(layout, src, world, local_len)
    kinds = [[classify(qg, ql, kg, kl, causal, window) for kg, _, kl in kc] for qg, _, ql in qc]
    dense = bk.BlockSpec(scale)
    flat = [x for row in kinds for x in row]
    if all(x == FULL for x in flat):
        return [Call(0, local_len, 0, local_len, dense)]
    if all(x == NONE for x in flat):
        return []
    n = len(qc)
    # Causal over the concatenated local order (zigzag's diagonal step): one call.
    if (causal and window == (-1, -1) and rank == src and n > 1
            and all(kinds[i][j] == (FULL if i > j else NONE if i < j else PARTIAL) for i in range(n) for j in range(n))):
        return [Call(0, local_len, 0, local_len, bk.BlockSpec(scale, causal=True))]
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
            if row[j] == NONE:
                continue
            spec = dense if row[j] == FULL else bk.BlockSpec(scale, causal, tuple(window), qg - kg)
            calls.append(Call(q0, q0 + ql, k0, k0 + kl, spec))
    return calls


@functools.lru_cache(maxsize=1024)
def num_steps(layout: str, world: int, local_len: int, causal: bool, window) -> int:
    """Ring steps needed: the last step at which any rank has a block to compute."""
    last = 0
    for s in range(world):
        if any(plan(layout, r, (r - s) % world, world, local_len, causal, window, 1.0) for r in range(world)):
            last = s
    return last + 1


def _gaps(written: list, a: int, b: int) -> list:
    """Sub-ranges of rows [a, b) that no range in ``written`` covers."""
    gaps, pos = [], a
    for lo, hi in sorted(written):
        if hi <= pos or lo >= b:
            continue
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    if pos < b:
        gaps.append((pos, b))
    return gaps


def _accumulate(acc: torch.Tensor, written: list, a: int, b: int, x: torch.Tensor) -> None:
    """acc[:, a:b] += x on an accumulator made with ``torch.empty``: rows no
    earlier call wrote (``written``, updated here) are copied, not added, so
    the buffer needs no zero-fill pass."""
    gaps = _gaps(written, a, b)
    if gaps == [(a, b)]:
        acc[:, a:b] = x
    else:
        for lo, hi in gaps:
            acc[:, lo:hi] = 0
        acc[:, a:b] += x
    written.append((a, b))


def _zero_unwritten(acc: torch.Tensor, written: list) -> None:
    for lo, hi in _gaps(written, 0, acc.shape[1]):
        acc[:, lo:hi] = 0


def _finish(acc: torch.Tensor, written: list, last: list, dtype) -> torch.Tensor:
    """The sum in ``dtype`` of the float32 accumulator (rows ``written`` hold
    sums, the others count as 0) and the pieces ``last = [(a, b, x)]`` (rows
    [a, b)). A piece over rows that already hold sums and that no other piece
    overlaps is added in the cast's pass (float32 arithmetic, one rounding);
    the others are accumulated first."""
    alone = [(a, b, x) for i, (a, b, x) in enumerate(last)
             if not _gaps(written, a, b) and all(b <= a2 or b2 <= a for j, (a2, b2, _) in enumerate(last) if j != i)]
    for a, b, x in last:
        if all(x is not y for _, _, y in alone):
            _accumulate(acc, written, a, b, x)
    _zero_unwritten(acc, written)
    if not alone:
        return acc.to(dtype)
    res = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    for a, b, x in alone:
        torch.add(acc[:, a:b], x, out=res[:, a:b])
    for lo, hi in _gaps([(a, b) for a, b, _ in alone], 0, acc.shape[1]):
        res[:, lo:hi] = acc[:, lo:hi]
    return res


def _max_cover(plans: list) -> int:
    """Most partial results any query row receives over the whole ring."""
    ev = sorted([(c.q0, 1) for calls in plans for c in calls] + [(c.q1, -1) for calls in plans for c in calls])
    most = depth = 0
    for _, d in ev:  # at equal positions ends (-1) sort before starts
        depth += d
        most = max(most, depth)
    return most


def ring_forward(q, k, v, comm: _comm.P2P, plan_fn, steps: int, backend: str):
    """Generic ring forward: ``plan_fn(src)`` lists the dense calls this rank
    makes on the K/V block that started at ring position ``src``."""
    l = q.shape[1]
    plans = [list(plan_fn((comm.rank - s) % comm.size)) for s in range(steps)]
    # Rows merged at most once (every 2-step ring, zigzag's diagonal included)
    # keep the output dtype: the first partial is already rounded to it and the
    # one merge (float32 arithmetic) rounds once, as a float32 accumulator's
    # final cast would. More merges accumulate in float32.
    acc_dtype = q.dtype if _max_cover(plans) <= 2 else torch.float32
    triton = q.is_cuda  # one fused merge pass per block; CPU keeps torch's (the interpreter is slow)
    out = lse = None
    kc, vc = k, v
    written = []  # row ranges that already hold a partial result
    for s in range(steps):
        if s + 1 < steps:
            comm.ring([kc, vc])
        for c in plans[s]:
            args = (q[:, c.q0:c.q1], kc[:, c.k0:c.k1], vc[:, c.k0:c.k1])
            ob, lb = c.run.forward(*args) if c.run is not None else bk.block_forward(*args, c.spec, backend)
            if out is None and (c.q0, c.q1) == (0, l):
                # the first block covers every row: it becomes the accumulator (no zero-fill, no copy
                # where the dtype agrees)
                out, lse = ob.to(acc_dtype), lb.contiguous()
                written.append((0, l))
                continue
            if out is None:
                out, lse = empty_state(q, acc_dtype)
            if any(w0 < c.q1 and c.q0 < w1 for w0, w1 in written):
                merge_into(out[:, c.q0:c.q1], lse[:, :, c.q0:c.q1].transpose(1, 2), ob, lb.transpose(1, 2),
                           use_triton=triton)
            else:  # first result for these rows: a copy, not a merge with the empty state
                out[:, c.q0:c.q1] = ob
                lse[:, :, c.q0:c.q1] = lb
                written.append((c.q0, c.q1))
        if s + 1 < steps:
            kc, vc = comm.wait()
    if out is None:  # no block had a visible key: every row is empty
        out, lse = empty_state(q, q.dtype)
    return out.to(q.dtype), lse


# Own-block work held back to the end of the backward, to cover the final float32 dK/dV
# hop of a ring of 3+ steps; calls with fewer query rows are not split (two launches
# cost more than the hop). A 2-step ring's hop carries the input dtype and is not
# covered: splitting measured no faster there and held ~100 MiB more at 32K on 2 GPUs.
HOLD_BACK_MIN_ROWS = int(os.environ.get("LONGATTN_RING_HOLD_BACK_MIN_ROWS", 2048))


def _hold_back(calls: list) -> tuple[list, list]:
    """Split step 0's calls (this rank's own K/V block) into the work done
    first and a piece done last, while the accumulated dK/dV of the other
    blocks travel their final hop home (the own block's gradient comes back
    on that hop, so the piece's dK/dV are added after it).

    The largest call gives up its first half of query rows. Every piece keeps
    a mask cuDNN runs (no mask, or causal on a square block): a causal
    diagonal of n rows becomes the causal square [0, n/2) held back, then the
    full block rows [n/2, n) x keys [0, n/2) and the causal square [n/2, n)
    first. Other masked calls (windows, offset causal blocks) stay whole.
    """
    if not calls:
        return calls, []
    big = max(calls, key=lambda c: (c.q1 - c.q0) * (c.k1 - c.k0))
    n, sp = big.q1 - big.q0, big.spec
    if n < HOLD_BACK_MIN_ROWS or big.run is not None:
        return calls, []
    h = n // 2
    if not sp.masked:
        early = [Call(big.q0 + h, big.q1, big.k0, big.k1, sp)]
        late = [Call(big.q0, big.q0 + h, big.k0, big.k1, sp)]
    elif sp.causal and not sp.has_window and sp.q_offset == 0 and big.k1 - big.k0 == n:
        full = bk.BlockSpec(sp.scale)
        early = [Call(big.q0 + h, big.q1, big.k0, big.k0 + h, full),
                 Call(big.q0 + h, big.q1, big.k0 + h, big.k1, sp)]
        late = [Call(big.q0, big.q0 + h, big.k0, big.k0 + h, sp)]
    else:
        return calls, []
    i = calls.index(big)
    return calls[:i] + early + calls[i + 1:], late


def _disjoint(grads: list) -> bool:
    """Pieces over distinct key rows, one dtype: they assemble without arithmetic."""
    spans = sorted((k0, k1) for k0, k1, _, _ in grads)
    return (all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
            and len({g[i].dtype for g in grads for i in (2, 3)}) <= 1)


def _assemble(grads: list, i: int, like: torch.Tensor) -> torch.Tensor:
    """The pieces ``grads[*][i]`` (key-disjoint) as one tensor shaped like
    ``like``, in their own dtype: no arithmetic, so nothing is rounded."""
    pieces = [(g[0], g[1], g[i]) for g in grads]
    if len(pieces) == 1 and pieces[0][:2] == (0, like.shape[1]):
        return pieces[0][2]
    res = torch.empty(like.shape, dtype=pieces[0][2].dtype if pieces else like.dtype, device=like.device)
    for k0, k1, x in pieces:
        res[:, k0:k1] = x
    _zero_unwritten(res, [(k0, k1) for k0, k1, _ in pieces])
    return res


def ring_backward(dout, q, k, v, out, lse, dlse, comm: _comm.P2P, plan_fn, steps: int, backend: str):
    """Generic ring backward; a second exchange object carries dK/dV.

    Step s works on the K/V block that started on ring position rank - s with
    that block's float32 dK/dV accumulator, then passes both on; after the last
    step each accumulator is one hop from its owner, and part of the own
    block's work (``_hold_back``) runs during that hop. A two-step ring has one
    contributor per block besides its owner: the own sums stay home, and the
    contributor's pieces go home as the kernel returned them (the input dtype:
    a quarter of the float32 bytes of two hops) to be summed with them in
    float32 arithmetic, one rounding.
    """
    dkv_comm = _comm.exchange(comm.group, comm.peers, tag="dkv")
    rank = comm.rank
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq_written = []

    def run(calls, kc, vc, dq_pieces=None):
        """Backward of ``calls``; returns their (k0, k1, dK, dV). dQ goes into the
        accumulator, or into ``dq_pieces`` (q0, q1, dQ) when given."""
        grads = []
        for c in calls:
            qs = slice(c.q0, c.q1)
            args = (dout[:, qs], q[:, qs], kc[:, c.k0:c.k1], vc[:, c.k0:c.k1], out[:, qs], lse[:, :, qs].contiguous())
            dl = None if dlse is None else dlse[:, :, qs].contiguous()
            g = c.run.backward(*args, dl) if c.run is not None else bk.block_backward(*args, c.spec, backend, dlse=dl)
            if g is None:
                grads += run(c.run.calls, kc, vc, dq_pieces)
                continue
            dqb, dkb, dvb = g
            if dq_pieces is None:
                _accumulate(dq, dq_written, c.q0, c.q1, dqb)
            else:
                dq_pieces.append((c.q0, c.q1, dqb))
            grads.append((c.k0, c.k1, dkb, dvb))
        return grads

    def add(dk_acc, dv_acc, written, grads):
        kv_written = list(written)
        for k0, k1, dkb, dvb in grads:
            _accumulate(dk_acc, written, k0, k1, dkb)
            _accumulate(dv_acc, kv_written, k0, k1, dvb)

    def fresh_acc(grads):
        dk_acc = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        dv_acc = torch.empty(v.shape, dtype=torch.float32, device=q.device)
        written = []
        add(dk_acc, dv_acc, written, grads)
        _zero_unwritten(dk_acc, written)
        _zero_unwritten(dv_acc, written)
        return dk_acc, dv_acc

    kc, vc = k, v
    own = travel = None
    late = []
    whole = [(0, k.shape[1])]
    for s in range(steps):
        if s + 1 < steps:
            comm.ring([kc, vc])
        calls = list(plan_fn((rank - s) % comm.size))
        if s == 0 and steps > 2:
            calls, late = _hold_back(calls)
        grads = run(calls, kc, vc)
        if s == 0:
            # the own block's sums: kept home in a 2-step ring, else they ride the ring
            # (one float32 pair per rank instead of two)
            acc = fresh_acc(grads)
            own, travel = (acc, None) if steps == 2 else (None, acc)
        elif steps == 2:
            travel = (_assemble(grads, 2, k), _assemble(grads, 3, v)) if _disjoint(grads) else fresh_acc(grads)
        else:
            # this step's dK/dV go straight into the float32 accumulators that arrived from the
            # previous rank (no per-step staging buffer: one pass each)
            travel = dkv_comm.wait()
            add(*travel, list(whole), grads)
        del grads
        if s + 1 < steps and steps > 2:
            dkv_comm.ring(list(travel))
        if s + 1 < steps:
            kc, vc = comm.wait()
    dq_last = []
    if steps == 1:
        return _finish(dq, dq_written, dq_last, q.dtype), travel[0].to(k.dtype), travel[1].to(v.dtype)
    # The travelling dK/dV hold ring position (rank - steps + 1)'s gradient: send them home.
    home, back = rank - steps + 1, rank + steps - 1
    if steps > 2 and not late:
        # the sums are final and nothing overlaps the hop: it carries the input dtype (half the bytes)
        dkv_comm.start([travel[0].to(k.dtype), travel[1].to(v.dtype)], send_to=home, recv_from=back, fresh=True)
        del travel
        dk_out, dv_out = dkv_comm.wait()
        return _finish(dq, dq_written, dq_last, q.dtype), dk_out, dv_out
    dkv_comm.start(list(travel), send_to=home, recv_from=back, fresh=True)
    del travel
    grads = run(late, k, v, dq_last) if late else []
    dk_in, dv_in = dkv_comm.wait()
    if steps == 2:
        # one pass each: the own float32 sums + the one contributor's pieces, rounded once
        dk_out = _finish(own[0], list(whole), [(0, k.shape[1], dk_in)], k.dtype)
        dv_out = _finish(own[1], list(whole), [(0, v.shape[1], dv_in)], v.dtype)
    else:
        # the float32 sums came home; the held-back pieces are added in the pass that casts
        dk_out = _finish(dk_in, list(whole), [(a, b, dkb) for a, b, dkb, _ in grads], k.dtype)
        dv_out = _finish(dv_in, list(whole), [(a, b, dvb) for a, b, _, dvb in grads], v.dtype)
    return _finish(dq, dq_written, dq_last, q.dtype), dk_out, dv_out


def _dense_plan(layout, comm, l, causal, window, scale):
    return lambda src: plan(layout, comm.rank, src, comm.size, l, causal, window, scale)


def _forward(q, k, v, scale, causal, window, layout, group, backend):
    comm = _comm.exchange(group)
    l = q.shape[1]
    steps = num_steps(layout, comm.size, l, causal, window)
    return ring_forward(q, k, v, comm, _dense_plan(layout, comm, l, causal, window, scale), steps, backend)


def _backward(dout, q, k, v, out, lse, dlse, scale, causal, window, layout, group, backend):
    comm = _comm.exchange(group)
    l = q.shape[1]
    steps = num_steps(layout, comm.size, l, causal, window)
    return ring_backward(dout, q, k, v, out, lse, dlse, comm, _dense_plan(layout, comm, l, causal, window, scale),
                         steps, backend)


# ------------------------------------------------------------------ custom ops
@torch.library.custom_op("longattn::ring_fwd", mutates_args=(), device_types=None)
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window_left: int,
              window_right: int, layout: str, group_name: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = _comm.group_from_name(group_name)
    return _forward(q, k, v, scale, causal, (window_left, window_right), layout, g, backend)


@_ring_fwd.register_fake
def _(q, k, v, scale, causal, window_left, window_right, layout, group_name, backend):
    b, l, h, _ = q.shape
    return torch.empty_like(q), q.new_empty(b, h, l, dtype=torch.float32)


@torch.library.custom_op("longattn::ring_bwd", mutates_args=(), device_types=None)
def _ring_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dlse: Optional[torch.Tensor], scale: float, causal: bool, window_left: int,
              window_right: int, layout: str, group_name: str, backend: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _comm.group_from_name(group_name)
    return _backward(dout, q, k, v, out, lse, dlse, scale, causal, (window_left, window_right), layout, g, backend)


@_ring_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale, causal, window_left, window_right, layout, group_name, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_ring_fwd, _ring_bwd, ("scale", "causal", "window_left", "window_right", "layout",
                                                  "group_name", "backend"))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                   layout: str = "contiguous", return_lse: bool = False, backend: str = "auto", group=None):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)``.
        k, v: ``(batch, seqlen_local, nheads_kv, headdim)`` (GQA/MQA: only the kv
            heads travel the ring).
        causal, softmax_scale, window_size: as :func:`longattn.attention`, in
            global positions of the unsharded sequence.
        layout: how the sequence was split (see :func:`longattn.shard`):
            ``"contiguous"`` (rank r holds chunk r of p) or ``"zigzag"`` (chunks r
            and 2p-1-r of 2p; balanced causal work).
        return_lse: also return lse ``(batch, nheads, seqlen_local)`` float32.
        backend: local kernel for each block (see :mod:`longattn.backends`).
        group: a ProcessGroup (default WORLD); any size, sub-groups allowed.

    Returns:
        This rank's shard of the output (and lse). ``unshard(out)`` equals
        ``longattn.attention`` on the unsharded q, k, v.

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.attention(full(q), full(k), full(v), causal=causal), layout=layout)
    """
    check_qkv(q, k, v, same_seqlen=True)
    check_flag(causal, "causal")
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    window = check_window(window_size)
    check_layout(layout)
    bk.check_backend_name(backend)
    g = _comm.resolve_group(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    scale = bk.default_scale(q.shape[-1], softmax_scale)
    if not torch.compiler.is_compiling():
        _comm.check_consistent(g, "ring_attention", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                               causal=causal, window=window, layout=layout, scale=scale, backend=backend)
    out, lse = _ring_fwd(q, k, v, scale, causal, window[0], window[1], layout, _comm.group_name(g), backend)
    return (out, lse) if return_lse else out
