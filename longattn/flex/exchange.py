"""The exchange engine of ``ring_flex_attention``: sparse K/V halos and
shipped query rows in place of the ring, exact.

A ring passes every rank's whole K/V shard round, so a pattern with a few
dense rows (global tokens) runs every step at full bandwidth. Here every rank
plans, without communication, each ordered pair (queries of r, keys of s)
from the block table of r's rows against s's keys (``plan.block_table`` at
128-key blocks, query blocks of the executor's sparse block):

* heavy query blocks of r against s: more than ``heavy_fraction`` of s's key
  blocks visible (and at least ``heavy_min_blocks``), where shipping them
  moves fewer bytes than fetching the key blocks only they see
  (``ship_ratio``; :class:`longattn.tuning.FlexExchangeTuning`). r ships
  those rows to s, which computes them against all its keys and returns a
  partial (out, lse);
* needed key blocks of s for r: seen by a non-heavy query block of r. s
  ships those K/V rows (the halo) to r, which computes its rows against them
  with the heavy blocks cleared from that table (s computes those pairs).

Every (row, key) pair is computed exactly once; partials merge by lse in
float32 as in the ring. The backward ships the heavy rows' dout, the MERGED
out, lse and dlse; each executor's backward from the merged statistics gives
its exact share of dq, dk, dv, and the halo's dk/dv and the shipped rows' dq
return to their owners. Three ``all_to_all_single`` per pass, each one byte
buffer of whatever it carries (skipped where no rank moves any such rows),
one in flight at a time, on gloo and NCCL alike.

Executors: FA4 with the pattern's form at the pieces' global positions where
FA4 runs the pattern, else :class:`TorchPiece` (dense scores: small shapes).
:func:`choose_engine` is the one decision between this engine and the ring.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import tuning as tn
from .._merge import merge_
from ..distributed import checks
from . import blocks, fa4
from . import plan as fp
from .schedule import RING_PLANS, pattern_key

ENGINES = ("auto", "ring", "exchange")


def check_engine(engine) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: choose one of {ENGINES} ('auto' picks the exchange where it moves "
                         f"fewer bytes than the ring)")


def choose_engine(engine: str, cannot: list, facts: Callable[[], tuple],
                  tuning: tn.FlexExchangeTuning = tn.FLEX_EXCHANGE, world: Optional[int] = None) -> str:
    """The engine of a ``ring_flex_attention`` call: "ring" or "exchange" (the one decision).

    ``cannot``: why the exchange cannot run this call, known without
    planning (the same on every rank); ``facts()`` -> (why it cannot, found by
    planning; why it would run the dense PyTorch executor, where ``auto``
    keeps the ring; the most bytes a rank of the exchange sends; the ring's
    per rank), forward + backward, agreed by every rank: called only where
    needed (it plans, with collectives on first use, on every rank alike).
    Where the exchange cannot run, ``engine="exchange"`` raises ValueError.
    ``auto`` on fewer than ``tuning.min_world`` ranks (``world``) keeps the
    ring without planning."""
    check_engine(engine)
    if engine == "ring" or (engine == "auto" and world is not None and world < tuning.min_world):
        return "ring"
    cannot = cannot or facts()[0]
    if cannot:
        if engine == "exchange":
            raise ValueError(f"engine='exchange' cannot run this call: {'; '.join(cannot)}. Use engine='ring' "
                             f"or 'auto'")
        return "ring"
    if engine == "exchange":
        return "exchange"
    _, dense, sent, ring = facts()
    if dense:
        return "ring"
    return "exchange" if sent < tuning.max_traffic * ring else "ring"


class TorchPiece:
    """Masked attention in plain PyTorch (float32 math, float64 for float64
    inputs) of queries against keys under a dense mask (Bm, Hm, Lq, Lk) from
    ``make_mask()`` (made on first use): the exchange's executor where FA4 does
    not run (CPU, tests). It materialises the mask and the scores: for
    correctness at small sizes, not for speed. ``forward`` -> (out, lse (B, H,
    Lq) natural log, -inf where a row sees no key); ``backward`` from the given
    (merged) out, lse and dlse."""

    def __init__(self, make_mask: Callable[[], torch.Tensor], scale: float):
        self.make_mask, self.mask, self.scale = make_mask, None, scale

    def _probs(self, q, k, lse=None):
        if self.mask is None:
            self.mask = self.make_mask()
        dt = torch.promote_types(q.dtype, torch.float32)
        kk = k.to(dt).repeat_interleave(q.shape[2] // k.shape[2], 2)
        s = (torch.einsum("bqhd,bkhd->bhqk", q.to(dt), kk) * self.scale).masked_fill(~self.mask, float("-inf"))
        lse = torch.logsumexp(s, -1) if lse is None else lse.to(dt)
        return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse, kk, dt  # rows with no key: -inf - -inf -> 0

    def forward(self, q, k, v):
        p, lse, _, dt = self._probs(q, k)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(dt).repeat_interleave(q.shape[2] // v.shape[2], 2))
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, dlse):
        p, _, kk, dt = self._probs(q, k, lse)
        g = q.shape[2] // k.shape[2]
        do = dout.to(dt)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, v.to(dt).repeat_interleave(g, 2))
        delta = (do * out.to(dt)).sum(-1).transpose(1, 2)
        if dlse is not None:  # d lse adds p * dlse to dS
            delta = delta - dlse.to(dt)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * self.scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(dt)) * self.scale
        heads = lambda x: x.view(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)  # GQA: sum each group's heads
        return dq.to(q.dtype), heads(dk).to(k.dtype), heads(dv).to(v.dtype)


def _rows(idx: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """Local rows (int64, ascending) of the listed blocks of ``block`` rows."""
    r = (idx[:, None].long() * block + torch.arange(block, device=idx.device)).flatten()
    return r[r < length]


def _executor(mask_mod, qpos, kpos, batch, heads, scale, cap: Optional[int], clear=None):
    """The executor of (queries at global ``qpos``) x (keys at ``kpos``), the
    query blocks ``clear`` (of the plan's query block) removed; FA4 where
    ``cap`` (its major compute capability) is given; None where nothing is visible."""
    if len(qpos) == 0 or len(kpos) == 0:
        return None
    block = blocks.sparse_block(cap, len(qpos)) if cap is not None else fp.BLOCK_SIZE
    table = fp.block_table(mask_mod, batch, heads, qpos, kpos, block)
    if clear is not None:
        table = fp.BlockTable(table.partial.clone(), table.full.clone())
        table.partial[:, :, clear] = False
        table.full[:, :, clear] = False
    if table.empty:
        return None
    if cap is None:
        def make_mask():
            m = torch.ones(1, 1, len(qpos), len(kpos), dtype=torch.bool, device=qpos.device) if mask_mod is None \
                else fp.evaluate(mask_mod, fp.mask_dims(mask_mod, batch, heads, qpos, kpos), qpos, kpos).clone()
            if clear is not None:
                m[:, :, _rows(clear, fp.BLOCK_SIZE, len(qpos))] = False
            return m
        return TorchPiece(make_mask, scale)
    # no mask: an unbounded window is true at every position (FA4's block sparsity, which the cleared blocks
    # need, runs with a mask); the table's blocks are all full, so it is never evaluated
    inner = blocks.form("window", -1, -1) if mask_mod is None else mask_mod.fa4
    f = blocks.form("at_positions", tensors=(qpos, kpos), parts=(inner,))
    step = fa4.Step(table, block, f, blocks.aux_tensors(f, qpos.device), blocks.sparse_tensors(table), False)
    return fa4.RingStep(step, scale, len(qpos), len(kpos))


@dataclasses.dataclass
class ExchangePlan:
    """One rank's exchange, per peer p (rank order; empty for itself):
    ``ship[p]`` my rows computed on p, ``q_in[p]`` rows p ships to me,
    ``halo_send[p]`` my key rows p needs, ``halo_in[p]`` key rows p sends me;
    executors ``own`` (my rows x my keys), ``halo[p]`` (my rows x p's halo,
    my heavy blocks against p cleared), ``serve[p]`` (p's shipped rows x my
    keys). ``traffic``: (most bytes a rank sends, the ring's per rank),
    forward + backward; ``moves_q`` / ``moves_kv``: any rank ships query
    rows / K/V; ``dense``: why the executors would be the dense PyTorch ones
    on a GPU (empty: FA4 runs them, or the CPU); ``cannot``: why the
    ranks' plans do not fit together (empty: they do)."""

    ship: list
    q_in: list
    halo_send: list
    halo_in: list
    own: object
    halo: list
    serve: list
    traffic: tuple
    moves_q: bool
    moves_kv: bool
    dense: list
    cannot: list


def _split(t: fp.BlockTable, tuning: tn.FlexExchangeTuning, bq: int, ship_row: int, fetch_row: int):
    """(heavy query blocks, needed key blocks) of one pair's table, over every
    batch row and head. The heavy blocks are shipped only where their rows'
    bytes (``ship_row`` each, both ways) stay under ``ship_ratio`` of the
    bytes of the key blocks only they see (``fetch_row`` a key, both ways):
    rows that share the key blocks they see (a long document across a shard
    edge) are cheaper served by one halo."""
    vis = (t.partial | t.full).flatten(0, 1).any(0)
    cnt = vis.sum(1)
    heavy = (cnt > tuning.heavy_fraction * vis.shape[1]) & (cnt >= tuning.heavy_min_blocks)
    need = vis[~heavy].any(0)
    saved = int((vis[heavy].any(0) & ~need).sum()) * fp.BLOCK_SIZE * fetch_row
    if int(heavy.sum()) * bq * ship_row >= tuning.ship_ratio * saved:
        heavy, need = torch.zeros_like(heavy), vis.any(0)
    return heavy.nonzero().flatten(), need.nonzero().flatten()


def _build(q, k, mask_mod, layout, scale, rank, world, cap, tuning):
    """This rank's plan (no communication) and its (bytes sent, ring steps it needs, q rows, halo rows)."""
    b, length, h, d = q.shape
    dev, hkv = q.device, k.shape[2]
    pos = [fp.global_positions(layout, r, world, length, dev) for r in range(world)]
    bq = blocks.sparse_block(cap, length)[0] if cap is not None else fp.BLOCK_SIZE
    es = q.element_size()
    q_row, kv_row, lse_row = b * h * d * es, 2 * b * hkv * d * es, b * h * 4
    # a shipped row: q, dout and out there, out and dq back, 3 lse; a fetched key: K/V there, dK/dV back
    split = lambda r, s: _split(fp.block_table(mask_mod, b, h, pos[r], pos[s], (bq, fp.BLOCK_SIZE)), tuning, bq,
                                5 * q_row + 3 * lse_row, 2 * kv_row)
    none = torch.zeros(0, dtype=torch.long, device=dev)
    ship, q_in, halo_send, halo_in = ([none] * world for _ in range(4))
    halo, serve, need = [None] * world, [None] * world, 0
    for p in range(world):
        if p == rank:
            continue
        heavy, keys = split(rank, p)  # my rows against p's keys
        ship[p], halo_in[p] = _rows(heavy, bq, length), _rows(keys, fp.BLOCK_SIZE, length)
        halo[p] = _executor(mask_mod, pos[rank], pos[p][halo_in[p]], b, h, scale, cap, clear=heavy)
        if len(heavy) or len(keys):  # the ring step at which p's block visits is needed
            need = max(need, (rank - p) % world + 1)
        heavy, keys = split(p, rank)  # p's rows against my keys
        q_in[p], halo_send[p] = _rows(heavy, bq, length), _rows(keys, fp.BLOCK_SIZE, length)
        serve[p] = _executor(mask_mod, pos[p][q_in[p]], pos[rank], b, h, scale, cap)
    own = _executor(mask_mod, pos[rank], pos[rank], b, h, scale, cap)
    n = lambda xs: sum(len(x) for x in xs)
    # forward: my rows out, my halo out, partials back; backward: dout + out + lse + dlse out, dq back, halo dk/dv back
    sent = (n(ship) * (q_row + 2 * q_row + 2 * lse_row) + n(halo_send) * kv_row
            + n(q_in) * (2 * q_row + lse_row) + n(halo_in) * kv_row)
    plan = ExchangePlan(ship, q_in, halo_send, halo_in, own, halo, serve, (), False, False, [], [])
    return plan, [sent, max(need, 1), n(ship), n(halo_send)]


def plan_for(q, k, mask_mod, score_mod, layout: str, scale: float, group, kernel: str, engine: str,
             tuning: tn.FlexExchangeTuning = tn.FLEX_EXCHANGE) -> Optional[ExchangePlan]:
    """The exchange plan of this call, or None where :func:`choose_engine`
    picks the ring. Planned once per (shape, pattern, layout, group, kernel,
    tuning) and cached; on first use two small collectives: every rank's
    planning agreed (a failure on one rank raises on every rank) and every
    rank's traffic and query block."""
    cannot = ["score_mod is given: the exchange's executors take masks only"] if score_mod is not None else []
    key = ("exchange", pattern_key(mask_mod), scale, tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), layout,
           checks.group_name(group), dist.get_world_size(group), dist.get_rank(group), kernel, tuning)

    def make():
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        problem, plan, stats, use_fa4 = None, None, [0, 1, 0, 0], False
        try:  # FA4's choice reads the machine: inside the agreement, as the planning
            use_fa4 = fa4.choose(q, k, k, mask_mod, score_mod, kernel) == "fa4"
            cap = fa4.KERNEL.capability(q.device)[0] if use_fa4 else None
            plan, stats = _build(q, k, mask_mod, layout, scale, rank, world, cap, tuning)
        except Exception as e:  # noqa: BLE001 - raised by agree, on this rank; the others name it
            problem = e
        checks.agree(group, "ring_flex_attention (planning the exchange)", problem)
        bq = blocks.sparse_block(cap, q.shape[1])[0] if use_fa4 else fp.BLOCK_SIZE
        t = torch.tensor(stats + [bq, use_fa4], dtype=torch.int64, device=q.device)
        got = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(got, t, group=group)
        sent, steps, nq, nkv, bqs, fa4s = zip(*torch.stack(got).cpu().tolist())
        kv_shard = 2 * k.numel() * k.element_size()
        plan.traffic = (max(sent), 3 * (max(steps) - 1) * kv_shard)  # the ring: K/V forward, K/V and dK/dV back
        plan.moves_q, plan.moves_kv = sum(nq) > 0, sum(nkv) > 0
        # heavy blocks are planned at the query block on both sides of a pair: every rank's must match
        plan.cannot = [] if len(set(bqs)) == 1 else [f"the ranks' query blocks differ ({list(bqs)} rows: FA4 on "
                                                     f"some GPUs, not on others)"]
        plan.dense = [] if min(fa4s) or q.device.type == "cpu" else [
            "FA4 does not run this pattern on every rank and the exchange's PyTorch executor materialises scores"]
        return plan
    plan = None

    def facts():
        nonlocal plan
        plan = RING_PLANS.get_or(key, make)
        return (plan.cannot, plan.dense, *plan.traffic)
    if choose_engine(engine, cannot, facts, tuning, dist.get_world_size(group)) == "ring":
        return None
    facts()
    return plan


# ---------------------------------------------------------------------------- the exchange
def _spec(t: torch.Tensor) -> tuple:
    return tuple(t.shape[2:]), t.dtype


def _width(specs, batch: int) -> int:
    return sum(batch * math.prod(tail) * dt.itemsize for tail, dt in specs)


def _unpack(buf: torch.Tensor, counts: list, specs: list, batch: int) -> list:
    """Per peer, the tensors (B, n, ...) of ``specs`` from its rows of a received byte buffer."""
    res, off = [], 0
    for n in counts:
        rows, col, ts = buf[off:off + n], 0, []
        for tail, dt in specs:
            w = _width([(tail, dt)], batch)
            x = rows[:, col:col + w].contiguous().view(dt).view(n, batch, *tail)
            ts.append(x.transpose(0, 1).contiguous())
            col += w
        res.append(ts)
        off += n
    return res


class _Exchange:
    """One ``all_to_all_single`` of rows: ``parts[p]``, tensors (B, n_p, ...)
    of ``specs`` sharing their rows, go to peer p as one byte buffer (one
    collective whatever their dtypes); ``counts[p]`` rows come from p. None
    runs where ``active`` is False (no rank moves any row). Callers keep at
    most one in flight: gloo can pair the messages of two concurrent
    collectives wrongly."""

    def __init__(self, parts: list, counts: list, specs: list, batch: int, group, active: bool, device):
        self.counts, self.specs, self.batch, self.work = counts, specs, batch, None
        width = _width(specs, batch)
        rows = [torch.cat([t.transpose(0, 1).contiguous().view(torch.uint8).reshape(t.shape[1], -1) for t in ts], 1)
                if ts and ts[0].shape[1] else torch.empty(0, width, dtype=torch.uint8, device=device) for ts in parts]
        self.buf = torch.empty(sum(counts), width, dtype=torch.uint8, device=device)
        if active:
            self.work = dist.all_to_all_single(self.buf, torch.cat(rows), list(counts), [len(r) for r in rows],
                                               group=group, async_op=True)

    def wait(self) -> list:
        if self.work is not None:
            self.work.wait()
        return _unpack(self.buf, self.counts, self.specs, self.batch)


def _merge_rows(out, lse, rows, o, l_):
    """Merge a partial (o (B, n, H, D), l (B, H, n)) into ``rows`` (None: all) of the float32 (out, lse (B, L, H))."""
    if rows is None:
        merge_(out, lse, o.float(), l_.transpose(1, 2))
        return
    so, sl = out[:, rows], lse[:, rows]
    merge_(so, sl, o.float(), l_.transpose(1, 2))
    out[:, rows], lse[:, rows] = so, sl


class ExchangeFlex(torch.autograd.Function):
    """(out, lse) of the exchange over ``plan`` (see the module docstring).
    Each pass overlaps one exchange with the pieces that do not need it."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ExchangePlan, group):
        ctx.set_materialize_grads(False)
        b, length, h, _ = q.shape
        dev, n = q.device, lambda rows: [len(r) for r in rows]
        xkv = _Exchange([[k[:, r], v[:, r]] for r in plan.halo_send], n(plan.halo_in), [_spec(k), _spec(v)], b, group,
                        plan.moves_kv, dev)
        out = torch.zeros(b, length, h, v.shape[-1], dtype=torch.float32, device=dev)
        lse = torch.full((b, length, h), float("-inf"), dtype=torch.float32, device=dev)
        if plan.own is not None:
            _merge_rows(out, lse, None, *plan.own.forward(q, k, v))
        halos = xkv.wait()
        xq = _Exchange([[q[:, r]] for r in plan.ship], n(plan.q_in), [_spec(q)], b, group, plan.moves_q, dev)
        for run, (kh, vh) in zip(plan.halo, halos):
            if run is not None:
                _merge_rows(out, lse, None, *run.forward(q, kh, vh))
        parts = []
        for run, (qr,) in zip(plan.serve, xq.wait()):
            o, l_ = run.forward(qr, k, v) if run is not None else (
                qr.new_zeros(*qr.shape[:3], v.shape[-1]), torch.full((b, h, qr.shape[1]), float("-inf"), device=dev))
            parts.append([o.to(q.dtype), l_.float().transpose(1, 2)])
        specs = [(tuple(out.shape[2:]), q.dtype), ((h,), torch.float32)]
        back = _Exchange(parts, n(plan.ship), specs, b, group, plan.moves_q, dev)
        for rows, (o, l_) in zip(plan.ship, back.wait()):
            if len(rows):
                _merge_rows(out, lse, rows, o, l_.transpose(1, 2))
        out, lse = out.to(q.dtype), lse.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, xkv.buf, xq.buf)
        ctx.plan, ctx.group = plan, group
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, kvbuf, qbuf = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        b, dev, n = q.shape[0], q.device, lambda rows: [len(r) for r in rows]
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # no lse gradient (the usual case): None to this rank's own executors, so FA4 skips its dlse path (the
        # shipped rows' calls take the owner's, zeros or not: another rank may have one)
        has_dlse = dlse is not None
        dlse = dlse.float() if has_dlse else None
        stats = torch.stack([lse, dlse if has_dlse else torch.zeros_like(lse)], -1).transpose(1, 2)  # (B, L, H, 2)
        xo = _Exchange([[dout[:, r], out[:, r], stats[:, r]] for r in plan.ship], n(plan.q_in),
                       [_spec(dout), _spec(out), _spec(stats)], b, group, plan.moves_q, dev)
        kv_spec = [_spec(k), _spec(v)]
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=dev) for x in (q, k, v))
        if plan.own is not None:
            for acc, g in zip((dq, dk, dv), plan.own.backward(dout, q, k, v, out, lse, dlse)):
                acc += g
        halo_grads = []
        for run, (kh, vh) in zip(plan.halo, _unpack(kvbuf, n(plan.halo_in), kv_spec, b)):
            if run is None:
                halo_grads.append([torch.zeros_like(kh), torch.zeros_like(vh)])
                continue
            g = run.backward(dout, q, kh, vh, out, lse, dlse)
            dq += g[0]
            halo_grads.append([g[1].to(k.dtype), g[2].to(v.dtype)])
        shipped = xo.wait()
        xdkv = _Exchange(halo_grads, n(plan.halo_send), kv_spec, b, group, plan.moves_kv, dev)
        dq_back = []
        for run, (qr,), (do, o, st) in zip(plan.serve, _unpack(qbuf, n(plan.q_in), [_spec(q)], b), shipped):
            if run is None:
                dq_back.append([torch.zeros_like(qr)])
                continue
            ls, dls = (st[..., i].transpose(1, 2).contiguous() for i in range(2))
            g = run.backward(do, qr, k, v, o, ls, dls)
            dq_back.append([g[0].to(q.dtype)])
            dk += g[1]
            dv += g[2]
        for rows, (gk, gv) in zip(plan.halo_send, xdkv.wait()):
            if len(rows):
                dk.index_add_(1, rows, gk.float())
                dv.index_add_(1, rows, gv.float())
        xdq = _Exchange(dq_back, n(plan.ship), [_spec(q)], b, group, plan.moves_q, dev)
        for rows, (g,) in zip(plan.ship, xdq.wait()):
            if len(rows):
                dq.index_add_(1, rows, g.float())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
