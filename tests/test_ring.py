"""Ring attention on gloo in spawned processes (world 2, 3, 4) against the
float64 single-device reference: outputs, lse and all gradients."""
import itertools

import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import BACKEND as DIST_BACKEND
from dist_utils import (assert_compiled_matches_eager, assert_group_usable, assert_unsharded_close,
                        dense_inputs, run_sharded, run_world)
from longattn.distributed import transport
from longattn.distributed.plan import num_steps, plan
from longattn.distributed.ring import BackendOp, RingSchedule, ring_backward
from longattn.distributed.transport import exchange, ring_transport
from reference import attention_ref, rel_err, window_mask

TOL = 1e-4

CONFIGS = [
    # (layout, causal, window, nheads_kv)
    *[(lay, c, (-1, -1), hkv) for lay, c, hkv in itertools.product(("contiguous", "zigzag"), (False, True), (4, 2, 1))],
    ("contiguous", True, (5, 0), 2),
    ("contiguous", True, (15, 0), 2),  # 3 steps at world 4: dK/dV's last hop skips a rank
    ("zigzag", True, (9, 0), 4),
    ("contiguous", False, (7, 3), 1),
    ("zigzag", False, (-1, 6), 2),
    ("contiguous", False, (2, 2), 4),
]


def _schedule(layout, world, rank, local_len, causal, window, scale):
    return RingSchedule(num_steps(layout, world, local_len, causal, window),
                        lambda src: plan(layout, rank, src, world, local_len, causal, window, scale))


def _check_configs(rank, world):
    for layout, causal, window, hkv in CONFIGS:
        torch.manual_seed(1234)
        b, s, h, d = 2, 2 * world * 5, 4, 16
        q, k, v, do, dl = dense_inputs(b, s, h, hkv, d)
        # reference in float64 on the full sequence
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = attention_ref(qr, kr, vr, causal=causal, window=window)
        ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
        us, out, lse, grads = run_sharded(longattn.ring_attention, q, k, v, do, dl, layout, causal=causal,
                                          window_size=window, backend="math")
        assert_unsharded_close(f"world={world} {layout} causal={causal} window={window} hkv={hkv}", us, out, lse,
                               grads, ro, rl, (qr.grad, kr.grad, vr.grad), TOL)
        # Without the K/V block the forward kept (the packed-document and dilated ops), the backward
        # fetches it first: the same blocks in the same order, so the same gradients to the bit.
        sh = lambda x, dim=1: longattn.shard(x, layout=layout, seq_dim=dim)
        dl_used = torch.where(torch.isfinite(lse), sh(dl, 2), 0).detach()
        fetched = ring_backward(sh(do), sh(q), sh(k), sh(v), out.detach(), lse.detach(), dl_used,
                                _schedule(layout, world, rank, s // world, causal, window, d ** -0.5),
                                BackendOp("math"), ring_transport(dist.group.WORLD))
        for got, want in zip(fetched, grads):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_reference(world):
    run_world(_check_configs, world)


def _check_module(rank, world):
    from longattn.nn import RingAttention

    for layout, causal, window in (("zigzag", True, (-1, -1)), ("contiguous", False, (5, 3))):
        torch.manual_seed(7)
        q, k, v, do, _ = dense_inputs(2, 2 * world * 3, 4, 2, 16)
        sh = lambda x: longattn.shard(x, layout=layout, seq_dim=1)
        m = RingAttention(causal=causal, softmax_scale=0.3, window_size=window, layout=layout, backend="math")
        got = [sh(x).requires_grad_() for x in (q, k, v)]
        out = m(*got)
        out.backward(sh(do))
        want = [sh(x).requires_grad_() for x in (q, k, v)]
        ref = longattn.ring_attention(*want, causal=causal, softmax_scale=0.3, window_size=window, layout=layout,
                                      backend="math")
        ref.backward(sh(do))
        # the module is the functional op with its arguments: the same results to the bit
        assert torch.equal(out, ref) and all(torch.equal(a.grad, b.grad) for a, b in zip(got, want)), (layout, rank)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        ro, _ = attention_ref(qd, kd, vd, causal=causal, window=window, scale=0.3)
        ro.backward(do.double())
        for name, g, w in (("out", out, ro), ("dq", got[0].grad, qd.grad), ("dk", got[1].grad, kd.grad),
                           ("dv", got[2].grad, vd.grad)):
            assert rel_err(g, sh(w)) < TOL, (name, layout, rank, rel_err(g, sh(w)))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_ring_module(world):
    """longattn.nn.RingAttention on shards: the functional ring_attention with the module's arguments (causal,
    scale, window, layout, backend), out and every gradient, and against the float64 reference unsharded."""
    run_world(_check_module, world)


def _check_triton_blocks(rank, world):
    """The ring's blocks on our Triton kernel (what a GPU without FA4 runs for windows and offsets; on CPU under
    the interpreter, where only a named backend takes it): offset and windowed blocks, GQA, the lse's gradient."""
    for layout, causal, window, hkv in (("zigzag", True, (9, 0), 2), ("contiguous", False, (7, 3), 1)):
        torch.manual_seed(99)
        q, k, v, do, dl = dense_inputs(1, 2 * world * 4, 2, hkv, 16)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = attention_ref(qr, kr, vr, causal=causal, window=window)
        ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
        us, out, lse, grads = run_sharded(longattn.ring_attention, q, k, v, do, dl, layout, causal=causal,
                                          window_size=window, backend="triton")
        assert_unsharded_close(f"triton world={world} {layout} causal={causal} window={window} hkv={hkv}", us, out,
                               lse, grads, ro, rl, (qr.grad, kr.grad, vr.grad), TOL)


@pytest.mark.dist
@pytest.mark.skipif(not longattn.kernels_available("cuda" if DIST_BACKEND == "nccl" else "cpu"),
                    reason="Triton kernels on the ranks' device: a GPU (NCCL) or TRITON_INTERPRET=1 (gloo)")
@pytest.mark.parametrize("world", [2, 3])
def test_ring_on_triton_blocks(world):
    run_world(_check_triton_blocks, world)


def _check_copy_transport(rank, world):
    """The copy-engine transport (peer memory) under both of its orderings:
    stream memory operations, and the barrier kernel it falls back to."""
    for sync in ("memops", "barrier"):
        transport.release_slots()
        with transport.use_transport("copy", copy_sync=sync):
            _check_configs(rank, world)
            ex = exchange(dist.group.WORLD)
            assert isinstance(ex, transport.CopyEngineP2P)
            # Hopper drivers run stream memory operations
            assert transport.slot_syncs() == {sync}, (sync, transport.slot_syncs())


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_copy_transport_matches_reference(world):
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (peer memory between ranks)")
    run_world(_check_copy_transport, world, backend="nccl")


def _check_transport_choice(rank, world):
    q = torch.randn(1, 4, 2, 8)
    with transport.use_transport("copy"):
        with pytest.raises(ValueError, match="transport 'copy' refused: backend gloo"):
            longattn.ring_attention(q, q, q)
    assert_group_usable(world)
    assert type(exchange(dist.group.WORLD)) is transport.P2P  # auto on gloo: send/recv
    with pytest.raises(ValueError, match="transport must be one of"):
        with transport.use_transport("nvlink"):
            pass


@pytest.mark.dist
def test_ring_transport_choice():
    run_world(_check_transport_choice, 2, backend="gloo")  # what gloo refuses and picks


def _check_compiled(rank, world):
    """torch.compile traces the ring op through its fake kernels (including the
    kept K/V block, present only in rings of more than one step) and gives the
    eager values and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4 * world, 2, 8) for _ in range(3))
    for window in ((-1, -1), (1, 0)):  # the second: a one-step ring, nothing kept
        f = lambda q, k, v: longattn.ring_attention(q, k, v, causal=True, window_size=window, layout="zigzag",
                                                    backend="math")
        assert_compiled_matches_eager(f, (q, k, v))


@pytest.mark.dist
def test_ring_under_torch_compile():
    run_world(_check_compiled, 2)


def _check_default_backend_and_positions(rank, world):
    torch.manual_seed(0)
    s = 4 * world
    q = torch.randn(1, s, 2, 8)
    for layout in ("contiguous", "zigzag"):
        pos = longattn.shard_positions(s, layout=layout)
        assert torch.equal(longattn.shard(torch.arange(s)[None], layout=layout)[0], pos)
        out = longattn.ring_attention(longattn.shard(q, layout=layout), longattn.shard(q, layout=layout),
                                      longattn.shard(q, layout=layout), causal=True, layout=layout)
        ref, _ = attention_ref(q, q, q, causal=True)
        assert rel_err(longattn.unshard(out, layout=layout), ref) < TOL
        # unshard is differentiable: d/dx_local of sum over ranks of (full * w).sum() = world * w_local
        x = longattn.shard(q, layout=layout).requires_grad_()
        full = longattn.unshard(x, layout=layout)
        (full * 3.0).sum().backward()
        assert torch.allclose(x.grad, torch.full_like(x, 3.0 * world))


@pytest.mark.dist
def test_positions_unshard_grad_default_backend():
    run_world(_check_default_backend_and_positions, 3)


def _check_mismatch_raises(rank, world):
    s = 6 if rank == 0 else 8  # ranks disagree on the local length
    q = torch.randn(1, s, 2, 8)
    with pytest.raises(ValueError, match="differ across ranks"):
        longattn.ring_attention(q, q, q)
    causal = rank == 1
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="differ across ranks"):
        longattn.ring_attention(q, q, q, causal=causal)
    assert_group_usable(world)  # no half-finished collective


@pytest.mark.dist
def test_mismatched_ranks_raise_instead_of_hanging():
    run_world(_check_mismatch_raises, 3)


def _check_subgroup(rank, world):
    # two sub-groups of 2 ranks in a world of 4, each running its own ring
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = groups[rank // 2]
    torch.manual_seed(rank // 2)
    q = torch.randn(1, 8, 2, 8)
    out = longattn.ring_attention(longattn.shard(q, group=g), longattn.shard(q, group=g),
                                  longattn.shard(q, group=g), causal=True, group=g, backend="math")
    ref, _ = attention_ref(q, q, q, causal=True)
    assert rel_err(longattn.unshard(out, group=g), ref) < TOL


@pytest.mark.dist
def test_subgroups():
    run_world(_check_subgroup, 4)


def test_plan_skips_blocks():
    # contiguous causal: rank 0 computes nothing from later ranks
    assert plan("contiguous", 0, 1, 4, 8, True, (-1, -1), 1.0) == ()
    # zigzag causal: every rank and step has the same amount of work
    work = lambda r, s: sum((c.q1 - c.q0) * (c.k1 - c.k0) for c in plan("zigzag", r, (r - s) % 4, 4, 8, True, (-1, -1), 1.0))
    for s in range(1, 4):
        assert len({work(r, s) for r in range(4)}) == 1
    # a causal window of 5 over chunks of 8 needs only the diagonal and one previous step
    assert num_steps("contiguous", 4, 8, True, (5, 0)) == 2
    assert num_steps("contiguous", 4, 8, False, (-1, -1)) == 4


def test_masked_blocks_cropped_bottom_right():
    """Every masked block a plan makes is bottom-right aligned (as flash-attn's
    kernels take masks) and covers exactly the block's visible pairs: windows
    across chunks (Gemma 2's sliding layers in the ring) and the causal diagonal."""
    from longattn.distributed.plan import masked_call

    ql, kl = 16, 12
    cases = 0
    for qg, kg in itertools.product(range(0, 40, 3), range(0, 40, 5)):
        for causal, window in [(True, (-1, -1)), (True, (5, -1)), (True, (0, -1)), (True, (13, 0)),
                               (False, (4, 2)), (False, (-1, 3)), (False, (6, -1)), (False, (0, 0))]:
            want = window_mask(ql, kl, causal=causal, window=window, q_offset=qg - kg)
            call = masked_call(qg, 100, ql, kg, 200, kl, causal, window, 1.0, 0.0)
            got = torch.zeros(ql, kl, dtype=torch.bool)
            if call is not None:
                sq, sk = call.q1 - call.q0, call.k1 - call.k0
                assert call.spec.q_offset == sk - sq or not call.spec.masked
                spec = call.spec
                got[call.q0 - 100:call.q1 - 100, call.k0 - 200:call.k1 - 200] = window_mask(
                    sq, sk, causal=spec.causal, window=spec.window, q_offset=spec.q_offset)
                cases += 1
            assert torch.equal(got, want), (qg, kg, causal, window, call)
    assert cases > 300
    # the ring of a causal window of 5 over chunks of 8: the previous chunk's block is cropped to its band
    (call,) = plan("contiguous", 1, 0, 4, 8, True, (5, 0), 1.0)
    assert (call.q0, call.q1, call.k0, call.k1) == (0, 5, 3, 8) and call.spec.q_offset == 0


def _check_bad_inputs(rank, world):
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="layout"):
        longattn.ring_attention(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="even local seqlen"):
        longattn.ring_attention(q[:, :5], q[:, :5], q[:, :5], layout="zigzag")
    with pytest.raises(ValueError, match="multiple of nheads"):
        longattn.ring_attention(q, q[:, :, :1].expand(1, 6, 3, 8).contiguous(), q[:, :, :1].expand(1, 6, 3, 8).contiguous())
    with pytest.raises(TypeError, match="window_size"):
        longattn.ring_attention(q, q, q, window_size=3)
    with pytest.raises(ValueError, match="divisible"):
        longattn.shard(torch.randn(1, 10, 2, 8), layout="zigzag")  # 10 tokens over 2*3 chunks
    cu = torch.tensor([0, 5, 30], dtype=torch.int32)  # zigzag over 3 ranks: 2 + 8 = 10 local tokens
    with pytest.raises(ValueError, match="shard_varlen"):
        longattn.ring_attention_varlen(q[0], q[0], q[0], cu)  # 6 local tokens given
    with pytest.raises(ValueError, match="int32"):
        longattn.ring_attention_varlen(q[0], q[0], q[0], cu.long())
    with pytest.raises(ValueError, match="divide the shard length"):
        longattn.dilated_attention(q, q, q, segment_lengths=[4], dilation_rates=[1], group=dist.group.WORLD)
    assert_group_usable(world)  # nothing half-started


@pytest.mark.dist
def test_bad_inputs_raise_before_any_collective():
    run_world(_check_bad_inputs, 3)


def test_accumulate_into_empty_buffer_handles_partial_overlaps():
    """The backward's float32 accumulators start as torch.empty: every row must
    end as the plain sum of the calls that touched it, 0 where none did, for
    call ranges that repeat, nest or partly overlap (window plans mix whole-shard
    and chunk ranges)."""
    from longattn.distributed.accumulate import RowSums

    n = 12
    calls = [(2, 6), (2, 6), (4, 10), (0, 3), (8, 9)]
    acc = RowSums(torch.full((1, n, 1), float("nan")))
    want = torch.zeros(1, n, 1)
    for i, (a, b) in enumerate(calls):
        x = torch.full((1, b - a, 1), float(i + 1))
        acc.add(a, b, x)
        want[:, a:b] += x
    torch.testing.assert_close(acc.zero_unwritten(), want, rtol=0, atol=0)


def test_merged_rows_partial_overlaps_merge_every_block():
    """The forward's running (out, lse) over call ranges that partly overlap
    (cropped window blocks): a block over rows an earlier merge reached merges
    with them, never copies over them; rows no block reached are 0 / -inf."""
    from longattn.distributed.accumulate import MergedRows

    n, g = 12, torch.Generator().manual_seed(0)
    q = torch.zeros(1, n, 2, 4, dtype=torch.float64)
    acc = MergedRows(q, q.dtype)
    want_o = torch.zeros(1, n, 2, 4, dtype=torch.float64)
    want_l = torch.full((1, 2, n), float("-inf"), dtype=torch.float64)
    for a, b in [(0, 6), (4, 6), (6, 9), (6, 11), (9, 11), (0, 3)]:
        ob = torch.randn(1, b - a, 2, 4, generator=g, dtype=torch.float64)
        lb = torch.randn(1, 2, b - a, generator=g, dtype=torch.float64).float()
        acc.add(a, b, ob, lb)
        lo, lb64 = want_l[:, :, a:b], lb.double()
        new = torch.logaddexp(lo, lb64)
        wa, wb = (lo - new).exp().transpose(1, 2)[..., None], (lb64 - new).exp().transpose(1, 2)[..., None]
        want_o[:, a:b] = want_o[:, a:b] * wa + ob * wb
        want_l[:, :, a:b] = new
    out, lse = acc.result()
    torch.testing.assert_close(out, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_l, rtol=1e-5, atol=1e-6)
    assert (out[:, 11:] == 0).all() and (lse[:, :, 11:] == float("-inf")).all()


def test_forward_keeps_output_dtype_only_for_one_merge():
    """Rows merged at most once accumulate in the output dtype (one rounding,
    as the float32 accumulator's final cast); rings with more merges per row
    accumulate in float32."""
    from longattn.distributed.accumulate import max_cover

    def cover(layout, world, causal):
        return max(max_cover([plan(layout, r, (r - s) % world, world, 64, causal, (-1, -1), 1.0)
                              for s in range(world)]) for r in range(world))

    assert cover("zigzag", 2, True) == 2 and cover("contiguous", 2, False) == 2
    assert cover("zigzag", 4, True) == 4 and cover("contiguous", 3, False) == 3


def _check_bf16(rank, world):
    """bf16 through the output-dtype accumulators (output, dQ) and the
    input-dtype dK/dV hop (world 2) or float32 sums (world 3): the ring's
    errors against float64 (output and gradients) stay within 2x
    single-device bf16's."""
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        torch.manual_seed(7)
        b, s, h, d = 1, 24 * world, 4, 32
        q, k, v, do = (torch.randn(b, s, h, d) for _ in range(4))
        ref = [x.double().requires_grad_() for x in (q, k, v)]
        ro = attention_ref(*ref, causal=causal)[0]
        ro.backward(do.double())
        one = [x.bfloat16().requires_grad_() for x in (q, k, v)]
        so = longattn.attention(*one, causal=causal, backend="math")
        so.backward(do.bfloat16())
        sh = lambda x: longattn.shard(x.bfloat16(), layout=layout)
        loc = [sh(x).requires_grad_() for x in (q, k, v)]
        out = longattn.ring_attention(*loc, causal=causal, layout=layout, backend="math")
        out.backward(sh(do))
        assert out.dtype == torch.bfloat16 and all(x.grad.dtype == torch.bfloat16 for x in loc)
        us = lambda x: longattn.unshard(x, layout=layout)
        for name, got, single, want in zip(("out", "dq", "dk", "dv"), [out.detach()] + [x.grad for x in loc],
                                           [so.detach()] + [x.grad for x in one], [ro.detach()] + [x.grad for x in ref]):
            e, base = rel_err(us(got), want), rel_err(single, want)
            assert e < 2 * base, (world, layout, causal, name, e, base)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_ring_bf16_error_within_single_device(world):
    run_world(_check_bf16, world)


def _check_backward_follows_forward(rank, world):
    """A forward under ``use_backend("math")`` whose backward runs after the
    block has closed: every block's backward runs math, as the forward did
    (on CPU float32, "auto" would take the flash CPU kernel for full blocks).
    The ring, the packed-document ring and Ulysses."""
    from longattn import backends as bk

    calls = {"math": 0, "flash": 0}
    for name in calls:
        real = bk.BACKENDS[name].backward

        def counted(*a, _name=name, _real=real, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        bk.BACKENDS[name].backward = counted  # this forked rank's instance only
    torch.manual_seed(0)
    q, k, v = (longattn.shard(torch.randn(1, 4 * world, 6, 8), layout="zigzag").requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 3, 4 * world], dtype=torch.int32)
    qv, kv, vv = (longattn.shard_varlen(torch.randn(4 * world, 2, 8), cu)[0].requires_grad_() for _ in range(3))
    runs = [lambda: longattn.ring_attention(q, k, v, layout="zigzag"),
            lambda: longattn.ring_attention_varlen(qv, kv, vv, cu),
            lambda: longattn.ulysses_attention(q, k, v, layout="zigzag")]
    for run in runs:
        out = run()  # auto, for the counts to compare with
        out.sum().backward()
        assert calls["flash"] > 0, calls
        calls.update(math=0, flash=0)
        with longattn.use_backend("math"):
            out = run()
        out.sum().backward()
        assert calls["math"] > 0 and calls["flash"] == 0, calls
        calls.update(math=0, flash=0)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_backward_runs_the_forwards_backend(world):
    run_world(_check_backward_follows_forward, world, backend="gloo")  # counts CPU float32's backends


def _check_plan_refused_on_one_rank(rank, world):
    """A forced backend that only one rank's blocks refuse: every rank raises
    when the call is planned, before any ring step (none waits in the ring)."""
    from longattn import backends as bk

    flash = bk.BACKENDS["flash"]
    real = flash._extra_refusals
    flash._extra_refusals = lambda spec, q, k: real(spec, q, k) + (["refused on rank 1"] if rank == 1 else [])
    q = torch.randn(1, 6, 2, 8)  # a shape no earlier call selected a backend for
    with pytest.raises(ValueError, match="refused on rank 1" if rank == 1 else r"rank\(s\) \[1\]"):
        longattn.ring_attention(q, q, q, backend="flash")
    assert_group_usable(world)


@pytest.mark.dist
def test_plan_refused_on_one_rank_raises_on_every_rank():
    run_world(_check_plan_refused_on_one_rank, 2, backend="gloo")  # patches the CPU flash backend


def _check_plan_per_group(rank, world):
    """Rank 0 holds the same rank and size in two groups: its plan of the
    first call is not reused for the second, whose peer plans (and agrees)."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 2])
    q = torch.randn(1, 8, 2, 8)
    if rank in (0, 1):
        longattn.ring_attention(q, q, q, group=a)
    if rank in (0, 2):
        longattn.ring_attention(q, q, q, group=b)
    assert_group_usable(world)


@pytest.mark.dist
def test_ring_plan_per_group():
    run_world(_check_plan_per_group, 3, backend="gloo")


def test_ring_plan_key_round_trip():
    """A plan travels through the custom ops as its key and comes back equal;
    one made at a traced call (no blocks yet) is completed by the planner."""
    from longattn.distributed.ring_plan import RingPlan

    spec = longattn.backends.BlockSpec(0.5, True, (-1, -1), 3)
    q, k = torch.empty(1, 4, 2, 8), torch.empty(1, 7, 1, 8)
    plan = RingPlan("auto", (((0.5, True, -1, -1, 3, 0.0, 4, 7, 2, 1), "math"),), True, "copy", "barrier")
    assert RingPlan.from_key(plan.key()) == plan and plan.backend_of(spec, q, k) == "math"
    with pytest.raises(RuntimeError, match="not in the call's plan"):
        plan.backend_of(spec, q, k[:, :6])
    traced_key = '["math", null, false, "auto", "memops"]'  # as ring_plan.make spells it while traced
    traced = RingPlan.from_key(traced_key)
    assert traced == RingPlan("math", None, False, "auto", "memops") and traced.key() == traced_key
    assert traced.complete(lambda b, tr: RingPlan(b, (), False, *tr)) == RingPlan("math", (), False, "auto", "memops")
    assert plan.complete(None) is plan
