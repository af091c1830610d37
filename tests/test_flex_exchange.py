"""ring_flex_attention's exchange engine (sparse K/V halos, shipped query
rows) on gloo in spawned processes against the float64 single-device
reference (outputs, lse, all gradients); its plan (heavy query blocks,
traffic against the ring's) and the engine choice; a pattern where every
block is heavy; bad ``engine`` values."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import _free_port, assert_group_usable, assert_unsharded_matches, generator, run_sharded, run_world
from longattn import masks, tuning
from longattn.flex import exchange, fa4, pieces
from longattn.flex.exchange import choose_engine
from longattn.flex.pieces import TorchPiece
from longattn.flex.exchange_run import ExchangeFlex
from reference import flex_ref, flex_ref_grads

TOL = 1e-4
B, L, H, D = 1, 512, 4, 16  # L tokens per rank: 4 blocks of 128, so a block can be heavy (>= 4 key blocks)


def patterns(world):
    """(name, mask_mod, kv heads) on world * L tokens."""
    s = world * L
    docs = torch.arange(s) * 5 // s  # five documents, boundaries off the shard edges
    return [
        ("local + global", masks.local_global(64, 16), 2),
        ("causal documents", masks.and_(masks.causal(), masks.document(docs)), 4),
        ("sliding window", masks.sliding_window(100, 0), 4),
        ("causal", masks.causal(), 4),
    ]


def _compare(tag, world, layout, mask, hkv, engine="exchange", seed=7, batch=B, local=L, op=None, heads=H):
    s = world * local
    torch.manual_seed(seed)
    q, k, v = torch.randn(batch, s, heads, D), torch.randn(batch, s, hkv, D), torch.randn(batch, s, hkv, D)
    do, dl = torch.randn(batch, s, heads, D), torch.randn(batch, heads, s)
    kw = dict(engine=engine) if op is None else {}
    us, out, lse, grads = run_sharded(op or longattn.ring_flex_attention, q, k, v, do, dl, layout, mask_mod=mask,
                                      **kw)
    assert out.grad_fn is not None and "ExchangeFlex" in type(out.grad_fn).__name__
    assert_unsharded_matches(tag, us, out, lse, grads, lambda: flex_ref_grads(q, k, v, do, dl, mask), TOL)


def _check_patterns(rank, world):
    for layout in ("zigzag", "contiguous"):
        for name, mask, hkv in patterns(world):
            _compare(f"world={world} {layout} {name} hkv={hkv}", world, layout, mask, hkv)
        # the plan those calls ran: halos fetched, the global rows shipped (but at 2 zigzag ranks, whose window
        # halo covers half of the peer's key blocks: fetching the other two costs fewer bytes)
        plan = _plan(torch.randn(B, L, H, D), patterns(world)[0][1], layout, k=torch.randn(B, L, 2, D))
        assert plan.moves_q == (world > 2 or layout == "contiguous") and plan.moves_kv
        assert len(plan.halo) == 1, [(x.r0, x.r1, x.k0, x.k1) for x in plan.halo]  # global keys: every row, one launch
        # the global rows go to every peer that takes them: their partials merged at once (the calls above ran it)
        shipped = sum(1 for x in plan.ship if len(x))
        assert plan.ship_same == (shipped > 1) and (shipped <= 1 or rank == 0), (rank, shipped, plan.ship_same)
        assert shipped == (world - 1 if (layout, rank) == ("contiguous", 0) else shipped), (layout, rank, shipped)
        # a window's halo pieces run only the rows at the shard edges (one 128-row block each here: each chunk's
        # first, apart); their results and gradients above are merged into row ranges, not full-size buffers
        plan = _plan(torch.randn(B, L, H, D), patterns(world)[2][1], layout)
        spans = [(x.r0, x.r1) for x in plan.halo]
        assert (spans or (layout, rank) == ("contiguous", 0)) and all(r1 - r0 == 128 for r0, r1 in spans), spans
        assert plan.out_pieces <= 2, plan.out_pieces  # no row sees two peers' halos: accumulators keep the dtype


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_matches_reference(world):
    run_world(_check_patterns, world)


def _own_mask(b, h, q_idx, kv_idx):
    """A mask of the user's own (no pattern key, no FA4 form)."""
    return ((q_idx - kv_idx).abs() < 40) | (q_idx % 97 == 0)


def _check_other_masks(rank, world):
    """Masks that depend on the head, a function of the user's own, no mask; two batch rows."""
    s = world * 256
    layout = torch.rand(H, s // 32, s // 32, generator=generator(1)) < 0.2
    for name, mask in (("block-sparse per head", masks.block_sparse(layout, 32)), ("own mask", _own_mask),
                       ("no mask", None)):
        _compare(f"world={world} {name}", world, "contiguous", mask, 2, batch=2, local=256)


@pytest.mark.dist
def test_exchange_other_masks():
    run_world(_check_other_masks, 3)


def _check_replays(rank, world):
    """The exchange's FA4 pieces (own, halo, served rows, on views where split) record their passes' compiled
    calls on the first call and replay them after (test_flex_fa4's stand-in with JIT caches, FA4's three backward
    kernels): the second and third calls make no FA4 entry and still match the reference, gradients of lse
    included; every piece's passes hold a replay."""
    import test_flex_fa4 as F
    from test_fa4 import _MathInterface
    from longattn.backends import _fa4_api
    from longattn.flex import fa4

    _fa4_api._interface = lambda: _MathInterface()
    compiled = F._compiled_interface(F._MaskInterface())
    F.install_stand_in(compiled)
    split = tuning.FlexExchangeTuning(split_chain=1, split_min_blocks=1)
    for i in range(3):
        _compare(f"world={world} local + global, split, call {i}", world, "contiguous", masks.local_global(64, 16),
                 2, op=_exchange_with(split), seed=i)
        if i == 0:
            entries = (compiled.fwd, compiled.bwd)
            assert all(entries), entries
    assert (compiled.fwd, compiled.bwd) == entries, ((compiled.fwd, compiled.bwd), entries)
    plan = _plan(torch.randn(B, L, H, D), masks.local_global(64, 16), layout="contiguous", tune=split,
                 k=torch.randn(B, L, 2, D))
    runs = [plan.own, plan.serve] + [p.run for p in plan.halo]
    replays = [r for x in runs if x is not None for st in fa4.steps_of(x) for r in st.replays.values()]
    assert replays and all(isinstance(r, _fa4_api.Replay) for r in replays), replays


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_replays_fa4_calls(world):
    run_world(_check_replays, world, backend="gloo")


def _check_fa4_stand_in(rank, world, cap):
    """The FA4 executors (cleared tables, FA4's block-sparse tensors, the pattern's form at positions) through
    test_flex_fa4's stand-in for FA4's interface, at sm_90's 128-row and sm_100's 256-row query blocks; causal
    documents' own piece through FA4's varlen kernel (test_fa4's stand-in for it)."""
    import test_flex_fa4 as F
    from test_fa4 import _MathInterface
    from longattn.backends import _fa4_api
    from longattn.flex import blocks, fa4, pieces

    varlen = _MathInterface()
    _fa4_api._interface = lambda: varlen
    F.install_stand_in(F._MaskInterface(), cap)
    mask = masks.local_global(64, 16)
    # at sm_100's 256-row query blocks the global rows' block moves more than ship_max_work of a 3-rank peer's
    # tiles at this size: unbounded, so that both blocks are shipped
    ship = dataclasses.replace(tuning.FLEX_EXCHANGE, ship_max_work=float("inf"))
    plan = _plan(torch.randn(B, L, H, D), mask, layout="zigzag", tune=ship)
    assert isinstance(plan.own, fa4.RingStep) and plan.own.step.block == blocks.sparse_block(cap, L)
    # rank 0's first query block (the global rows) is heavy against every peer, at the executor's query block
    assert [len(r) for r in plan.ship] == [0 if rank or p == 0 else plan.own.step.block[0] for p in range(world)]
    _compare(f"world={world} sm_{cap}0 local + global", world, "zigzag", mask, H, op=_exchange_with(ship))
    for name, mask, hkv in patterns(world)[1:2] + [("no mask", None, 2)]:
        _compare(f"world={world} sm_{cap}0 {name}", world, "zigzag", mask, hkv)
    # 128 global tokens: few-keys pieces beside the FA4 halo pieces at the executor's query block
    few = _plan(torch.randn(B, 4 * L, H, D), masks.local_global(64, 128), layout="zigzag", tune=FEW).few
    assert bool(few) == (rank > 0) and all(x.r0 % plan.own.step.block[0] == 0 for x in few), few
    _compare(f"world={world} sm_{cap}0 128 global tokens, few keys", world, "zigzag", masks.local_global(64, 128),
             2, local=4 * L, op=_exchange_with(FEW))
    docs = patterns(world)[1][1]
    assert isinstance(_plan(torch.randn(B, L, H, D), docs, layout="zigzag").own, pieces.DocumentsStep)
    assert varlen.calls and all(c["varlen"] for c in varlen.calls)  # the documents' own pieces ran as varlen
    # a window: only the last rank's zigzag chunks are adjacent; the others' shards have a gap, where local offsets
    # are not global ones, so their own pieces keep the mask
    windowed = masks.and_(masks.sliding_window(300, 0), docs)
    own = _plan(torch.randn(B, L, H, D), windowed, layout="zigzag").own
    assert isinstance(own, pieces.DocumentsStep) == (rank == world - 1)
    _compare(f"world={world} sm_{cap}0 windowed documents", world, "zigzag", windowed, 4)
    _compare(f"world={world} sm_{cap}0 no mask, shipped", world, "zigzag", None, 2, op=_exchange_with(SHIP_ALL))
    # pieces on views of their long side (fa4.SplitStep): the global rows against a peer's keys, the rows against
    # the peers' global keys, both ways
    split = tuning.FlexExchangeTuning(split_chain=1, split_min_blocks=1)  # the test's 4-block shards split
    plan = _plan(torch.randn(B, L, H, D), masks.local_global(64, 16), layout="contiguous", tune=split,
                 k=torch.randn(B, L, 2, D))
    kinds = {(x.c, x.axis) for x in [plan.serve] + [p.run for p in plan.halo] if isinstance(x, fa4.SplitStep)}
    # at 2 ranks (sm_90) rank 1 serves rank 0's global rows (4 heads x 1 query tile: keys split) and its rows see
    # the global keys (2 kv heads x 2 key tiles: rows split); rank 0's one halo tile has nothing to split
    assert rank == 0 or ({a for _, a in kinds} == {"keys", "rows"} if world == 2 else kinds), kinds
    _compare(f"world={world} sm_{cap}0 local + global, split {sorted(kinds)}", world, "contiguous",
             masks.local_global(64, 16), 2, op=_exchange_with(split))
    _compare(f"world={world} sm_{cap}0 documents, split", world, "zigzag", patterns(world)[1][1], 4,
             op=_exchange_with(split))
    # the halo keys joined to the own keys: one FA4 call per pass at the joined positions; causal documents: each
    # run's earlier keys on the peers in its varlen key segment
    plan = _plan(torch.randn(B, L, H, D), masks.local_global(64, 16), layout="zigzag", tune=JOIN)
    assert isinstance(plan.own, pieces.JoinedKeys) and isinstance(plan.own.run, fa4.RingStep), plan.own
    assert plan.joined and not plan.halo, (plan.joined, plan.halo)
    _compare(f"world={world} sm_{cap}0 local + global, joined", world, "zigzag", masks.local_global(64, 16), H,
             op=_exchange_with(JOIN))
    # joined with the global keys' chains: the backward carved as a one-device call's (those key tiles on views)
    join_split = tuning.FlexExchangeTuning(join_halo=True, split_chain=1, split_min_blocks=1)
    plan = _plan(torch.randn(B, L, H, D), masks.local_global(64, 16), layout="contiguous", tune=join_split,
                 k=torch.randn(B, L, 2, D))
    carved = isinstance(plan.own.run, pieces.CarvedStep)
    assert rank == 0 or (carved and plan.own.run.keys_run is not None), (rank, plan.own.run)
    _compare(f"world={world} sm_{cap}0 local + global, joined and carved", world, "contiguous",
             masks.local_global(64, 16), 2, op=_exchange_with(join_split))
    plan, apart = (_plan(torch.randn(B, L, H, D), docs, layout="zigzag", tune=t) for t in (JOIN, tuning.FLEX_EXCHANGE))
    assert isinstance(plan.own, pieces.JoinedDocuments) == bool(apart.halo) and not plan.halo, (rank, plan.own)
    varlen.calls.clear()
    _compare(f"world={world} sm_{cap}0 documents, joined", world, "zigzag", docs, 4, op=_exchange_with(JOIN))
    assert varlen.calls and all(c["varlen"] for c in varlen.calls)
    # two documents over every rank's two chunks: a run's earlier keys from two peers, out of position order in
    # the halo (rank order) at rank 0, whose second chunk's document began on ranks 2 and 1 (3 ranks)
    long_docs = masks.and_(masks.causal(), masks.document(torch.arange(world * L) * 2 // (world * L)))
    plan = _plan(torch.randn(B, L, H, D), long_docs, layout="zigzag", tune=JOIN)
    assert world != 3 or isinstance(plan.own, pieces.JoinedDocuments), (rank, plan.own, plan.ship)
    _compare(f"world={world} sm_{cap}0 two long documents, joined", world, "zigzag", long_docs, 4,
             op=_exchange_with(JOIN))
    # two batch rows with documents of their own (ids (2, S)): segments per row, halo rows at per-row offsets
    ids = torch.stack([torch.arange(world * L) * 5 // (world * L), torch.arange(world * L) * 3 // (world * L)])
    rows_docs = masks.and_(masks.causal(), masks.document(ids))
    plan = _plan(torch.randn(2, L, H, D), rows_docs, layout="zigzag", tune=JOIN)
    assert isinstance(plan.own, pieces.JoinedDocuments) == bool(plan.joined) and (rank != 1 or plan.joined), plan.own
    _compare(f"world={world} sm_{cap}0 documents per batch row, joined", world, "zigzag", rows_docs, 4, batch=2,
             op=_exchange_with(JOIN))
    windowed_docs = masks.and_(masks.sliding_window(300, 0), masks.causal(), docs)
    plan, apart = (_plan(torch.randn(B, L, H, D), windowed_docs, tune=t) for t in (JOIN, tuning.FLEX_EXCHANGE))
    assert isinstance(plan.own, pieces.JoinedDocuments) == bool(apart.halo), (rank, plan.own)
    assert not isinstance(plan.own, pieces.JoinedDocuments) or len(plan.own.halo_src) > 0
    _compare(f"world={world} sm_{cap}0 windowed causal documents, joined", world, "contiguous", windowed_docs, 4,
             op=_exchange_with(JOIN))


@pytest.mark.dist
@pytest.mark.parametrize("world,cap", [(2, 9), (3, 10)])
def test_exchange_through_fa4_stand_in(world, cap):
    run_world(_check_fa4_stand_in, world, cap, backend="gloo")  # a CPU stand-in: gloo under NCCL runs too


def _plan(q, mask, layout="contiguous", engine="exchange", tune=tuning.FLEX_EXCHANGE, k=None):
    return exchange.plan_for(q, q if k is None else k, mask, None, layout, q.shape[-1] ** -0.5, dist.group.WORLD,
                             "auto", engine, tune)


SHIP_ALL = tuning.FlexExchangeTuning(ship_ratio=float("inf"), ship_max_work=float("inf"))
"""Every query block over the threshold shipped, whatever the bytes and the work it moves."""

SPLIT_SHORT = tuning.FlexExchangeTuning(split_chain=8, few_keys=0)
"""Pieces whose programs chain over more than 8 tiles run on views (the test's shards are short); no few-keys
piece takes the rows against the global keys from those views."""


FEW = tuning.FlexExchangeTuning(few_keys=128, few_keys_min_rows=0)
"""A run of up to 128 halo keys every row sees is a few-keys piece, on shards of any length."""


JOIN = tuning.FlexExchangeTuning(join_halo=True)
"""The halo keys joined to the own keys in one executor."""


def _exchange_with(tune):
    """ring_flex_attention's exchange under another tuning (the public op takes the default)."""
    def op(q, k, v, layout, return_lse, mask_mod):
        return ExchangeFlex.apply(q, k, v, _plan(q, mask_mod, layout, tune=tune, k=k), dist.group.WORLD)
    return op


def _check_plan(rank, world):
    q = torch.randn(B, 4 * L, H, D)  # 16 blocks per rank
    mask = masks.local_global(64, 16)
    plan = _plan(q, mask)
    # rank 0's first block holds the global rows: it sees every key block of rank 1, so it is shipped there
    assert [r.tolist() for r in plan.ship] == ([[], list(range(128))] if rank == 0 else [[], []])
    assert [len(r) for r in plan.q_in] == ([0, 0] if rank == 0 else [128, 0])
    # halos: rank 1 needs rank 0's global keys (block 0) and the window's last block; rank 0 the window's first
    assert [len(r) for r in plan.halo_in] == ([0, 128] if rank == 0 else [256, 0])
    sent, ring, steps = plan.traffic
    assert sent < ring / 5 and steps == world - 1, plan.traffic
    # cached, and auto takes it from two ranks on where FA4 runs the pattern, or on CPU (else the ring)
    if q.device.type == "cpu" or fa4.choose(q, q, q, mask, None) == "fa4":
        assert _plan(q, mask, engine="auto") is _plan(q, mask)
    else:
        assert _plan(q, mask, engine="auto") is None
    three = dataclasses.replace(tuning.FLEX_EXCHANGE, min_world=3)
    assert _plan(q, mask, engine="auto", tune=three) is None  # fewer ranks than min_world: the ring
    # dense causal: every block of the later rank is heavy; auto keeps the ring
    assert _plan(q, masks.causal(), engine="auto") is None
    forced = _plan(q, masks.causal())
    assert forced.traffic[0] > tuning.FLEX_EXCHANGE.max_traffic * forced.traffic[2] * forced.traffic[1]
    # causal zigzag: rank 0's later chunk sees every key block of rank 1, and shipping its rows would move fewer
    # bytes than fetching, but as many tiles as rank 1 computes of its own: fetched (ship_max_work)
    zig = _plan(q, masks.causal(), layout="zigzag")
    assert not zig.moves_q and zig.moves_kv
    unbounded = dataclasses.replace(tuning.FLEX_EXCHANGE, ship_max_work=float("inf"))
    shipped = _plan(q, masks.causal(), layout="zigzag", tune=unbounded)
    assert shipped.moves_q and [len(r) for r in shipped.ship] == ([0, 2 * L] if rank == 0 else [0, 0])
    assert _plan(q, mask, engine="ring") is None


@pytest.mark.dist
def test_exchange_plan_and_engine_choice():
    run_world(_check_plan, 2)


def _check_all_heavy(rank, world):
    """No mask: every query block of every rank is heavy against every peer (all rows shipped, no halo) where
    shipping is not weighed against fetching; by default the K/V are fetched instead (fewer bytes)."""
    q = torch.randn(B, L, H, D)
    plan = _plan(q, None, layout="zigzag", tune=SHIP_ALL)
    assert all(len(r) == (0 if p == rank else L) for p, r in enumerate(plan.ship))
    assert not plan.moves_kv and sum(len(r) for r in plan.halo_in) == 0
    fetch = _plan(q, None, layout="zigzag")
    assert not fetch.moves_q and all(len(r) == (0 if p == rank else L) for p, r in enumerate(fetch.halo_in))
    _compare(f"world={world} no mask", world, "zigzag", None, 2, op=_exchange_with(SHIP_ALL))
    _compare(f"world={world} causal", world, "contiguous", masks.causal(), 1, op=_exchange_with(SHIP_ALL))
    _compare(f"world={world} causal, fetched", world, "contiguous", masks.causal(), 1)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_exchange_every_block_heavy(world):
    run_world(_check_all_heavy, world)


def _flaky_mask(b, h, q_idx, kv_idx):
    """The same function on every rank, but rank 1 returns positions instead of a mask."""
    return q_idx - kv_idx if dist.get_rank() == 1 else kv_idx <= q_idx


def _check_bad_engine(rank, world):
    q = torch.randn(B, 16, H, D)
    with pytest.raises(ValueError, match="engine='exchange ': choose one of"):
        longattn.ring_flex_attention(q, q, q, engine="exchange ")
    # no collective ran: the next call's first one is the consistency check on every rank
    with pytest.raises(ValueError, match="engine='exchange' cannot run this call: score_mod"):
        longattn.ring_flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s, engine="exchange")
    # ranks that pass different engines, or whose planning fails on one rank only, raise on every rank
    with pytest.raises(ValueError, match="differ across ranks"):
        longattn.ring_flex_attention(q, q, q, engine="ring" if rank else "exchange")
    want = (TypeError, "must return a bool tensor") if rank == 1 else (ValueError, r"rank\(s\) \[1\] of the group")
    with pytest.raises(want[0], match=want[1]):
        longattn.ring_flex_attention(q, q, q, mask_mod=_flaky_mask, layout="contiguous", engine="exchange")
    assert_group_usable(world)
    out = longattn.ring_flex_attention(q, q, q, mask_mod=masks.causal(), engine="exchange")
    torch.testing.assert_close(out, longattn.ring_flex_attention(q, q, q, mask_mod=masks.causal(), engine="ring"))


@pytest.mark.dist
def test_bad_engine_raises_before_any_collective():
    run_world(_check_bad_engine, 2)


def test_exchange_tuning_rejects_bad_fields():
    for bad, match in ((dict(join_halo="yes"), "join_halo must be True or False"),
                       (dict(concurrent=1), "concurrent must be True or False"),
                       (dict(split_chain=0), "split_chain must be an int >= 1"),
                       (dict(ship_max_work=-1.0), "ship_max_work must be >= 0")):
        with pytest.raises(ValueError, match=match):
            tuning.FlexExchangeTuning(**bad)


def test_choose_engine():
    never = lambda: pytest.fail("planned where the choice does not need it")
    assert choose_engine("ring", [], never) == "ring"
    assert choose_engine("auto", ["score_mod"], never) == "ring"
    fits = lambda sent, dense=(), steps=1: lambda: ([], list(dense), sent, 100, steps)
    assert choose_engine("exchange", [], fits(1000, ["dense"])) == "exchange"
    assert choose_engine("auto", [], fits(1, ["dense"])) == "ring"
    assert choose_engine("auto", [], fits(10)) == "exchange"
    assert choose_engine("auto", [], fits(30)) == "ring"
    assert choose_engine("auto", [], fits(30), tuning.FlexExchangeTuning(max_traffic=0.5)) == "exchange"
    # the bound grows with the ring's steps: max_traffic x 3 of a 3-step ring's bytes
    max_traffic = tuning.FLEX_EXCHANGE.max_traffic
    assert choose_engine("auto", [], fits(int(100 * 2.5 * max_traffic), steps=3)) == "exchange"
    assert choose_engine("auto", [], fits(int(100 * 3.5 * max_traffic), steps=3)) == "ring"
    assert choose_engine("auto", [], fits(0, steps=0)) == "ring"  # nothing for the ring to move
    with pytest.raises(ValueError, match="engine='exchange' cannot run"):
        choose_engine("exchange", ["score_mod is given"], never)
    mixed = lambda: (["the ranks' query blocks differ"], [], 1, 100, 1)
    assert choose_engine("auto", [], mixed) == "ring"
    three = dataclasses.replace(tuning.FLEX_EXCHANGE, min_world=3)
    assert choose_engine("auto", [], never, three, world=2) == "ring"  # fewer ranks than min_world: no planning
    assert choose_engine("auto", [], fits(10), world=3) == "exchange"
    assert choose_engine("exchange", [], fits(10), world=2) == "exchange"
    with pytest.raises(ValueError, match="query blocks differ"):
        choose_engine("exchange", [], mixed)
    with pytest.raises(ValueError, match="engine='fast'"):
        choose_engine("fast", [], never)


def test_torch_piece_matches_reference():
    """The dense executor's forward and its backward from (out, lse) against autograd of the float64 reference."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 24, 4, 8), torch.randn(2, 20, 2, 8), torch.randn(2, 20, 2, 8)
    mask = torch.rand(1, 4, 24, 20) < 0.3
    mask[:, :, 3] = False  # a row that sees no key
    mod = lambda b, h, i, j: mask[0, h, i, j]
    piece = TorchPiece(lambda: mask, 8 ** -0.5)
    out, lse = piece.forward(q, k, v)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = flex_ref(qr, kr, vr, mod)
    torch.testing.assert_close(out.double(), ro, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl)) and not out.isnan().any()
    do, dl = torch.randn_like(out), torch.randn_like(lse).masked_fill(torch.isinf(lse), 0)
    ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
    for got, want in zip(piece.backward(do, q, k, v, out, lse, dl), (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def _check_gpu_fa4(rank, world):
    """bf16 on GPUs (NCCL): the exchange with FA4 executors against the ring and one-device flex_attention."""
    from longattn.flex import fa4

    s, h, hkv, d = 16384, 8, 4, 128
    for name, mask in (("local + global", masks.local_global(1024, 128)),
                       ("causal documents", masks.and_(masks.causal(), masks.document(
                           torch.arange(s, device="cuda") * 7 // s)))):
        g = torch.Generator("cuda").manual_seed(5)
        q, do = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        ql = longattn.shard(q, layout="zigzag")
        if fa4.choose(ql, ql, ql, mask, None) == "fa4":
            kl = longattn.shard(k, layout="zigzag")
            apart = plan = exchange.plan_for(ql, kl, mask, None, "zigzag", d ** -0.5, dist.group.WORLD, "auto",
                                             "exchange")
            # a rank's own documents run as FA4's varlen kernel, any other pattern as one masked call
            assert isinstance(plan.own, pieces.DocumentsStep if name == "causal documents" else fa4.RingStep), \
                type(plan.own)
            # the global keys: a few-keys piece on the last rank's rows (its chunks' middles; at 2 ranks rank 1's)
            few = exchange.plan_for(ql, kl, mask, None, "zigzag", d ** -0.5, dist.group.WORLD, "auto", "exchange",
                                    FEW).few
            assert bool(few) == (name == "local + global" and rank == world - 1), (rank, few)
            # chains of 8 tiles: rank 1 serves the global rows on views of its keys and runs its rows against the
            # global keys on views of its rows (the split pieces of 128K shards, at this size)
            plan = exchange.plan_for(ql, kl, mask, None, "zigzag", d ** -0.5, dist.group.WORLD, "auto", "exchange",
                                     SPLIT_SHORT)
            axes = {x.axis for x in [plan.serve] + [p.run for p in plan.halo] if isinstance(x, fa4.SplitStep)}
            assert rank != 1 or name != "local + global" or axes == {"keys", "rows"}, axes
            joined = exchange.plan_for(ql, kl, mask, None, "zigzag", d ** -0.5, dist.group.WORLD, "auto",
                                       "exchange", JOIN).own
            if name == "causal documents":  # joined where the rank fetches halo keys and ships no rows
                shipped = any(len(x) for x in apart.ship)
                assert isinstance(joined, pieces.JoinedDocuments) == (bool(apart.halo) and not shipped), \
                    (rank, type(joined), len(apart.halo), shipped)
            else:
                assert isinstance(joined, pieces.JoinedKeys), type(joined)
        res = {}
        ops = {"exchange": (longattn.ring_flex_attention, dict(engine="exchange")),
               "ring": (longattn.ring_flex_attention, dict(engine="ring")), "split": (_exchange_with(SPLIT_SHORT), {}),
               "few keys": (_exchange_with(FEW), {}),
               "joined": (_exchange_with(JOIN), {})}
        for engine, (op, kw) in ops.items():
            us, out, lse, grads = run_sharded(op, q, k, v, do, torch.zeros(1, h, s, device="cuda"), "zigzag",
                                              mask_mod=mask, **kw)
            res[engine] = [us(out.float()), us(lse, 2)] + [us(x.float()) for x in grads]
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = longattn.flex_attention(*xs, mask_mod=mask, return_lse=True)
        (out.float() * do.float()).sum().backward()
        one = [out.float(), lse] + [x.grad.float() for x in xs]
        for what, a, b, a2, a3, a4, c in zip(("out", "lse", "dq", "dk", "dv"), res["exchange"], res["ring"],
                                             res["split"], res["joined"], res["few keys"], one):
            err = lambda x, y: float((x - y).norm() / y.norm())
            print(f"rank {rank} world {world} {name} {what}: exchange/one {err(a, c):.2e} split/one {err(a2, c):.2e} "
                  f"joined/one {err(a3, c):.2e} few keys/one {err(a4, c):.2e} ring/one {err(b, c):.2e}")
            for x in (a, a2, a3, a4):
                assert err(x, c) <= max(2e-2, 2 * err(b, c)), (name, what, err(x, c), err(b, c))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_exchange_fa4_on_gpus(world):
    """On 2 and 4 GPUs (NCCL): bf16 exchange with FA4 executors as exact as the ring, against one device."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    run_world(_check_gpu_fa4, world, backend="nccl")


def _check_transfer_waited_elsewhere(rank, world):
    """A transfer made on the main stream and waited for on a side stream (the exchange's forward waits for the
    halo there): the main stream, free to run on at once, allocates and overwrites a block of the send buffer's
    size while the last rank holds the collective back (a GPU sleep before its rows are packed). Every rank still
    receives its peers' rows exactly."""
    from longattn.flex.exchange_run import Transfer

    n, h, d = 32768, 4, 64  # 32 MiB a peer: most of it waits for the held-back rank (NCCL stages ~4 MiB ahead)
    k = (torch.arange(n, device="cuda", dtype=torch.float32).view(1, n, 1, 1) + 100000 * rank).expand(1, n, h, d)
    k = k.contiguous()  # float32 integers: rows compared exactly
    rows = [torch.arange(n if p != rank else 0, device="cuda") for p in range(world)]
    counts = [n if p != rank else 0 for p in range(world)]
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()
    for trial in range(4):
        if rank == world - 1:
            torch.cuda._sleep(300_000_000)  # ~0.2 s: the collective cannot finish before this rank joins it
        t = Transfer([([[(k, r)] for r in rows], counts, [((h, d), torch.float32)])], 1, dist.group.WORLD, True,
                     k.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            (got,), = t.wait()
            got = got.clone()
        for _ in range(3):  # blocks of the send buffer's size, written on the main stream at once
            torch.empty((world - 1) * n * h * d * 4, dtype=torch.uint8, device="cuda").fill_(255)
        main.wait_stream(side)
        torch.cuda.synchronize()
        peers = [p for p in range(world) if p != rank]
        want = torch.cat([torch.arange(n, dtype=torch.float32, device="cpu") + 100000 * p for p in peers])
        bad = int((got[0, :, 0, 0].cpu() != want).sum()) + int((got != got[:, :, :1, :1]).sum())
        assert bad == 0, f"rank {rank} trial {trial}: {bad} received values unlike the peers' rows"
        dist.barrier()


@pytest.mark.gpu
@pytest.mark.multigpu
def test_transfer_waited_on_another_stream():
    """2 GPUs (NCCL): the send buffer of a transfer waited for on another stream is not recycled before the
    collective has read it (:meth:`Transfer.wait` records the waiting stream)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_world(_check_transfer_waited_elsewhere, 2, backend="nccl")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_exchange_captures_in_cuda_graph():
    """2 GPUs (NCCL): ring_flex_attention's exchange replays from a CUDA graph after its first call, and from
    its own pass graphs, on ranks started by torchrun (tests/capture_ranks.py)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "capture_ranks.py")
    env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                        str(_free_port()), script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.count("replay vs eager") == 8, r.stdout[-2000:]
    assert r.stdout.count("pass graphs call") == 24, r.stdout[-2000:]


def _check_graphed_passes(rank, world):
    """FlexExchangeTuning.graph_max_tokens: the exchange's passes through the graph cache (its capture stood in
    for on the CPU: the pass itself, outputs copied), results equal to the eager call's on every call, with and
    without an lse gradient; a forward graph and a backward graph per lse gradient kept per plan."""
    import contextlib

    from longattn.dilated import graphs
    from longattn.flex import exchange_run

    class FakeGraph:
        def __init__(self, fn, inputs, pool=None):
            self.fn = fn

        def __call__(self, inputs, copies=None):
            return tuple(o.clone() for o in self.fn(*inputs))

    graphs.Graph, graphs.usable = FakeGraph, lambda x: True
    torch.cuda.device = lambda d: contextlib.nullcontext()
    mask = masks.local_global(64, 16)
    graphed = tuning.FlexExchangeTuning(graph_max_tokens=L)
    torch.manual_seed(3)
    s = world * L
    q, k, v, do = torch.randn(B, s, H, D), torch.randn(B, s, 2, D), torch.randn(B, s, 2, D), torch.randn(B, s, H, D)
    dl = torch.randn(B, H, s)
    for lse_grad in (None, dl):
        want = run_sharded(longattn.ring_flex_attention, q, k, v, do,
                           torch.zeros(B, H, s) if lse_grad is None else lse_grad, "zigzag", mask_mod=mask,
                           engine="exchange")[1:]
        for i in range(3):  # eager, captured, replayed
            got = run_sharded(longattn.ring_flex_attention, q, k, v, do,
                              torch.zeros(B, H, s) if lse_grad is None else lse_grad, "zigzag", mask_mod=mask,
                              engine="exchange", tuning=graphed)[1:]
            for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
                assert torch.equal(a, b), (rank, i, lse_grad is None)
    passes = sorted(key[0][0] for key in exchange_run.PASS_GRAPHS.graphs)
    assert passes == ["bwd", "fwd"], passes  # an lse gradient of zeros is still one: the same backward graph
    exchange_run.PASS_GRAPHS.clear()
    with pytest.raises(ValueError, match="graph_max_tokens"):
        tuning.FlexExchangeTuning(graph_max_tokens=-1)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_exchange_graphed_passes(world):
    run_world(_check_graphed_passes, world)


def _holes(b, h, q_idx, kv_idx):
    """Causal, but every 7th query (from 3) sees no key at all (its lse is -inf, out and gradients 0)."""
    return (kv_idx <= q_idx) & (q_idx % 7 != 3)


SHIP_SMALL = tuning.FlexExchangeTuning(ship_ratio=float("inf"), ship_max_work=float("inf"), heavy_min_blocks=1)
"""SHIP_ALL where a peer holds fewer than 4 key blocks (320 rows: 3)."""


def _check_batch_gqa_unaligned(rank, world):
    """Two batch rows, GQA, an lse gradient, 320 rows per rank (halo and shipped segments that end in a partial
    block of 64 rows), both layouts; rows that see no key; heavy global rows shipped to every peer (SHIP_ALL)."""
    local = 320
    for layout in ("zigzag", "contiguous"):
        for name, mask, hkv in [("local + global", masks.local_global(64, 16), 2),
                                ("sliding window", masks.sliding_window(100, 0), 1),
                                ("rows without keys", _holes, 2)]:
            _compare(f"world={world} {layout} {name} hkv={hkv} local={local}", world, layout, mask, hkv, batch=2,
                     local=local)
        mask = masks.local_global(64, 16)
        plan = _plan(torch.randn(2, local, H, D), mask, layout, tune=SHIP_SMALL, k=torch.randn(2, local, 2, D))
        if rank == 0:  # the global rows' block sees every peer's key blocks: shipped to every peer
            assert all(r[:128].tolist() == list(range(128)) for p, r in enumerate(plan.ship) if p), plan.ship
        _compare(f"world={world} {layout} local + global shipped", world, layout, mask, 2, batch=2, local=local,
                 op=_exchange_with(SHIP_SMALL))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])  # 4 ranks: test_exchange_halo_groups and test_exchange_batch_heads_zigzag
def test_exchange_batch_gqa_unaligned(world):
    run_world(_check_batch_gqa_unaligned, world)


def _flags(world, local, at):
    """Global-token flags: 16 tokens at local row ``at`` of ranks 0 and 2 (contiguous), none on ranks 1 and 3."""
    g = torch.zeros(world * local, dtype=torch.bool)
    for r in (0, 2):
        g[r * local + at:r * local + at + 16] = True
    return g


def _check_halo_groups(rank, world):
    """Halo executors over peers whose halos are non-consecutive (rank 1 sends rank 3 nothing): one launch where
    the earlier halos fill whole key blocks; apart where a halo ends in a partial block (then rows get three pieces
    and the accumulators must be float32: plan.out_pieces > 2)."""
    for local, at in ((512, 0), (320, 300)):
        mask = masks.local_global(64, _flags(world, local, at))
        plan = _plan(torch.randn(2, local, H, D), mask, k=torch.randn(2, local, 2, D))
        if rank == 3:
            assert len(plan.halo_in[1]) == 0 and len(plan.halo_in[0]) and len(plan.halo_in[2])
            spans = [(x.r0, x.r1, x.k0, x.k1) for x in plan.halo]
            if local % 128 == 0:  # peers 0 and 2 in one executor over every row
                assert spans == [(0, local, 0, sum(len(r) for r in plan.halo_in))], spans
                assert plan.out_pieces == 2
            else:  # peer 0's halo is its last, partial block: peer 2's runs apart, rows get own + 2 halo pieces
                assert len(spans) == 2 and plan.out_pieces == 3, (spans, plan.out_pieces)
        _compare(f"world={world} globals on ranks 0 and 2 at {at}, local={local}", world, "contiguous", mask, 2,
                 batch=2, local=local)


@pytest.mark.dist
def test_exchange_halo_groups():
    run_world(_check_halo_groups, 4)


def _check_few_keys(rank, world):
    """128 global tokens: a whole key block every row sees. On the ranks without them it runs as few-keys pieces
    (merged into the own piece's outputs, added into its dQ) over the runs of rows that see no other halo key
    (zigzag at 3 and 4 ranks: each chunk's middle); the halo pieces keep those keys for the rows around the
    shard's edges, apart before, between and after those runs (their dK/dV of the global keys summed with the
    few-keys pieces')."""
    mask = masks.local_global(64, 128)
    for layout in ("contiguous", "zigzag"):
        local = 2 * L  # chunks of 4 query blocks: an edge block each side, two blocks between
        plan = _plan(torch.randn(B, local, H, D), mask, layout, tune=FEW, k=torch.randn(B, local, 2, D))
        if rank == 0:  # its global rows are shipped: their partials merge apart, so no piece merges in place
            assert not plan.few and len(plan.heavy)
        else:
            spans = [(x.r0, x.r1, x.k0, x.k1) for x in plan.few]
            assert plan.few and all(isinstance(x.run, pieces.FewKeys) for x in plan.few), spans
            assert all(s[2:] == (0, 128) for s in spans), spans
            runs = 2 if layout == "zigzag" and world > 2 and rank < world - 1 else 1
            assert len(spans) == runs and sum(r1 - r0 for r0, r1, _, _ in spans) >= local // 2, spans
            assert all(p.r1 <= x.r0 or x.r1 <= p.r0 for p in plan.halo for x in plan.few), \
                [(p.r0, p.r1) for p in plan.halo]
            assert plan.out_pieces == 2
            if layout == "zigzag":  # rows before and after apart, over the same keys
                assert len(plan.halo) >= 2 and plan.halo[0].k0 == plan.halo[-1].k0 == 0, plan.halo
        _compare(f"world={world} {layout} 128 global tokens, few keys", world, layout, mask, 2, local=local,
                 op=_exchange_with(FEW))
    # the default: none on shards shorter than FlexExchangeTuning.few_keys_min_rows
    assert not _plan(torch.randn(B, L, H, D), mask, k=torch.randn(B, L, 2, D)).few
    assert tuning.FLEX_EXCHANGE.few_keys == 128 and tuning.FLEX_EXCHANGE.few_keys_min_rows > B * L
    for least, want in ((B * 2 * L, rank > 0), (B * 2 * L + 1, False)):  # batch x local rows against the least
        gate = tuning.FlexExchangeTuning(few_keys_min_rows=least)
        assert bool(_plan(torch.randn(B, 2 * L, H, D), mask, "zigzag", tune=gate, k=torch.randn(B, 2 * L, 2, D)).few) \
            == want, (least, rank)
    _compare(f"world={world} 128 global tokens, no few-keys piece", world, "contiguous", mask, 2)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_few_keys(world):
    run_world(_check_few_keys, world)


SHIP_ANY = tuning.FlexExchangeTuning(heavy_fraction=0.0, heavy_min_blocks=1, ship_ratio=float("inf"),
                                     ship_max_work=float("inf"))
"""Every query block that sees a key of a peer is shipped to it."""


def _split_peers(b, h, q_idx, kv_idx):
    """On 3 ranks of 129 rows (contiguous): rank 0's first block sees ranks 0 and 1, its last row (block 1)
    every key; every other row sees every key."""
    return (kv_idx < 258) | (q_idx >= 128)


def _check_odd_rows(rank, world, h, dtype):
    """One batch row; rows shipped to two peers, 129 to rank 1 and 1 to rank 2 (contiguous, 129 rows a rank).
    h=1: the served lse (B, n, H) is a transposed view whose size-1 dims make it "contiguous" with a last stride
    != 1, which ``view(torch.uint8)`` refuses. h=3, float64: the served partials (out float64, lse float32: 8 * 3
    * D + 12 bytes a row) come back to rank 0 as 129 rows from rank 1, then 1 row from rank 2 at a byte offset
    that is not a multiple of 8 in the received buffer, which ``view(torch.float64)`` refuses."""
    if h == 1:  # first the public op, default tuning: the global rows are shipped (one head, one batch row)
        _compare(f"world={world} one head local + global", world, "contiguous", masks.local_global(64, 16), 1,
                 heads=1)
    s = world * 129
    torch.manual_seed(3)
    q, k, v, do = (torch.randn(1, s, h, D, dtype=dtype) for _ in range(4))
    dl = torch.randn(1, h, s, dtype=dtype)
    plan = _plan(q[:, :129], _split_peers, tune=SHIP_ANY, k=k[:, :129])
    if rank == 0:
        assert [len(r) for r in plan.ship] == [0, 129, 1], [len(r) for r in plan.ship]
    us, out, lse, grads = run_sharded(_exchange_with(SHIP_ANY), q, k, v, do, dl.float(), "contiguous",
                                      mask_mod=_split_peers)
    assert_unsharded_matches(f"h={h} {dtype}", us, out, lse, grads,
                             lambda: flex_ref_grads(q, k, v, do, dl, _split_peers), TOL)


@pytest.mark.dist
@pytest.mark.parametrize("h,dtype", [(1, torch.float32), (3, torch.float64)])
def test_exchange_shipped_row_packing(h, dtype):
    run_world(_check_odd_rows, 3, h, dtype)


def _rows_of_rank_2(b, h, q_idx, kv_idx):
    """16 more global rows, the first of rank 2 (contiguous): they see every key."""
    return (q_idx >= 2 * L) & (q_idx < 2 * L + 16) & (kv_idx >= 0)


def _check_joined(rank, world):
    """join_halo: every peer's halo keys before mine in the own executor (one call per pass, no halo pieces);
    outputs, lse and gradients as the reference, global rows shipped and cleared against the joined halo (4
    ranks: zigzag alone, the suite's time)."""
    for layout in ("zigzag", "contiguous")[:2 if world < 4 else 1]:
        for name, mask, hkv in patterns(world):
            plan, apart = (_plan(torch.randn(B, L, H, D), mask, layout, tune=t, k=torch.randn(B, L, hkv, D))
                           for t in (JOIN, tuning.FLEX_EXCHANGE))
            fetched = sum(len(x) for x in apart.halo_in)
            # joined wherever halo pieces would run (the test's halos are whole key blocks), to the fetched keys
            assert (plan.joined, len(plan.halo)) == ((fetched, 0) if apart.halo else (0, 0)), (name, plan.joined)
            assert [len(x) for x in plan.ship] == [len(x) for x in apart.ship]
            _compare(f"world={world} {layout} {name} joined", world, layout, mask, hkv, op=_exchange_with(JOIN))
    # two batch rows, GQA, global rows shipped to every peer from two ranks: cleared in the joined table
    mask = masks.or_(masks.local_global(64, 16), _rows_of_rank_2) if world > 2 else masks.local_global(64, 16)
    plan = _plan(torch.randn(2, L, H, D), mask, tune=JOIN, k=torch.randn(2, L, 2, D))
    assert plan.joined and (rank not in (0, 2) or sum(len(x) for x in plan.ship) >= 128 * (world - 1)), plan.ship
    _compare(f"world={world} batch 2 joined", world, "contiguous", mask, 2, batch=2, op=_exchange_with(JOIN))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])  # 3 ranks: through the FA4 stand-in (test_exchange_through_fa4_stand_in)
def test_exchange_joined_halo(world):
    run_world(_check_joined, world)


def _rank_window(b, h, q_idx, kv_idx):
    """The same function on every rank (same qualified name, so the ranks' signatures agree), a valid bool mask,
    but a wider window on ranks other than 0: the ranks' plans disagree on how many rows each pair moves."""
    w = 40 if dist.get_rank() == 0 else 300
    return ((q_idx - kv_idx).abs() < w) | (kv_idx < 16)


def _rank_keys(b, h, q_idx, kv_idx):
    """As :func:`_rank_window`, but the plans move as many rows each way: every query sees itself and 16 keys of
    rank 1's shard (of 512 rows), its first block's on rank 0, its second block's elsewhere: rank 0 expects rank
    1's first block, rank 1 sends its second."""
    off = L if dist.get_rank() == 0 else L + 128
    return (kv_idx == q_idx) | ((kv_idx >= off) & (kv_idx < off + 16))


def _check_plans_disagree(rank, world):
    """Plans that do not fit together (rank r's rows for p differ from what p expects from r) must raise on every
    rank before the transfers; on main the all_to_all's split sizes disagree (gloo aborts the process with
    "Received data size doesn't match expected size"; NCCL may hang or corrupt memory), or, with as many rows of
    other keys, the transfer delivers the wrong keys without an error."""
    import datetime

    g = dist.new_group(timeout=datetime.timedelta(seconds=30))  # a hang fails in 30 s, not the default 30 min
    q = torch.randn(1, L, H, D)
    for mask in (_rank_window, _rank_keys):
        with pytest.raises(ValueError, match="plans disagree"):
            longattn.ring_flex_attention(q, q, q, mask_mod=mask, layout="contiguous", engine="exchange", group=g)
        assert_group_usable(world, g)


@pytest.mark.dist
def test_exchange_plans_that_disagree_raise_on_every_rank():
    run_world(_check_plans_disagree, 3)


def _per_batch(b, h, q_idx, kv_idx):
    """A window that depends on the batch row and the head, plus 16 global keys."""
    return ((q_idx - kv_idx).abs() < 30 + 60 * b + 10 * h) | (kv_idx < 16)


def _check_batch_heads_zigzag(rank, world):
    """A mask over batch rows and heads (block tables over (Bm, Hm)) in zigzag chunks of 160 rows; causal with
    every block that sees a peer's key shipped there (heavy rows shipped to several peers), also where rows
    see no key (their served partials: lse -inf)."""
    _compare(f"world={world} zigzag per batch row and head", world, "zigzag", _per_batch, 2, batch=2, local=320)
    _compare(f"world={world} zigzag causal, shipped", world, "zigzag", masks.causal(), 2, batch=2, local=320,
             op=_exchange_with(SHIP_ANY))
    _compare(f"world={world} contiguous rows without keys, shipped", world, "contiguous", _holes, 2, batch=2,
             local=320, op=_exchange_with(SHIP_ANY))


@pytest.mark.dist
@pytest.mark.parametrize("world", [3, 4])
def test_exchange_batch_heads_zigzag(world):
    run_world(_check_batch_heads_zigzag, world)


def test_transfer_blocks_read_back_in_place():
    """A transfer's bytes: one 16-byte-aligned block per tensor and peer, rows
    gathered straight in from (tensor, index) pairs; what arrives reads back
    as views of the buffer where one peer sent rows, one concatenation where
    several did (mixed dtypes, odd row counts, two batch rows)."""
    from longattn.flex.exchange_run import pack, unpack
    g = torch.Generator().manual_seed(0)
    kv, q = torch.randn(2, 9, 3, 5, generator=g).bfloat16(), torch.randn(2, 9, 3, 5, generator=g)
    lse = torch.randn(2, 3, 9, generator=g).transpose(1, 2)  # (B, 9, H) strided, as the exchange's
    rows = [torch.tensor([0, 4, 7]), torch.tensor([], dtype=torch.long), torch.tensor([1, 2, 3, 8, 5])]
    kv_parts = [[(kv, r), (kv * 2, r)] for r in rows]
    q_parts = [[q[:, :1], lse[:, :1]], [q[:, 2:5], lse[:, 2:5]], []]
    groups = [(kv_parts, [len(r) for r in rows], [_spec_of(kv)] * 2),
              (q_parts, [1, 3, 0], [_spec_of(q), ((3,), torch.float32)])]
    src, splits = pack(groups, 2, "cpu")
    assert all(s % 16 == 0 for s in splits) and src.numel() == sum(splits)
    (k_, v_), (q_, l_) = unpack(src, [(c, s) for _, c, s in groups], 2)
    every = torch.cat(rows)
    assert torch.equal(k_, kv[:, every]) and torch.equal(v_, 2 * kv[:, every])
    assert torch.equal(q_, torch.cat([q[:, :1], q[:, 2:5]], 1))
    assert torch.equal(l_, torch.cat([lse[:, :1], lse[:, 2:5]], 1))
    lone = unpack(src, [([3, 0, 0], [_spec_of(kv)] * 2)], 2)[0][0]  # one peer's rows: a view, no copy
    assert lone.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and torch.equal(lone, kv[:, rows[0]])


def _spec_of(t):
    return tuple(t.shape[2:]), t.dtype
