"""Ring attention: exact attention over a sequence sharded on p ranks.

Each step sends this rank's current K/V block to the next rank and receives
the previous rank's (batched P2P, two buffers), while the local backend
attends to the block in hand; partial results merge by lse in float32.
Memory per rank stays O(seqlen / p): the local shard, one K/V block in
flight and the float32 accumulators. The ring carries only ``nheads_kv``
heads (GQA/MQA send 1/g of MHA's bytes).

Backward: K/V go round again, in the reverse order, starting on the block
the forward ended on (kept by the forward); each step's local backward uses
the merged output and lse (exact pieces of the full gradient); dK/dV
accumulate (float32 where a block has more than one other contributor) in
buffers that travel with their K/V and reach the owner at its last step.

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


def ring_forward(q, k, v, comm: _comm.P2P, plan_fn, steps: int, backend: str, keep_last: bool = False):
    """Generic ring forward: ``plan_fn(src)`` lists the dense calls this rank
    makes on the K/V block that started at ring position ``src``. Returns
    (out, lse, kv_last): with ``keep_last`` and more than one step,
    ``kv_last`` is the last K/V block received (ring position rank - steps +
    1) in tensors of its own, for :func:`ring_backward` to start on; else None."""
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
            comm.start([kc, vc], comm.rank + 1, comm.rank - 1, fresh=keep_last and s + 2 == steps)
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
    return out.to(q.dtype), lse, ((kc, vc) if keep_last and steps > 1 else None)


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


def _flat(calls) -> list:
    """Calls as the backward may run them (a fused executor can fall back to its plain blocks)."""
    return [x for c in calls for x in (c.run.calls if c.run is not None else [c])]


def ring_backward(dout, q, k, v, out, lse, dlse, comm: _comm.P2P, plan_fn, steps: int, backend: str,
                  kv_last=None):
    """Generic ring backward, in the reverse order of the forward.

    The forward ends holding the K/V block of ring position rank - steps + 1
    (``kv_last``, which the forward op saves); the backward starts on it and
    walks back towards its own block: step t works on the block of position
    rank - steps + 1 + t, then passes the block and its dK/dV sums to
    rank - 1, which works on that block next. So every block's sums end on
    their owner with the owner's own contribution, at the last step: no hop
    home and no hop before the first step. A two-step ring's one hop carries
    the other rank's pieces in the input dtype (summed with the owner's in
    float32 arithmetic, one rounding); longer rings pass float32 sums.
    Without ``kv_last`` (callers that do not save it) that block is fetched
    first, a hop nothing overlaps.
    """
    rank, size = comm.rank, comm.size
    first = rank - steps + 1
    plans = [list(plan_fn((first + t) % size)) for t in range(steps)]
    dkv_comm = _comm.exchange(comm.group, comm.peers, tag="dkv")
    # Rows with at most two dQ pieces are summed in the input dtype (copy, then one
    # add in float32 arithmetic: one rounding, as a float32 accumulator's cast).
    dq_dtype = q.dtype if _max_cover([_flat(p) for p in plans]) <= 2 else torch.float32
    dq, dq_written = None, []

    def run(calls, kc, vc):
        """Backward of ``calls``; dQ goes into the accumulator, (k0, k1, dK, dV) are returned."""
        nonlocal dq
        grads = []
        for c in calls:
            qs = slice(c.q0, c.q1)
            args = (dout[:, qs], q[:, qs], kc[:, c.k0:c.k1], vc[:, c.k0:c.k1], out[:, qs], lse[:, :, qs].contiguous())
            dl = None if dlse is None else dlse[:, :, qs].contiguous()
            g = c.run.backward(*args, dl) if c.run is not None else bk.block_backward(*args, c.spec, backend, dlse=dl)
            if g is None:
                grads += run(c.run.calls, kc, vc)
                continue
            dqb, dkb, dvb = g
            if dq is None and (c.q0, c.q1) == (0, q.shape[1]) and dqb.dtype == dq_dtype and dqb.stride() == q.stride():
                dq = dqb  # the first piece covers every row: it becomes the accumulator
                dq_written.append((0, q.shape[1]))
            else:
                if dq is None:
                    dq = torch.empty(q.shape, dtype=dq_dtype, device=q.device)
                _accumulate(dq, dq_written, c.q0, c.q1, dqb)
            grads.append((c.k0, c.k1, dkb, dvb))
        return grads

    def fresh_acc(grads):
        dk_acc = torch.empty(k.shape, dtype=torch.float32, device=q.device)
        dv_acc = torch.empty(v.shape, dtype=torch.float32, device=q.device)
        add(dk_acc, dv_acc, [], grads)
        return dk_acc, dv_acc

    def add(dk_acc, dv_acc, written, grads):
        kv_written = list(written)
        for k0, k1, dkb, dvb in grads:
            _accumulate(dk_acc, written, k0, k1, dkb)
            _accumulate(dv_acc, kv_written, k0, k1, dvb)
        _zero_unwritten(dk_acc, written)
        _zero_unwritten(dv_acc, kv_written)

    if steps > 1 and kv_last is None:
        comm.start([k, v], send_to=rank + steps - 1, recv_from=first, fresh=True)
        kv_last = comm.wait()
    kc, vc = kv_last if steps > 1 else (k, v)
    travel = None
    for t in range(steps):
        last = t == steps - 1
        if not last:
            comm.start([kc, vc], send_to=rank - 1, recv_from=rank + 1)
        grads = run(plans[t], kc, vc)
        if last:
            break
        if t == 0 and steps == 2 and _disjoint(grads):
            # the block's one contributor besides its owner: its pieces as the kernel returned them
            travel = (_assemble(grads, 2, k), _assemble(grads, 3, v))
        elif t == 0:
            travel = fresh_acc(grads)
        else:
            # this step's dK/dV go straight into the float32 sums that arrived from rank + 1
            travel = dkv_comm.wait()
            add(*travel, [(0, k.shape[1])], grads)
        del grads
        dkv_comm.start(list(travel), send_to=rank - 1, recv_from=rank + 1, fresh=t == steps - 2)
        del travel
        kc, vc = comm.wait()
    # ``grads``: the own block's pieces; the other contributors' sums arrive from rank + 1
    dq = _finish(dq, dq_written, [], q.dtype) if dq is not None else torch.zeros_like(q)
    if steps == 1:
        if _disjoint(grads) and all(g[2].dtype == k.dtype for g in grads):
            return dq, _assemble(grads, 2, k).contiguous(), _assemble(grads, 3, v).contiguous()
        dk_acc, dv_acc = fresh_acc(grads)
        return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)
    dk_in, dv_in = dkv_comm.wait()
    return dq, _home(dk_in, grads, 2, k.dtype), _home(dv_in, grads, 3, v.dtype)


def _home(incoming: torch.Tensor, own: list, i: int, dtype) -> torch.Tensor:
    """The owner's final dK (i=2) or dV (i=3) in ``dtype``: what came round the
    ring (float32 sums, or one contributor's pieces in the input dtype) plus
    its own pieces. Key-disjoint own pieces are added in the pass that writes
    the result (float32 arithmetic, one rounding); otherwise the incoming
    tensor is widened to float32 first, so no partial sum is rounded."""
    if incoming.dtype != torch.float32 and not _disjoint(own):
        incoming = incoming.float()
    return _finish(incoming, [(0, incoming.shape[1])], [(g[0], g[1], g[i]) for g in own], dtype)


def _dense_plan(layout, comm, l, causal, window, scale):
    return lambda src: plan(layout, comm.rank, src, comm.size, l, causal, window, scale)


def _forward(q, k, v, scale, causal, window, layout, group, backend):
    comm = _comm.exchange(group)
    l = q.shape[1]
    steps = num_steps(layout, comm.size, l, causal, window)
    out, lse, kv_last = ring_forward(q, k, v, comm, _dense_plan(layout, comm, l, causal, window, scale), steps,
                                     backend, keep_last=True)
    if kv_last is None:
        kv_last = (k.new_empty(0), v.new_empty(0))
    return out, lse, *kv_last


def _backward(dout, q, k, v, out, lse, dlse, k_last, v_last, scale, causal, window, layout, group, backend):
    comm = _comm.exchange(group)
    l = q.shape[1]
    steps = num_steps(layout, comm.size, l, causal, window)
    kv_last = (k_last, v_last) if k_last.numel() else None
    return ring_backward(dout, q, k, v, out, lse, dlse, comm, _dense_plan(layout, comm, l, causal, window, scale),
                         steps, backend, kv_last)


# ------------------------------------------------------------------ custom ops
# The forward also returns the last K/V block it received (empty when the ring
# has one step): the backward starts on it (see ring_backward). It is saved for
# the backward like q, k and v: one more local K/V block per call.
@torch.library.custom_op("longattn::ring_fwd", mutates_args=(), device_types=None)
def _ring_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window_left: int,
              window_right: int, layout: str, group_name: str, backend: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _comm.group_from_name(group_name)
    return _forward(q, k, v, scale, causal, (window_left, window_right), layout, g, backend)


@_ring_fwd.register_fake
def _(q, k, v, scale, causal, window_left, window_right, layout, group_name, backend):
    b, l, h, _ = q.shape
    world = _comm.group_from_name(group_name).size()
    # int(): the step count depends on the length and window, so a traced graph specialises on them
    kept = num_steps(layout, world, int(l), causal, (int(window_left), int(window_right))) > 1
    return (torch.empty_like(q), q.new_empty(b, h, l, dtype=torch.float32),
            torch.empty_like(k) if kept else k.new_empty(0), torch.empty_like(v) if kept else v.new_empty(0))


@torch.library.custom_op("longattn::ring_bwd", mutates_args=(), device_types=None)
def _ring_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dlse: Optional[torch.Tensor], k_last: torch.Tensor, v_last: torch.Tensor,
              scale: float, causal: bool, window_left: int, window_right: int, layout: str, group_name: str,
              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _comm.group_from_name(group_name)
    return _backward(dout, q, k, v, out, lse, dlse, k_last, v_last, scale, causal, (window_left, window_right),
                     layout, g, backend)


@_ring_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, k_last, v_last, scale, causal, window_left, window_right, layout, group_name,
      backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


register_attention_autograd(_ring_fwd, _ring_bwd, ("scale", "causal", "window_left", "window_right", "layout",
                                                  "group_name", "backend"), kept_outputs=2)


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
    out, lse, _, _ = _ring_fwd(q, k, v, scale, causal, window[0], window[1], layout, _comm.group_name(g), backend)
    return (out, lse) if return_lse else out
