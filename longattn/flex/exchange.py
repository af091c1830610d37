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
  (``ship_ratio``) and moves little of the work to s (``ship_max_work``;
  :class:`longattn.tuning.FlexExchangeTuning`). r ships
  those rows to s, which computes them against all its keys and returns a
  partial (out, lse);
* needed key blocks of s for r: seen by a non-heavy query block of r. s
  ships those K/V rows (the halo) to r, which computes its rows against them
  with the heavy blocks cleared from that table (s computes those pairs).

Every (row, key) pair is computed exactly once; partials merge by lse in
float32 as in the ring. The backward ships the heavy rows' dout, the MERGED
out, lse and dlse; each executor's backward from the merged statistics gives
its exact share of dq, dk, dv, and the halo's dk/dv and the shipped rows' dq
return to their owners. Two ``all_to_all_single`` per pass, each one byte
buffer of whatever it carries (skipped where no rank moves any row), run by
:mod:`.exchange_run`.

Executors: FA4 with the pattern's form at the pieces' global positions where
FA4 runs the pattern, else :class:`TorchPiece` (dense scores: small shapes).
:func:`choose_engine` is the one decision between this engine and the ring.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import tuning as tn
from ..distributed import checks
from ..distributed.accumulate import most_cover
from . import blocks, fa4, pieces
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
    per rank; the ring's steps that move K/V), forward + backward, agreed by
    every rank: called only where needed (it plans, with collectives on
    first use, on every rank alike). ``auto`` runs the exchange where its
    bytes stay under ``tuning.max_traffic`` x steps of the ring's: a ring of
    more steps loses more than its bytes to each step's wait and merge, so
    the exchange pays from a larger share of its traffic.
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
    _, dense, sent, ring, steps = facts()
    if dense:
        return "ring"
    return "exchange" if sent < tuning.max_traffic * steps * ring else "ring"


def _union(rows: list, dev) -> tuple:
    """(the rows of every list, ascending, without repeats; each list's positions in them)."""
    u = torch.unique(torch.cat(rows)) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    return u, [torch.searchsorted(u, r) for r in rows]


@dataclasses.dataclass(eq=False)  # compared and hashed by identity: a cached plan keys its passes' CUDA graphs
class ExchangePlan:
    """One rank's exchange, per peer p (rank order; empty for itself):
    ``ship[p]`` my rows computed on p, ``q_in[p]`` rows p ships to me,
    ``halo_send[p]`` my key rows p needs, ``halo_in[p]`` key rows p sends me.
    Executors: ``own`` (my rows x my keys), ``halo`` (:class:`.pieces.HaloPiece` s:
    my rows x the peers' halos concatenated in rank order, my heavy blocks
    against each peer cleared), ``serve`` (the rows every peer ships me,
    concatenated in rank order, x my keys); None / empty where nothing is
    visible. ``heavy``: my rows computed elsewhere (every peer's ``ship``,
    long, ascending; ``heavy_pos[p]``: ``ship[p]``'s positions in it),
    ``sent``: my key rows fetched (every peer's ``halo_send``; ``sent_pos``);
    ``own_at`` / ``kv_at``: (positions, rows) of ``heavy`` / ``sent`` in a
    full-size piece; ``out_pieces`` / ``kv_pieces``: the most pieces a row /
    key row gets (own, halos / own, served rows); ``concurrent``: the other
    pieces run beside the own one on CUDA
    (:class:`longattn.tuning.FlexExchangeTuning`). ``traffic``: (most bytes a
    rank sends, the ring's per rank, the ring's steps that move K/V), forward
    + backward; ``moves_q`` /
    ``moves_kv``: any rank ships query rows / K/V; ``dense``: why the
    executors would be the dense PyTorch ones on a GPU (empty: FA4 runs them,
    or the CPU); ``cannot``: why the ranks' plans do not fit together
    (empty: they do); ``ship_same``: every peer I ship rows to takes the same
    rows (global tokens), so their partials merge at once; ``joined``: the
    halo keys (that many, every peer's in rank order) run with my keys in
    ``own`` (:class:`.pieces.JoinedKeys` or :class:`.pieces.JoinedDocuments`,
    ``FlexExchangeTuning.join_halo``; ``halo`` then empty), 0 where they run
    apart; ``few``: :class:`.pieces.HaloPiece` s whose executor is a
    :class:`.pieces.FewKeys` (my rows [r0, r1) x a few halo keys [k0, k1)
    every one of them sees, merged into ``own``'s outputs in place;
    ``FlexExchangeTuning.few_keys``)."""

    ship: list
    q_in: list
    halo_send: list
    halo_in: list
    own: object
    halo: list
    serve: object
    heavy: torch.Tensor
    heavy_pos: list
    own_at: tuple
    kv_at: tuple
    sent: torch.Tensor
    sent_pos: list
    out_pieces: int
    kv_pieces: int
    concurrent: bool
    traffic: tuple
    moves_q: bool
    moves_kv: bool
    dense: list
    cannot: list
    ship_same: bool = False
    joined: int = 0
    few: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RowBytes:
    """Bytes the exchange moves per row, forward + backward: ``q`` a query
    row (or its out, dout, dq), ``kv`` a key row's K and V (or dK and dV),
    ``lse`` a row's lse (or dlse)."""

    q: int
    kv: int
    lse: int

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor) -> "RowBytes":
        b, _, h, d = q.shape
        es = q.element_size()
        return cls(b * h * d * es, 2 * b * k.shape[2] * d * es, b * h * 4)

    @property
    def ship(self) -> int:
        """A shipped row, both ways: q, dout and out there, out and dq back, 3 lse."""
        return 5 * self.q + 3 * self.lse

    @property
    def fetch(self) -> int:
        """A fetched key row, both ways: K/V there, dK/dV back."""
        return 2 * self.kv

    def sent(self, shipped: int, halo_send: int, served: int, halo_in: int) -> int:
        """A rank's bytes sent: forward its shipped rows and its halo out, partials back; backward the shipped
        rows' dout + out + lse + dlse out, dq of the served rows back, the received halo's dK/dV back."""
        return (shipped * (3 * self.q + 2 * self.lse) + halo_send * self.kv + served * (2 * self.q + self.lse)
                + halo_in * self.kv)

    def ring(self, steps: int, length: int) -> int:
        """The ring's bytes per rank over ``steps`` steps of ``length``-row K/V shards: K/V forward, K/V and
        dK/dV backward."""
        return 3 * steps * length * self.kv


def candidates(t: fp.BlockTable, tuning: tn.FlexExchangeTuning) -> tuple:
    """(visible tiles (query blocks, key blocks) over every batch row and head, key blocks each query block
    sees, the query blocks that are candidates to ship: more than ``heavy_fraction`` of the key blocks and at
    least ``heavy_min_blocks``)."""
    vis = (t.partial | t.full).flatten(0, 1).any(0)
    cnt = vis.sum(1)
    return vis, cnt, (cnt > tuning.heavy_fraction * vis.shape[1]) & (cnt >= tuning.heavy_min_blocks)


def visible_tiles(t: fp.BlockTable) -> int:
    """Tiles of a block table that hold a visible pair for some batch row or head."""
    return int((t.partial | t.full).flatten(0, 1).any(0).sum())


def split_pair(t: fp.BlockTable, tuning: tn.FlexExchangeTuning, bq: int, rb: RowBytes, peer_work: int):
    """(heavy query blocks, needed key blocks) of one pair's table, over every
    batch row and head. The candidate blocks (:func:`candidates`) are shipped
    only where their rows' bytes (``rb.ship`` each) stay under ``ship_ratio``
    of the bytes of the key blocks only they see (``rb.fetch`` a key): rows
    that share the key blocks they see (a long document across a shard edge)
    are cheaper served by one halo; and only where the tiles they move to the
    peer stay under ``ship_max_work`` of ``peer_work`` (the tiles of the
    peer's own rows against its keys): shipped rows are computed there, and a
    rank that serves a large share of another's rows outlasts it."""
    vis, cnt, heavy = candidates(t, tuning)
    need = vis[~heavy].any(0)
    saved = int((vis[heavy].any(0) & ~need).sum()) * fp.BLOCK_SIZE * rb.fetch
    if int(heavy.sum()) * bq * rb.ship >= tuning.ship_ratio * saved or \
            int(cnt[heavy].sum()) > tuning.ship_max_work * peer_work:
        heavy, need = torch.zeros_like(heavy), vis.any(0)
    return heavy.nonzero().flatten(), need.nonzero().flatten()


def _build(q, k, mask_mod, layout, scale, rank, world, cap, tuning):
    """This rank's plan (no communication) and its (bytes sent, ring steps it needs, q rows, halo rows)."""
    b, length, h, d = q.shape
    dev, hkv = q.device, k.shape[2]
    pos = [fp.global_positions(layout, r, world, length, dev) for r in range(world)]
    bq = blocks.sparse_block(cap, length)[0] if cap is not None else fp.BLOCK_SIZE
    rb = RowBytes.of(q, k)
    table = lambda r, s: fp.block_table(mask_mod, b, h, pos[r], pos[s], (bq, fp.BLOCK_SIZE))
    own_work = [visible_tiles(table(p, p)) for p in range(world)]
    split = lambda r, s: split_pair(table(r, s), tuning, bq, rb, own_work[s])
    none = torch.zeros(0, dtype=torch.long, device=dev)
    ship, q_in, halo_send, halo_in, heavy_blocks = ([none] * world for _ in range(5))
    need = 0
    for p in range(world):
        if p == rank:
            continue
        heavy_blocks[p], keys = split(rank, p)  # my rows against p's keys
        ship[p], halo_in[p] = pieces.rows_of(heavy_blocks[p], bq, length), pieces.rows_of(keys, fp.BLOCK_SIZE,
                                                                                          length)
        if len(heavy_blocks[p]) or len(keys):  # the ring step at which p's block visits is needed
            need = max(need, (rank - p) % world + 1)
        heavy, keys = split(p, rank)  # p's rows against my keys
        q_in[p], halo_send[p] = pieces.rows_of(heavy, bq, length), pieces.rows_of(keys, fp.BLOCK_SIZE, length)
    split = lambda table, rows, keys: pieces.split_for(table, rows, keys, b, h, hkv, cap, tuning)
    # a few keys every row sees merge into the own piece's outputs in place: only where none of my rows is
    # shipped (their partials merge apart)
    few_keys = 0 if any(len(x) for x in heavy_blocks) or b * length < tuning.few_keys_min_rows else tuning.few_keys
    halo, few = pieces.halo_pieces(mask_mod, pos[rank], [pos[p][halo_in[p]] for p in range(world)], heavy_blocks,
                                   b, h, scale, cap, bq, split, few_keys, tuning.few_keys_share)
    shipped = torch.cat([pos[p][q_in[p]] for p in range(world)])
    serve = pieces.executor(mask_mod, shipped, pos[rank], b, h, scale, cap, split=split)
    own = pieces.DocumentsStep.at(mask_mod, pos[rank], b, scale) if cap is not None else None
    joined = 0
    lens = [len(x) for x in halo_in]
    hpos = torch.cat([pos[p][halo_in[p]] for p in range(world)])
    if (halo or few) and tuning.join_halo and own is not None and not any(len(x) for x in heavy_blocks):
        # documents: each run's earlier keys on the peers joined to its varlen key segment
        docs = pieces.JoinedDocuments.at(mask_mod, pos[rank], hpos, b, scale)
        if docs is not None:
            own, halo, few, joined = docs, [], [], sum(lens)
    elif (halo or few) and tuning.join_halo and own is None and all(n % fp.BLOCK_SIZE == 0 for n in lens):
        # the halo keys (every peer's, rank order, as they arrive) before my keys: one executor; my query blocks
        # computed on p cleared against p's keys, as in the halo pieces
        offs = [sum(lens[:p]) // fp.BLOCK_SIZE for p in range(world + 1)]
        clear = [(heavy_blocks[p], offs[p], offs[p + 1]) for p in range(world) if len(heavy_blocks[p]) and lens[p]]
        kpos = torch.cat([hpos, pos[rank]])
        # no rows shipped (nothing to clear): carved where the joined keys have long chains (global keys), as a
        # one-device call
        run = pieces.carved(mask_mod, pos[rank], kpos, b, h, hkv, scale, cap, tuning) if cap is not None and \
            not clear else pieces.executor(mask_mod, pos[rank], kpos, b, h, scale, cap, clear=clear)
        if run is not None:  # None: nothing visible in the joined table; the pieces stay apart
            own, halo, few, joined = pieces.JoinedKeys(run, sum(lens)), [], [], sum(lens)
    if own is None:
        own = pieces.executor(mask_mod, pos[rank], pos[rank], b, h, scale, cap)
    n = lambda xs: sum(len(x) for x in xs)
    sent = rb.sent(n(ship), n(halo_send), n(q_in), n(halo_in))
    heavy, heavy_pos = _union(ship, dev)
    sent_rows, sent_pos = _union(halo_send, dev)
    for piece in halo + few:
        piece.at = pieces.within(heavy, piece.r0, piece.r1)
    spans = [(0, length)] * (own is not None) + [(x.r0, x.r1) for x in halo + few]
    plan = ExchangePlan(ship, q_in, halo_send, halo_in, own, halo, serve, heavy, heavy_pos,
                        pieces.within(heavy, 0, length), pieces.within(sent_rows, 0, length), sent_rows, sent_pos,
                        most_cover(spans), (own is not None) + (serve is not None), tuning.concurrent, (), False,
                        False, [], [], joined=joined, few=few)
    shipped = [x for x in ship if len(x)]
    plan.ship_same = len(shipped) > 1 and all(torch.equal(x, shipped[0]) for x in shipped)
    return plan, [sent, max(need, 1), n(ship), n(halo_send)]


def _rows_sum(rows: torch.Tensor, device) -> torch.Tensor:
    """sum((row + 1) * (i + 1)) over the i-th of ``rows`` (int64 on ``device``): what two ranks compare of a
    transfer's rows (their order counts: the receiver reads them in the sender's order)."""
    rows = rows.to(device=device, dtype=torch.int64)
    return ((rows + 1) * torch.arange(1, len(rows) + 1, dtype=torch.int64, device=device)).sum()


def plan_for(q, k, mask_mod, score_mod, layout: str, scale: float, group, kernel: str, engine: str,
             tuning: tn.FlexExchangeTuning = tn.FLEX_EXCHANGE) -> Optional[ExchangePlan]:
    """The exchange plan of this call, or None where :func:`choose_engine`
    picks the ring. Planned once per (shape, pattern, layout, group, kernel,
    tuning) and cached; on first use two small collectives: every rank's
    planning agreed (a failure on one rank raises on every rank) and every
    rank's traffic, query block and rows per peer (counts and an
    order-sensitive sum: plans whose transfers do not fit together raise on
    every rank)."""
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
        # and each rank's rows per peer: what r sends p must be what p plans to receive from r (a mask whose
        # values differ across ranks passes the signature check, and mismatched transfers would hang or abort)
        # (equal counts of other rows, or of the same rows in another order, would move without an error: the
        # rows are compared too, by an order-sensitive sum)
        lists = [x[p] for x in (plan.ship, plan.q_in, plan.halo_send, plan.halo_in) for p in range(world)]
        t = torch.cat([torch.tensor(stats + [bq, use_fa4] + [len(x) for x in lists], dtype=torch.int64,
                                    device=q.device), torch.stack([_rows_sum(x, q.device) for x in lists])])
        got = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(got, t, group=group)
        rows = torch.stack(got).cpu().tolist()
        sent, steps, nq, nkv, bqs, fa4s = zip(*(r[:6] for r in rows))
        # per rank, per peer: the rows' counts, then their sums (ship, q_in, halo_send, halo_in)
        ship, q_in, send, recv = ([list(zip(r[6 + i * world:6 + (i + 1) * world],
                                            r[6 + (4 + i) * world:6 + (5 + i) * world])) for r in rows]
                                  for i in range(4))
        mismatch = [(r, p) for r in range(world) for p in range(world)
                    if ship[r][p] != q_in[p][r] or send[r][p] != recv[p][r]]
        # the ring moves K/V at each step after the first
        plan.traffic = (max(sent), RowBytes.of(q, k).ring(max(steps) - 1, k.shape[1]), max(steps) - 1)
        plan.moves_q, plan.moves_kv = sum(nq) > 0, sum(nkv) > 0
        # heavy blocks are planned at the query block on both sides of a pair: every rank's must match
        plan.cannot = [] if len(set(bqs)) == 1 else [f"the ranks' query blocks differ ({list(bqs)} rows: FA4 on "
                                                     f"some GPUs, not on others)"]
        if mismatch:
            plan.cannot.append(f"the ranks' plans disagree (rows sent by rank r to p differ from what p expects, "
                               f"(r, p) = {mismatch[:4]}): the mask gives other values on other ranks")
        plan.dense = [] if min(fa4s) or q.device.type == "cpu" else [
            "FA4 does not run this pattern on every rank and the exchange's PyTorch executor materialises scores"]
        return plan
    plan = None

    def facts():
        nonlocal plan
        plan = RING_PLANS.get_or(key, make, q, "ring_flex_attention")
        return (plan.cannot, plan.dense, *plan.traffic)
    if choose_engine(engine, cannot, facts, tuning, dist.get_world_size(group)) == "ring":
        return None
    facts()
    return plan
