"""Dilated attention against the float64 definition (tests/reference.py):
gather path on every CPU backend, and the fused Triton kernel under the
interpreter."""
import json

import pytest
import torch

import longattn
from longattn.dilated import schedule as dsched
from longattn.tuning import DilatedTuning
from reference import check_op, dilated_masks, dilated_ref, rel_err, results

TOL = 1e-4

CONFIGS = [
    # (seqlen, nheads, nheads_kv, segment_lengths, dilation_rates, causal)
    (32, 4, 4, [8, 16, 32], [1, 2, 4], False),       # the LongNet pattern, exact fit
    (40, 4, 4, [8, 16, 32], [1, 2, 4], True),        # partial last segments
    (24, 4, 2, [64], [2], False),                    # segment > seqlen, no r=1 branch: uncovered rows
    (30, 6, 3, [7, 12], [3, 4], True),               # heads not a multiple of rates, w % r != 0
    (37, 4, 1, [8, 20], [1, 3], False),              # MQA, odd length
    (36, 8, 2, [6, 9, 36], [1, 2, 8], True),         # GQA, rate 8 with 8 heads
    (16, 2, 2, [4, 8], [4, 8], False),               # rates > heads
    (28, 4, 2, [16, 6], [2, 1], True),               # the rate-1 branch listed last (it runs first)
]


def _dilated(segs, rates, causal, backend, tuning=None):
    return lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                      causal=causal, return_lse=True, backend=backend, tuning=tuning)


def _inputs(cfg, dtype, batch=1):
    s, h, hkv, _, _, _ = cfg
    q, k, v = torch.randn(batch, s, h, 16), torch.randn(batch, s, hkv, 16), torch.randn(batch, s, hkv, 16)
    return [x.to(dtype) for x in (q, k, v)], torch.randn(batch, s, h, 16).to(dtype), torch.randn(batch, h, s)


def _check_cfg(cfg, backend, tuning=None):
    _, _, _, segs, rates, causal = cfg
    (q, k, v), do, dl = _inputs(cfg, torch.float32)
    check_op(_dilated(segs, rates, causal, backend, tuning), lambda q, k, v: dilated_ref(q, k, v, segs, rates,
                                                                                          causal=causal),
             [q, k, v], do, dl, TOL, tag=f"{cfg} {backend}")


def _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, backend, tuning=None):
    """dilated_attention(backend) against the float64 definition: output, lse
    and all gradients within TOL."""
    check_op(_dilated(segs, rates, causal, backend, tuning),
             lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=causal), [q, k, v], do, dl, TOL)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("backend", ["math", "flash"])
def test_local_backends(cfg, backend):
    """Views (MHA; GQA whose rates and group size divide) or gathered blocks through each CPU backend."""
    _check_cfg(cfg, backend)


@pytest.mark.parametrize("cfg", CONFIGS[:4])
def test_gather_engine_forced(cfg):
    _check_cfg(cfg, "math", DilatedTuning(schedule="gather"))


triton_ok = pytest.mark.skipif(not longattn.kernels_available(),
                               reason="Triton kernels run on CPU only under TRITON_INTERPRET=1 with triton installed")


@triton_ok
@pytest.mark.parametrize("cfg", CONFIGS)
def test_triton_kernel_float32(cfg):
    _check_cfg(cfg, "triton")


@triton_ok
@pytest.mark.parametrize("cfg", CONFIGS[:3])
def test_triton_kernel_float16(cfg):
    # fp16 inputs: within 2x the error of the math path on the same fp16 inputs
    _, _, _, segs, rates, causal = cfg
    (q, k, v), do, dl = _inputs(cfg, torch.float16)
    want = results(lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=causal), [x.double() for x in (q, k, v)],
                   do, dl)
    math_err = {n: rel_err(t, want[n]) for n, t in results(_dilated(segs, rates, causal, "math"), [q, k, v], do,
                                                            dl).items()}
    got = results(_dilated(segs, rates, causal, "triton"), [q, k, v], do, dl)
    for n in ("out", "dq", "dk", "dv"):
        assert rel_err(got[n], want[n]) < max(2 * math_err[n], 2e-3), n


def test_uncovered_rows_zero_out_neg_inf_lse_zero_grad():
    s, h = 12, 2
    q = torch.randn(1, s, h, 8, requires_grad=True)
    out, lse = longattn.dilated_attention(q, q, q, segment_lengths=[4], dilation_rates=[2], return_lse=True)
    covered = dilated_masks(s, h, [4], [2], False)[0].any(-1)  # (H, S)
    assert torch.equal(out[0].transpose(0, 1)[~covered], torch.zeros_like(out[0].transpose(0, 1)[~covered]))
    assert torch.isneginf(lse[0][~covered]).all() and torch.isfinite(lse[0][covered]).all()
    out.sum().backward()
    assert not torch.isnan(q.grad).any()


def test_pair_count_matches_masks():
    for s, h, _, segs, rates, causal in CONFIGS:
        want = sum(int(m.sum()) for m in dilated_masks(s, h, segs, rates, causal))
        assert longattn.dilated.pair_count(s, segs, rates, h, causal) == want


@pytest.mark.parametrize("kw,exc,match", [
    (dict(segment_lengths=[8, 16], dilation_rates=[1]), ValueError, "same length"),
    (dict(segment_lengths=[8, 0], dilation_rates=[1, 2]), ValueError, "positive"),
    (dict(segment_lengths=[8], dilation_rates=[-1]), ValueError, "positive"),
    (dict(segment_lengths=8, dilation_rates=[1]), TypeError, "segment_lengths"),
    (dict(segment_lengths=[8.0], dilation_rates=[1]), TypeError, "ints"),
    (dict(segment_lengths=[8], dilation_rates=[1], backend="cudnn"), ValueError, "cudnn"),
])
def test_bad_dilation_args(kw, exc, match):
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(exc, match=match):
        longattn.dilated_attention(q, q, q, **kw)


def test_bad_shapes():
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="same seqlen"):
        longattn.dilated_attention(q, q[:, :8], q[:, :8], segment_lengths=[4], dilation_rates=[1])
    with pytest.raises(ValueError, match="4 dims"):
        longattn.dilated_attention(q[0], q, q, segment_lengths=[4], dilation_rates=[1])


@triton_ok
@pytest.mark.parametrize("d", [96, 256])
def test_triton_kernel_padded_and_large_head_dims(d):
    """96 runs padded to a 128-wide tile with masked loads; 256 uses its own tiles."""
    q, k, v = torch.randn(1, 20, 2, d), torch.randn(1, 20, 1, d), torch.randn(1, 20, 1, d)
    do = torch.randn_like(q)
    fn = lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=[8, 20], dilation_rates=[1, 2],
                                                    causal=True, return_lse=True, backend="triton")
    check_op(fn, lambda q, k, v: dilated_ref(q, k, v, [8, 20], [1, 2], causal=True), [q, k, v], do, tol=TOL)


@pytest.mark.parametrize("gather_rows", [0, DilatedTuning().gather_max_rows])
@pytest.mark.parametrize("causal", [False, True])
def test_views_path_stacks_branch_classes(causal, gather_rows):
    """The MHA views path stacks a branch's offset classes into one strided
    view per segment (Hc > 1) or one for the branch (one head per class), or,
    for a small branch, one call on gathered copies of it (the forward and
    the causal backward gather: here every branch with Hc > 1); batch > 1
    checks the views' batch offsets. Against float64."""
    s, h, segs, rates = 64, 8, [8, 32, 64], [2, 4, 8]
    kinds = {(u.part is not None, u.seg >= 0, u.gathered) for u in dsched.units(s, segs, rates, h, gather_rows)}
    if gather_rows:  # the two small branches gathered, one head per class stacked as heads
        assert kinds == {(False, False, True), (False, False, False)}
    else:  # per class, per segment, whole branch
        assert kinds == {(True, False, False), (False, True, False), (False, False, False)}
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, s, h, 16) for _ in range(4))
    dl = torch.randn(2, h, s)
    _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, "math",
                        DilatedTuning(schedule="views", gather_max_rows=gather_rows))


@pytest.mark.parametrize("causal", [False, True])
def test_segments_longer_than_the_sequence_stack(causal):
    """A segment longer than the sequence is the sequence (p % w == p): its
    branch stacks as one full segment (no per-class partial parts: calls
    cost host time) and the result matches float64."""
    s, h, segs, rates = 48, 8, [16, 64, 128], [1, 2, 4]
    assert all(u.part is None or u.part.r == 1 for u in dsched.units(s, segs, rates, h, 0))
    assert dsched.pair_count(s, segs, rates, h, causal) == dsched.pair_count(s, [16, 48, 48], rates, h, causal)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, 16) for _ in range(4))
    dl = torch.randn(1, h, s)
    _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, "math", DilatedTuning(schedule="views"))


def test_graph_and_stream_choices():
    """Graphed passes below the token thresholds (MHA and GQA apart), side
    streams inside graphs only by default; CPU calls never graph (graphs.run
    is then the function itself)."""
    from longattn.dilated import graphs
    from longattn.dilated.plan import choose

    t = DilatedTuning()
    assert t.graphs(t.graph_max_tokens, True, 128) and not t.graphs(t.graph_max_tokens + 1, True, 128)
    assert t.graphs(t.graph_max_tokens_causal, True, 128, causal=True)
    assert not t.graphs(t.graph_max_tokens_causal + 1, True, 128, causal=True)
    assert t.graph_max_tokens_causal > t.graph_max_tokens  # 32K causal graphed, 32K non-causal eager on cuDNN
    assert t.graphs(t.graph_max_tokens_fa4, True, 128, fa4=True) and not t.graphs(t.graph_max_tokens_fa4 + 1, True,
                                                                                  128, fa4=True)
    assert t.graph_max_tokens_fa4 > t.graph_max_tokens  # FA4's heavier host time: 32K non-causal graphed too
    assert t.graphs(t.graph_max_tokens_causal, True, 128, True, fa4=True)
    never, always = t.graphs_up_to(0), t.graphs_up_to(1 << 40)
    for case in [(1, True, 128), (1, True, 128, False, True), (1, True, 128, True), (1, True, 64), (1, False, 128)]:
        assert not never.graphs(*case) and always.graphs(*case)
    assert t.graphs(t.graph_max_tokens_d64, True, 64) and not t.graphs(t.graph_max_tokens_d64 + 1, True, 64)
    assert t.graphs(t.graph_max_tokens_gqa, False, 128) and not t.graphs(t.graph_max_tokens_gqa + 1, False, 128)
    assert t.concurrent(True) and not t.concurrent(False)
    assert DilatedTuning(concurrent_calls="always").concurrent(False)
    assert not DilatedTuning(concurrent_calls="never").concurrent(True)
    with pytest.raises(ValueError, match="concurrent_calls"):
        DilatedTuning(concurrent_calls="sometimes")
    q = torch.randn(1, 64, 4, 8)
    plan = choose(q, q, [16, 32], [1, 2], False, "auto")
    assert not plan.graphs and not plan.concurrent
    assert graphs.run(("k",), lambda x: (x + 1,), (q,))[0].equal(q + 1) and not graphs._graphs


def test_base_unit_adoption_limits():
    """The rate-1 branch's whole-unit results become the output up to 2**31
    elements (1M tokens x 16 heads x 128: every index fits in int32) and the
    gradients only up to the tuning's adopt_bwd_max_elems (cuDNN's float32 dQ
    buffer is the call's size); batch > 1 never."""
    from longattn.dilated.views import adoptable

    bwd_limit = DilatedTuning().adopt_bwd_max_elems
    one_m = torch.empty(1, 1 << 20, 16, 128, device="meta")
    assert adoptable(1, one_m, 2 ** 31)
    assert not adoptable(1, torch.empty(1, (1 << 20) + 1, 16, 128, device="meta"), 2 ** 31)
    assert not adoptable(1, one_m, bwd_limit)
    assert adoptable(1, torch.empty(1, bwd_limit // 2048, 16, 128, device="meta"), bwd_limit)
    assert not adoptable(1, torch.empty(2, 64, 16, 128, device="meta"), 2 ** 31)
    assert not adoptable(2, torch.empty(1, 64, 16, 128, device="meta"), 2 ** 31)


def fused_with(tuner, segs, rates, causal, schedule, scale=16 ** -0.5):
    """The fused engine's passes with an explicit autotuner, as an autograd function returning (out, lse)."""
    from longattn.dilated import fused

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            o, l = fused.forward(q, k, v, segs, rates, causal, scale, schedule, tuner=tuner)
            ctx.save_for_backward(q, k, v, o, l)
            return o, l

        @staticmethod
        def backward(ctx, do, dl):
            q, k, v, o, l = ctx.saved_tensors
            return fused.backward(do, q, k, v, o, l, dl, segs, rates, causal, scale, schedule, tuner=tuner)

    return F.apply


@triton_ok
def test_triton_autotune_per_shape(tmp_path):
    """With autotuning on, the first call of each (kind, rows per segment class,
    grid size, causal, GQA group, ...) times the candidates on scratch buffers and keeps
    the fastest; later calls reuse it, later processes too (the cache file);
    the results stay exact. The timer is replaced so a non-default tile wins
    (the interpreter's times mean nothing)."""
    from longattn.kernels.autotune import CPU_CANDIDATES, Autotuner

    want = CPU_CANDIDATES[1]
    trials = []

    def fake_time(fn, device):
        fn()  # runs the trial into scratch: must leave the real outputs alone
        trials.append(1)
        return 1.0 if CPU_CANDIDATES[len(trials) % len(CPU_CANDIDATES) - 1] is want else 2.0

    tuner = Autotuner(mode="1", cache_dir=str(tmp_path), timer=fake_time)
    s, h, hkv, segs, rates = 40, 4, 2, [8, 16, 32], [1, 2, 4]
    q, k, v = torch.randn(1, s, h, 16), torch.randn(1, s, hkv, 16), torch.randn(1, s, hkv, 16)
    do, dl = torch.randn(1, s, h, 16), torch.randn(1, h, s)
    ref = lambda causal: lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=causal)
    run = lambda tuner, causal: check_op(fused_with(tuner, segs, rates, causal, "per_branch"), ref(causal),
                                         [q, k, v], do, dl, TOL)
    with pytest.warns(UserWarning, match="autotuning"):  # the first tuning says so, once
        run(tuner, False)  # a launch per branch: per-branch keys
    run(tuner, True)
    # rows per class 8 (w/r) in every branch: one bucket; grids of 5, 3 and 2
    # segments x 4 heads: three buckets; 3 kinds; 2 causal flags
    grids = {(4 * -(-s // w) - 1).bit_length() for w in segs}
    assert len(grids) == 3
    assert sorted((key[0], key[-2], key[-1]) for key in tuner.by_shape) == sorted(
        (kind, n, c) for kind in ("fwd", "dkdv", "dq") for n in grids for c in (False, True))
    assert all(cfg is want for cfg in tuner.by_shape.values())
    n = len(trials)
    assert n == len(tuner.by_shape) * len(CPU_CANDIDATES)
    run(tuner, False)
    assert len(trials) == n  # cached
    fresh = Autotuner(mode="1", cache_dir=str(tmp_path), timer=fake_time)  # a new process: choices from the file
    assert len(json.load(open(tmp_path / "triton_tiles.json"))) == n // len(CPU_CANDIDATES)
    run(fresh, True)
    assert len(trials) == n and len(fresh.by_shape) == len(tuner.by_shape) // 2
    assert all(tuner.by_shape[key] == cfg for key, cfg in fresh.by_shape.items())
    off = Autotuner(mode="0", cache_dir=str(tmp_path), timer=fake_time)
    run(off, False)
    assert not off.by_shape and len(trials) == n


def test_grouped_plan_where_branches_nest():
    """The grouped schedule needs every rate to divide the largest rate R0,
    R0 to divide the shortest segment W0 and W0 every segment (a segment
    covering the sequence counts as one segment)."""
    from longattn.kernels.geometry import GroupedPlan

    p = GroupedPlan.of(32768, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], False)
    assert (p.w, p.r0, p.max_m, p.nseg) == (2048, 16, 128, 16)
    p = GroupedPlan.of(24, [64], [2], True)  # one segment over the sequence
    assert (p.w, p.r0, p.segs) == (24, 2, [24])
    p = GroupedPlan.of(40, [8, 16, 64], [1, 2, 4], False)  # partial last segments, a whole-sequence branch
    assert (p.w, p.r0, p.segs, p.nseg) == (8, 4, [8, 16, 40], 5)
    for segs, rates in (([7, 12], [3, 4]), ([8, 20], [1, 3]), ([4, 8], [4, 8]), ([8, 12], [1, 2])):
        assert GroupedPlan.of(40, segs, rates, False) is None
    # the default fused schedule: grouped for short nested classes only (<= 512 keys per class)
    from longattn.dilated.plan import grouped_runs

    assert grouped_runs(32768, [256, 512, 1024], [1, 2, 4])
    assert not grouped_runs(32768, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert not grouped_runs(32768, [256, 384], [1, 2])  # short, but 256 does not divide 384


@triton_ok
@pytest.mark.parametrize("schedule", ["grouped", "per_branch", "per_branch_zero_fill"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_schedules(schedule, causal):
    """Nested branches run grouped (one launch per kernel) by default; the
    per-branch launches (a rate-1 branch writing first, or all merging into
    zeros) compute the same function. GQA, partial last segments, a branch
    whose segment covers the sequence."""
    s, h, hkv, segs, rates = 44, 4, 2, [8, 16, 64], [2, 1, 4]
    q, k, v = torch.randn(1, s, h, 16), torch.randn(1, s, hkv, 16), torch.randn(1, s, hkv, 16)
    _assert_matches_ref(q, k, v, torch.randn(1, s, h, 16), torch.randn(1, h, s), segs, rates, causal, "auto",
                        DilatedTuning(schedule=schedule))


def test_dedup_chain():
    """Branches form a chain when, sorted by (rate, segment), each rate divides
    the next and each segment nests in the next; each branch then skips the
    previous segment's sub-blocks (inner = w_prev / r class indices)."""
    from longattn.kernels.geometry import DEDUP_MAX_BRANCHES, dedup_chain

    c = dedup_chain(32768, [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert [(b.w, b.r, b.inner) for b in c] == [(2048, 1, 0), (4096, 2, 1024), (8192, 4, 1024), (16384, 8, 1024),
                                                (32768, 16, 1024)]
    c = dedup_chain(72, [64, 32, 128], [2, 1, 4])  # given out of order; 128 covers the sequence
    assert [(b.index, b.inner) for b in c] == [(1, 0), (0, 16), (2, 16)]
    c = dedup_chain(96, [128, 256], [1, 2])  # the first segment covers the sequence: the second adds no pair
    assert c[1].inner >= 96
    assert dedup_chain(64, [32, 32], [1, 1])[1].inner == 32  # a repeated branch: all its pairs are the first's
    for segs, rates in (([32, 48], [1, 2]), ([64, 32], [1, 2]), ([32, 64], [2, 3]), ([16, 32], [1, 2])):
        assert dedup_chain(256, segs, rates) is None  # no nesting, rates that do not divide, inner 8 < 16
    n = DEDUP_MAX_BRANCHES + 1
    assert dedup_chain(1 << 20, [16 << i for i in range(n)], [1 << i for i in range(n)]) is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segs,rates,seqlen", [([32, 64, 128, 256], [1, 2, 4, 8], 300), ([64, 32, 128], [2, 1, 4], 72),
                                               ([64, 128], [2, 4], 200), ([32, 32], [1, 1], 80)])
def test_dedup_multiplicity_is_the_union(segs, rates, seqlen, causal):
    """What the dedup kernels compute, written with masks: each chained branch
    without the previous branch's segment, each pair weighted by 1 + the later
    branches that select both its query and its key (min of the two levels),
    sums to the union's multiplicity at every (head, query, key)."""
    from longattn.kernels.geometry import dedup_chain

    h = 8
    masks = dilated_masks(seqlen, h, segs, rates, causal)
    want = sum(m.long() for m in masks)
    chain = dedup_chain(seqlen, segs, rates)
    pos, heads = torch.arange(seqlen), torch.arange(h)[:, None]
    got = torch.zeros_like(want)
    computed = 0
    for b in chain:
        m = masks[b.index].long()
        if b.rank:
            wp = min(segs[chain[b.rank - 1].index], seqlen)
            m = m * (pos[:, None] // wp != pos[None, :] // wp)
        level = lambda x: 1 + sum((((x - heads) % c.r == 0).long() for c in chain[b.rank + 1:]),
                                  torch.zeros(h, seqlen, dtype=torch.long))  # (H, S)
        got += m * torch.minimum(level(pos)[:, :, None], level(pos)[:, None, :])
        computed += int(m.sum())
    assert torch.equal(got, want)
    if segs == [32, 64, 128, 256]:  # LongNet's shape of chain: three quarters of the pairs
        assert 0.74 < computed / int(want.sum()) < 0.79


@triton_ok
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segs,rates,seqlen", [([64, 32, 128], [2, 1, 4], 72), ([128, 256], [2, 4], 160),
                                               ([32, 64], [1, 1], 80)])
def test_triton_dedup(segs, rates, seqlen, causal):
    """The dedup schedule (every pair once, weighted by its multiplicity)
    against the float64 definition: GQA, partial last segments, a segment
    covering the sequence, no rate-1 branch, a branch wholly inside another."""
    q, k, v = torch.randn(1, seqlen, 4, 16), torch.randn(1, seqlen, 2, 16), torch.randn(1, seqlen, 2, 16)
    _assert_matches_ref(q, k, v, torch.randn(1, seqlen, 4, 16), torch.randn(1, 4, seqlen), segs, rates, causal,
                        "auto", DilatedTuning(schedule="dedup"))


@triton_ok
def test_dilated_kernels_compile_for_hopper():
    """The kernels with dedup's constants compile for sm_90 here, without a
    GPU (the interpreter accepts code Triton's compiler refuses)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    here = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, os.path.join(here, "hopper_compile.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def test_fused_schedule_choice():
    """The fused schedule, decided in plan._fused_schedule: grouped for short
    nested classes, dedup for chains up to dedup_max_head_dim, per-branch
    otherwise; a forced schedule the branches cannot take runs per branch."""
    from longattn.dilated.plan import _fused_schedule

    t = DilatedTuning()
    longnet = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
    assert _fused_schedule(32768, *longnet, 64, t) == "dedup"
    assert _fused_schedule(32768, *longnet, 128, t) == "per_branch"
    assert _fused_schedule(32768, *longnet, 128, DilatedTuning(dedup_max_head_dim=128)) == "dedup"
    assert _fused_schedule(32768, [256, 512, 1024], [1, 2, 4], 64, t) == "grouped"
    assert _fused_schedule(32768, [2048, 3072], [1, 2], 64, t) == "per_branch"  # 2048 does not divide 3072
    assert _fused_schedule(32768, [2048, 3072], [1, 2], 64, DilatedTuning(schedule="dedup")) == "per_branch"
    assert _fused_schedule(32768, *longnet, 128, DilatedTuning(schedule="dedup")) == "dedup"
    with pytest.raises(ValueError, match="dedup_max_head_dim"):
        DilatedTuning(dedup_max_head_dim=-1)


@triton_ok
def test_triton_grouped_autotune(tmp_path):
    """Grouped kernels tune per kind too; a trial runs the first segment only
    (its grid's segment count, not the call's) into scratch."""
    from longattn.kernels.autotune import Autotuner

    tuner = Autotuner(mode="1", cache_dir=str(tmp_path))
    s, h, hkv, segs, rates = 40, 4, 2, [8, 16, 32], [1, 2, 4]
    q, k, v = torch.randn(1, s, h, 16), torch.randn(1, s, hkv, 16), torch.randn(1, s, hkv, 16)
    with pytest.warns(UserWarning, match="autotuning"):
        check_op(fused_with(tuner, segs, rates, True, "grouped"),
                 lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=True), [q, k, v],
                 torch.randn(1, s, h, 16), torch.randn(1, h, s), TOL)
    assert {key[0] for key in tuner.by_shape} == {"grouped_fwd", "grouped_dkdv", "grouped_dq"}


@triton_ok
@pytest.mark.parametrize("s,segs,schedule", [(40, [8, 16, 32], "auto"), (80, [32, 64, 128], "dedup")])
def test_triton_ops_under_torch_compile(s, segs, schedule):
    """backend='triton' calls the fused op pair directly (triton_op on GPU, so
    Inductor compiles the kernels; custom ops under the interpreter): a
    fullgraph compile runs forward and backward and matches eager (grouped
    short classes; a chain computing every pair once)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    h, rates = 4, [1, 2, 4]
    q, k, v = (torch.randn(1, s, h, 16) for _ in range(3))
    do = torch.randn(1, s, h, 16)
    fn = lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                    causal=True, backend="triton",
                                                    tuning=DilatedTuning(schedule=schedule))
    cnt = CompileCounterWithBackend("aot_eager")
    got = results(torch.compile(fn, backend=cnt, fullgraph=True), [q, k, v], do)
    want = results(fn, [q, k, v], do)
    assert cnt.frame_count == 1
    ops = {n.target for n in cnt.graphs[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.longattn.dilated_triton_fwd.default in ops
    assert all(torch.equal(got[n], want[n]) for n in ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("gather_rows", [0, DilatedTuning().gather_max_rows])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_views_path(causal, gather_rows):
    """GQA parts as strided views of K/V: rates that are multiples of the
    group size (2, 8 with g=4: one kv head per query head of the class) or
    divisors (1, 2 with g=4: every kv head, g/r query heads each); partial
    last segments, batch 2. Each view reads exactly the kv heads the
    definition names; results and gradients against float64."""
    s, h, hkv, segs, rates = 44, 8, 2, [6, 12, 16, 44], [1, 2, 4, 8]
    assert dsched.kv_views_ok(rates, h, hkv) and not dsched.kv_views_ok([3], h, hkv)
    k_ids = torch.arange(hkv, dtype=torch.float64).view(1, 1, hkv, 1).expand(1, s, hkv, 1)
    pos = torch.arange(s, dtype=torch.float64).view(1, s, 1, 1)
    tagged = pos * 100 + k_ids  # value = row * 100 + kv head
    for part in dsched.schedule(s, segs, rates, h):
        want_heads, _ = dsched.kv_heads_for(part, h, hkv)
        got = part.kv_view(tagged, h, 0)  # (nseg, m, Hk, 1)
        rows = part.start + torch.arange(part.nseg)[:, None] * part.seg_len + part.c + torch.arange(part.m) * part.r
        assert torch.equal(got[..., 0] // 100, rows[:, :, None].double().expand_as(got[..., 0]))
        assert (got[..., 0] % 100)[0, 0].long().tolist() == want_heads
    assert all(u.part is not None for u in dsched.units(s, segs, rates, h, mha=False))
    torch.manual_seed(0)
    q, do = torch.randn(2, s, h, 16), torch.randn(2, s, h, 16)
    k, v = torch.randn(2, s, hkv, 16), torch.randn(2, s, hkv, 16)
    dl = torch.randn(2, h, s)
    _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, "math",
                        DilatedTuning(schedule="views", gather_max_rows=gather_rows))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hkv,rates", [(8, 2, [1, 2, 4]), (16, 2, [1, 4, 16]), (8, 4, [1, 2, 8])])
def test_gqa_small_branches_gathered(h, hkv, rates, causal):
    """A small GQA branch runs as one call on gathered copies, as MHA's: every
    class reads every kv head (g % r == 0, 5-D views) or class c = g*a + b
    reads kv heads a, a + r/g, ... (r % g == 0, 6-D views). The stacked kv
    view reads the rows and heads each class's own view reads; results and
    gradients against float64, batch 2."""
    s, segs = 64, [8, 32, 64]
    us = dsched.units(s, segs, rates, h, DilatedTuning().gather_max_rows, mha=False)
    assert [u.r for u in us if u.gathered] == rates[1:] and sum(u.part is not None for u in us) == 1
    k_ids = torch.arange(hkv, dtype=torch.float64).view(1, 1, hkv, 1).expand(2, s, hkv, 1)
    tagged = torch.arange(2 * s, dtype=torch.float64).view(2, s, 1, 1) * 100 + k_ids  # (row + s * batch) * 100 + head
    for u in (u for u in us if u.gathered):
        got = u.view(tagged, 1, h).reshape(u.n, s // u.nseg // u.r, -1)  # (nseg * r, m, Hk): the gathered order
        parts = [p for p in dsched.schedule(s, [u.w], [u.r], h)]
        want = torch.stack([p.kv_view(tagged, h, 1)[..., 0] for p in parts], 1).reshape(got.shape)
        assert torch.equal(got, want)
    torch.manual_seed(0)
    q, do = torch.randn(2, s, h, 16), torch.randn(2, s, h, 16)
    k, v = torch.randn(2, s, hkv, 16), torch.randn(2, s, hkv, 16)
    dl = torch.randn(2, h, s)
    _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, "math", DilatedTuning(schedule="views"))


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_gathered_from_strided_inputs(causal):
    """Gathered GQA and MQA branches read q/k/v that are views of larger
    tensors (a fused projection's slices, a sequence slice: storage offsets
    and strides of their own); against float64."""
    s, segs, rates = 48, [8, 16, 48], [1, 2, 8]
    for h, hkv in ((8, 2), (8, 1)):
        torch.manual_seed(0)
        qkv = torch.randn(2, s + 5, h + 2 * hkv, 16)[:, 3:s + 3]  # (B, S, H + 2 Hkv, D) fused, offset rows
        q, k, v = qkv.split([h, hkv, hkv], dim=2)
        assert any(u.gathered for u in dsched.units(s, segs, rates, h, DilatedTuning().gather_max_rows, mha=False))
        do, dl = torch.randn(2, s, h, 16), torch.randn(2, h, s)
        _assert_matches_ref(q, k, v, do, dl, segs, rates, causal, "math", DilatedTuning(schedule="views"))


def test_gathering_bound():
    """Small branches (MHA and GQA) are gathered in eager passes only (unless
    gather_graphed)."""
    from longattn.dilated.plan import gather_rows
    t = DilatedTuning()
    assert gather_rows(t, graphs=False) == t.gather_max_rows > 0
    assert gather_rows(t, graphs=True) == 0
    assert gather_rows(DilatedTuning(gather_graphed=True), graphs=True) == t.gather_max_rows
    with pytest.raises(ValueError, match="gather_graphed must be a bool"):
        DilatedTuning(gather_graphed=1)


def test_views_pieces_land_one_at_a_time(monkeypatch):
    """In order (no side streams), each piece of a unit cut by ``piece_bytes``
    is landed before the next piece's backend call: at most the piece being
    landed is alive beside the new one (at 1M tokens keeping a unit's pieces
    alive had cost 12 GiB of gradient blocks)."""
    import weakref

    from longattn import backends as bk

    q, k, v = (torch.randn(2, 4096, 4, 16, requires_grad=True) for _ in range(3))  # batch 2: nothing adopted
    tuning = DilatedTuning(piece_bytes=1024 * 4 * 16 * 4, schedule="views", gather_max_rows=0)  # a segment a piece
    stats = {"fwd": [0, 0], "bwd": [0, 0]}  # [calls, most earlier results alive at a call]
    live = {"fwd": [], "bwd": []}

    def counted(name, fn):
        def wrapped(*a, **kw):
            res = fn(*a, **kw)
            alive = sum(r() is not None for r in live[name])
            stats[name] = [stats[name][0] + 1, max(stats[name][1], alive)]
            live[name].append(weakref.ref(res[0]))
            return res
        return wrapped

    monkeypatch.setattr(bk, "block_forward", counted("fwd", bk.block_forward))
    monkeypatch.setattr(bk, "block_backward", counted("bwd", bk.block_backward))
    out = longattn.dilated_attention(q, k, v, segment_lengths=[1024, 2048], dilation_rates=[1, 2], causal=True,
                                     tuning=tuning)
    out.sum().backward()
    for name in ("fwd", "bwd"):
        calls, alive = stats[name]
        assert calls >= 8, (name, calls)
        assert alive <= 1, (name, alive, calls)  # the piece being landed


@pytest.mark.parametrize("batch", [1, 2])
def test_views_pieces_and_float64_match_reference(batch):
    """Units cut into many pieces, and float64 inputs (batch 1: the base unit
    taken whole; the CPU flash kernel reads lse in float64 then), against the
    float64 definition."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, 1024, 4, 16, dtype=torch.float64) for _ in range(4))
    dl = torch.randn(batch, 4, 1024, dtype=torch.float64)
    tuning = DilatedTuning(piece_bytes=256 * 4 * 16 * 8, schedule="views", gather_max_rows=0)
    for causal in (False, True):
        _assert_matches_ref(q, k, v, do, dl, [256, 512], [1, 2], causal, "auto", tuning)
        _assert_matches_ref(q, k, v, do, dl, [256, 512], [1, 2], causal, "auto")


def test_graph_cache_policy(monkeypatch):
    """GraphCache (the dilated passes' and the KVCache steps' graphs): a key's
    first call eager, captured on its second, replayed after; least recently
    used dropped past max_graphs; no capture past max_captures; the inference
    mode is part of the key; inputs contiguous from the first call on. The capture itself (CUDA) is stood in
    for."""
    from longattn.dilated import graphs

    captured = []

    class FakeGraph:
        def __init__(self, fn, inputs, pool=None):
            captured.append(tuple(x.shape for x in inputs))
            self.fn = fn

        def __call__(self, inputs, copies=None):
            return ("replayed", self.fn(*inputs))

    monkeypatch.setattr(graphs, "Graph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    cache = graphs.GraphCache(max_graphs=2, max_captures=3)
    fn = lambda x: x.shape[0]
    xs = [torch.zeros(n) for n in (1, 2, 3)]
    assert cache.run("k", fn, [xs[0]]) == 1 and not captured  # first call: eager
    assert cache.run("k", fn, [xs[0]]) == ("replayed", 1) and captured == [((1,),)]
    assert cache.run("k", fn, [xs[0]]) == ("replayed", 1) and len(captured) == 1
    for x in xs[1:]:
        cache.run("k", fn, [x]), cache.run("k", fn, [x])
    assert len(captured) == 3 and len(cache.graphs) == 2  # shape (1,) dropped, least recently used
    assert cache.run("k", fn, [xs[0]]) == 1 and len(captured) == 3  # max_captures reached: eager
    with torch.inference_mode():
        assert cache.run("k", fn, [xs[2]]) == 3  # another key: a first call again
    # a transposed input reaches the eager call and the capture contiguous, as the graph's own copies are: a
    # kernel compiled per stride compiles in the eager call, not inside the capture
    layouts = lambda x: x.is_contiguous()
    assert cache.run("t", layouts, [torch.zeros(3, 4).t()]) is True
    cache.max_captures = None
    assert cache.run("t", layouts, [torch.zeros(3, 4).t()]) == ("replayed", True)
    cache.clear()
    assert not cache.graphs and not cache.seen
