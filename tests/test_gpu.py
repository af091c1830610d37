"""bf16 on a CUDA GPU: every backend, the fused dilated kernel and varlen,
within 2x PyTorch's own bf16 SDPA error against the same float64 reference."""
import pytest
import torch
import torch.nn.functional as F

import longattn
from longattn.tuning import DilatedTuning
from reference import assert_close, attention_ref, dilated_ref, grads_of, rel_err

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _sdpa_errors(q, k, v, do, causal, ref_grads):
    g = q.shape[2] // k.shape[2]
    f = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2),
        is_causal=causal).transpose(1, 2)
    o, _, gr = grads_of(f, [q, k, v], do)
    ro, _, rg = ref_grads
    return [rel_err(o, ro)] + [rel_err(a, b) for a, b in zip(gr, rg)]


def _inputs(b, s, h, hkv, d, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, device=DEV, generator=g).bfloat16()
    return mk(b, s, h, d), mk(b, s, hkv, d), mk(b, s, hkv, d), mk(b, s, h, d)


@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient", "triton", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_bf16(backend, causal):
    q, k, v, do = _inputs(2, 1024, 8, 2, 128)
    ref = grads_of(lambda q, k, v: attention_ref(q, k, v, causal=causal), [q.double(), k.double(), v.double()], do)
    bar = _sdpa_errors(q, k, v, do, causal, ref)
    o, _, g = grads_of(lambda q, k, v: longattn.attention(q, k, v, causal=causal, backend=backend), [q, k, v], do)
    got = [rel_err(o, ref[0])] + [rel_err(a, b) for a, b in zip(g, ref[2])]
    assert all(x <= 2 * y for x, y in zip(got, bar)), (got, bar)


def _dilated_ref_grads(q, k, v, do, segs, rates, causal, chunk=2):
    """grads_of(dilated_ref) in float64, ``chunk`` query heads at a time (the
    reference's (H, S, branches x S) scores at 8192 tokens do not fit an H100
    at once); K/V expanded to the query heads, their gradients summed back."""
    h, hkv = q.shape[2], k.shape[2]
    kx, vx = (x.repeat_interleave(h // hkv, 2) for x in (k, v))
    outs, lses, grads = [], [], [[], [], []]
    for h0 in range(0, h, chunk):
        sl = slice(h0, h0 + chunk)
        o, l, g = grads_of(lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=causal, head_offset=h0),
                           [q[:, :, sl].double(), kx[:, :, sl].double(), vx[:, :, sl].double()], do[:, :, sl])
        outs.append(o), lses.append(l)
        for acc, x in zip(grads, g):
            acc.append(x)
    b, s, _, d = q.shape
    dq, dk, dv = (torch.cat(x, 2) for x in grads)
    dk, dv = (x.view(b, s, hkv, h // hkv, d).sum(3) for x in (dk, dv))
    return torch.cat(outs, 2), torch.cat(lses, 1), [dq, dk, dv]


@pytest.mark.parametrize("backend", ["triton", "auto", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
# triton: per-branch launches (512 to 2048 keys per segment class); GQA: cuDNN on strided kv views under auto from
# 8K tokens (small branches on gathered copies in eager passes), fused Triton below (hkv=2: group 4, so the rate-2 and rate-4 classes
# read every kv head); MHA: cuDNN on strided views
@pytest.mark.parametrize("hkv", [2, 4, 8])
# 6000 tokens: partial segments (8192 > seqlen); 8192: the views path stacks offset classes per
# segment (4096, r=4) and per branch (8192, r=8 = heads), and the rate-1 branch's result is the output
@pytest.mark.parametrize("segs,seqlen", [([512, 1024, 2048, 8192], 6000), ([512, 1024, 4096, 8192], 8192)])
def test_dilated_bf16(backend, causal, hkv, segs, seqlen, rates=(1, 2, 4, 8), tuning=None, fn=None, d=128):
    rates = list(rates)
    q, k, v, do = _inputs(1, seqlen, 8, hkv, d)
    ref = _dilated_ref_grads(q, k, v, do, segs, rates, causal)
    bar = _sdpa_errors(q, k, v, do, causal, grads_of(lambda q, k, v: attention_ref(q, k, v, causal=causal),
                                                     [q.double(), k.double(), v.double()], do))
    fn = fn or (lambda q, k, v: longattn.dilated_attention(
        q, k, v, segment_lengths=segs, dilation_rates=rates, causal=causal, backend=backend, tuning=tuning))
    o, _, g = grads_of(fn, [q, k, v], do)
    got = [rel_err(o, ref[0])] + [rel_err(a, b) for a, b in zip(g, ref[2])]
    print(f"dilated {backend} hkv={hkv} causal={causal} out/dq/dk/dv {['%.1e' % x for x in got]} sdpa {['%.1e' % x for x in bar]}")
    assert all(x <= 2 * y for x, y in zip(got, bar)), (got, bar)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
def test_dilated_auto_d64_bf16(causal, hkv):
    """D=64 under auto: views from 8K tokens (MHA and GQA), the fused kernels
    below, both replayed from graphs up to 32K tokens; each shape twice, so the
    second call replays."""
    from longattn.dilated.plan import choose
    segs, rates = [512, 1024, 4096, 8192], [1, 2, 4, 8]
    for seqlen, engine in ((6000, "fused"), (8192, "views")):
        q, k = (torch.empty(1, seqlen, h, 64, device=DEV, dtype=torch.bfloat16) for h in (8, hkv))
        plan = choose(q, k, segs, rates, causal, "auto")
        assert (plan.fwd, plan.bwd, plan.graphs) == (engine, engine, True), plan
        for _ in range(2):
            test_dilated_bf16("auto", causal, hkv, segs, seqlen, d=64)


def test_dilated_fa4_unpacked_gqa_bf16():
    """GQA causal views of 2048 rows, which FA4 runs with its query heads unpacked
    (Fa4Tuning.unpacked_gqa_causal_rows)."""
    pytest.importorskip("flash_attn.cute")
    test_dilated_bf16("fa4", True, 2, [2048, 4096], 8192, rates=(1, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_views_ungathered_bf16(causal):
    """The MHA views path with no branch gathered: offset classes stacked per
    segment (4096, r=4) and per class (1024, r=2) on strided views."""
    test_dilated_bf16("cudnn", causal, 8, [512, 1024, 4096, 8192], 8192, tuning=DilatedTuning(gather_max_rows=0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [1, 2, 4])
@pytest.mark.parametrize("gathered", ["no", "eager", "graphed"])
def test_dilated_views_gqa_bf16(causal, hkv, gathered):
    """The GQA views path, one call per offset class on strided kv views or
    the small branches gathered: 5-D kv copies where every class reads every
    kv head (Triton copy and add), 6-D where r is a multiple of the group size
    (torch's); eagerly, or captured and replayed (gather_graphed: each
    shape called twice)."""
    rows = 0 if gathered == "no" else DilatedTuning().gather_max_rows
    t = DilatedTuning(gather_max_rows=rows, gather_graphed=gathered == "graphed")
    t = t if gathered == "graphed" else t.graphs_up_to(0)
    for _ in range(2 if gathered == "graphed" else 1):
        test_dilated_bf16("cudnn", causal, hkv, [512, 1024, 4096, 8192], 8192, tuning=t)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("concurrent", ["never", "always"])
def test_dilated_views_concurrent_bf16(causal, hkv, concurrent):
    """The views path's calls on side streams at once or in order on one stream (eager)."""
    test_dilated_bf16("cudnn", causal, hkv, [512, 1024, 4096, 8192], 8192,
                      tuning=DilatedTuning(concurrent_calls=concurrent).graphs_up_to(0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
def test_dilated_passes_replayed_from_graphs(causal, hkv):
    """Below graph_max_tokens each pass is captured on a shape's second call
    and replayed after: every call, with new inputs each time, equals the
    pass run eagerly; clear() frees the graphs."""
    from longattn.dilated import graphs
    segs, rates = [512, 1024, 4096, 8192], [1, 2, 4, 8]
    eager, graphed = (DilatedTuning().graphs_up_to(n) for n in (0, 1 << 20))
    f = lambda q, k, v, t: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                      causal=causal, backend="cudnn", tuning=t)
    graphs.clear()
    for call in range(4):
        q, k, v, do = _inputs(1, 8192, 8, hkv, 128, seed=call)
        want, _, wg = grads_of(lambda q, k, v: f(q, k, v, eager), [q, k, v], do)
        got, _, gg = grads_of(lambda q, k, v: f(q, k, v, graphed), [q, k, v], do)
        # cuDNN's backward sums dQ with atomics: runs differ by ~1e-5
        assert rel_err(got, want) < 1e-6 and all(rel_err(a, b) < 1e-4 for a, b in zip(gg, wg)), call
    assert len(graphs._graphs) == 2  # one forward, one backward
    graphs.clear()
    assert not graphs._graphs


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_fused_passes_replayed_from_graphs(causal):
    """The fused Triton kernels' passes (grouped schedule: a branch table on
    the device), as a call over ranks runs its local branches: captured on a
    shape's second call and replayed, each call equal to the eager pass; a
    capture copies nothing from pageable host memory (torch refuses that)."""
    import longattn.dilated as dil
    from longattn.dilated import graphs
    segs, rates, scale = [512, 1024, 2048], [1, 2, 4], 64 ** -0.5
    graphs.clear()
    for call in range(3):
        q, k, v, do = _inputs(1, 2048, 8, 8, 64, seed=call)
        res = []
        for t in (DilatedTuning().graphs_up_to(0), DilatedTuning().graphs_up_to(1 << 20)):
            plan = dil.choose(q, k, segs, rates, causal, "triton", t)
            assert plan.fwd == plan.bwd == "fused" and plan.graphs == (len(res) == 1)
            out, lse = dil.forward(plan, q, k, v, segs, rates, causal, scale)
            res.append((out, lse, *dil.backward(plan, do, q, k, v, out, lse, None, segs, rates, causal, scale)))
        assert all(rel_err(a, b) < 1e-6 for a, b in zip(*res)), call
    assert len(graphs._graphs) == 2  # one forward, one backward
    graphs.clear()


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_views_under_cuda_graphs(causal):
    """The views path (cuDNN calls on side streams, Triton gathers, merges and
    adds) captures into CUDA graphs: torch.cuda.make_graphed_callables gives the eager op's
    output and gradients (the bench's longattn-dilated-graphed)."""
    segs, rates = [512, 1024, 4096, 8192], [1, 2, 4, 8]
    q, k, v, do = _inputs(1, 8192, 8, 8, 128)
    f = lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                   causal=causal, backend="cudnn",
                                                   tuning=DilatedTuning(concurrent_calls="always"))
    graphed = torch.cuda.make_graphed_callables(f, tuple(x.clone().requires_grad_() for x in (q, k, v)))
    o, _, g = grads_of(f, [q, k, v], do)
    for _ in range(2):  # replays, not only the capture
        go, _, gg = grads_of(graphed, [q, k, v], do)
        # cuDNN's backward sums dQ with atomics: runs differ by ~1e-5 (eager against eager too)
        assert rel_err(go, o) < 1e-6 and all(rel_err(a, b) < 1e-4 for a, b in zip(gg, g))


@pytest.mark.parametrize("backend", ["efficient", "triton", "math", "auto"])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_odd_lengths(backend, causal):
    """float32 on the GPU (a transformers model in float32) with lengths that
    are not multiples of 8, batch 2, GQA: out, lse and every gradient of a dense
    call (1001 tokens) and of packed documents (3, 17, 1, 12
    tokens: each document's lse a slice of the call's) within 1e-4 of float64.
    The efficient kernel's backward reads lse with head and batch strides that
    are multiples of 8 (aten.efficient_stats)."""
    from reference import varlen_ref

    g = torch.Generator(device=DEV).manual_seed(3)
    mk = lambda *shape: torch.randn(*shape, device=DEV, generator=g)
    q, k, v, do, dl = mk(2, 1001, 4, 64), mk(2, 1001, 2, 64), mk(2, 1001, 2, 64), mk(2, 1001, 4, 64), mk(2, 4, 1001)
    ref = grads_of(lambda q, k, v: attention_ref(q, k, v, causal=causal), [q.double(), k.double(), v.double()],
                   do, dl)
    got = grads_of(lambda q, k, v: longattn.attention(q, k, v, causal=causal, backend=backend, return_lse=True),
                   [q, k, v], do, dl)
    names = ("out", "lse", "dq", "dk", "dv")
    assert_close(dict(zip(names, [got[0], got[1], *got[2]])), dict(zip(names, [ref[0], ref[1], *ref[2]])), 1e-4,
                 f"dense {backend} causal={causal}")
    lens = [3, 17, 1, 12]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEV)
    q, k, v, do, dl = mk(33, 4, 64), mk(33, 2, 64), mk(33, 2, 64), mk(33, 4, 64), mk(4, 33)
    ref = grads_of(lambda q, k, v: varlen_ref(q, k, v, cu, causal), [q.double(), k.double(), v.double()], do, dl)
    got = grads_of(lambda q, k, v: longattn.attention_varlen(q, k, v, cu, causal=causal, backend=backend,
                                                            return_lse=True), [q, k, v], do, dl)
    assert_close(dict(zip(names, [got[0], got[1], *got[2]])), dict(zip(names, [ref[0], ref[1], *ref[2]])), 1e-4,
                 f"varlen {backend} causal={causal}")


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_varlen_bf16(backend):
    from test_varlen import varlen_ref

    lens = [700, 33, 1500, 1, 400]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEV)
    q, k, v, do = _inputs(1, sum(lens), 8, 2, 64)
    q, k, v, do = q[0], k[0], v[0], do[0]
    ref = grads_of(lambda q, k, v: varlen_ref(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), True),
                   [q.double(), k.double(), v.double()], do.cpu())
    o, _, g = grads_of(lambda q, k, v: longattn.attention_varlen(q, k, v, cu, causal=True, backend=backend),
                       [q, k, v], do)
    got = [rel_err(o.cpu(), ref[0].cpu())] + [rel_err(a.cpu(), b.cpu()) for a, b in zip(g, ref[2])]
    assert all(x < 1e-2 for x in got), got


@pytest.mark.parametrize("backend", ["auto", "cudnn"])
def test_varlen_host_cu_seqlens_never_waits_for_the_gpu(backend):
    """cu_seqlens on the host: read there for free, copied to the device
    without a blocking copy, the document loop slicing on the host: a forward
    and backward make no synchronizing call (torch's sync debug mode raises on one)."""
    lens = [700, 33, 1500, 2, 400]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    q, k, v, do = (x[0] for x in _inputs(1, sum(lens), 8, 2, 64))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    step = lambda: longattn.attention_varlen(q, k, v, cu, causal=True, backend=backend).backward(do)
    step()  # compiles and allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(x.grad is not None and x.grad.isfinite().all() for x in (q, k, v))


@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_varlen_captured_in_cuda_graph(backend):
    """attention_varlen's forward and backward captured in one CUDA graph
    (cu_seqlens on the device with max_seqlen: nothing read on the host)
    replay to the eager results; a host cu_seqlens inside a capture raises
    ValueError with the fix."""
    lens = [700, 33, 1500, 2, 400]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(DEV)
    q, k, v, do = (x[0] for x in _inputs(1, sum(lens), 8, 2, 64))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    step = lambda: longattn.attention_varlen(q, k, v, cu, max_seqlen=1500, causal=True, backend=backend)
    out = step()
    out.backward(do)
    want = [out.detach().clone()] + [x.grad.clone() for x in (q, k, v)]
    del out  # a graph kept alive would bind the leaves' gradient accumulators to this stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in (q, k, v):
            x.grad = None
        step().backward(do)
    torch.cuda.current_stream().wait_stream(side)
    for x in (q, k, v):
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
        out.backward(do)
    graph.replay()
    torch.cuda.synchronize()
    got = [out] + [x.grad for x in (q, k, v)]
    assert all(rel_err(a, b) < 1e-2 for a, b in zip(got, want)), [rel_err(a, b) for a, b in zip(got, want)]
    cu_host = cu.cpu()  # before the capture: torch itself refuses a copy to the host inside one
    with pytest.raises(ValueError, match="under CUDA graph capture.*q's device"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            longattn.attention_varlen(q.detach(), k.detach(), v.detach(), cu_host, max_seqlen=1500, causal=True)


def test_auto_picks_fa4_then_cudnn_on_hopper():
    from longattn import backends as bk

    q = torch.randn(1, 256, 4, 128, device=DEV, dtype=torch.bfloat16)
    fa4 = not bk.BACKENDS["fa4"].refusals(bk.BlockSpec(1.0), q, q)  # flash-attn-4 installed
    if torch.cuda.get_device_capability() >= (9, 0):
        assert bk.select_backend(q, q, bk.BlockSpec(1.0)).name == ("fa4" if fa4 else "cudnn")
        assert bk.select_backend(q, q, bk.BlockSpec(1.0), exclude=("fa4",)).name == "cudnn"
    # a sliding window is refused by cuDNN (with the reason): FA4 takes it, else flash
    assert bk.select_backend(q, q, bk.BlockSpec(1.0, True, (64, 0))).name == ("fa4" if fa4 else "flash")


def test_peak_memory_reports_known_allocation():
    from longattn.bench.measure import peak_memory_bytes

    n = 64 << 20
    got = peak_memory_bytes(lambda: torch.empty(n, dtype=torch.uint8, device=DEV), torch.device(DEV))
    assert n <= got < n + (2 << 20)


def test_batched_timing_hides_host_time():
    """Cold timing counts the host's time before a call's GPU work; batched
    timing (calls back to back) lets the host run ahead, as in a training loop."""
    import time

    from longattn.bench.measure import time_ms

    def host_then_gpu():
        time.sleep(0.001)  # host work before the launch
        torch.cuda._sleep(8_000_000)  # ~4 ms of GPU work

    cold = time_ms(host_then_gpu, torch.device(DEV), warmup=2, iters=5)
    batched = time_ms(host_then_gpu, torch.device(DEV), warmup=2, iters=5, batched=True)
    assert cold["timing"] == "cold" and batched["timing"] == "batched" and batched["calls_per_sample"] >= 3
    assert batched["median_ms"] < 0.95 * cold["median_ms"], (cold, batched)


def test_dilated_triton_autotuned_bf16(tmp_path):
    """Autotuning on (as for users): the tuned tiles pass the same bar, the
    choices come from the candidates. Two branches: tuning compiles every
    candidate for every branch (~2 s each)."""
    from longattn.kernels.autotune import CANDIDATES, Autotuner
    from test_dilated import fused_with

    tuner = Autotuner(mode="1", cache_dir=str(tmp_path))
    # 1024 / 256 keys per class; dedup: tiles inside its 256-row sub-blocks
    for segs, schedule in (([512, 2048], "per_branch"), ([256, 512], "grouped"), ([512, 2048], "dedup")):
        f = fused_with(tuner, segs, [1, 2], True, schedule, scale=128 ** -0.5)
        test_dilated_bf16("triton", True, 4, segs, 4096, rates=[1, 2], fn=lambda q, k, v: f(q, k, v)[0])
    assert {key[0] for key in tuner.by_shape} == {"fwd", "dkdv", "dq", "grouped_fwd", "grouped_dkdv", "grouped_dq"}
    assert all(cfg in CANDIDATES[key[0].removeprefix("grouped_")] for key, cfg in tuner.by_shape.items())


@pytest.mark.parametrize("schedule", ["grouped", "dedup", "per_branch", "per_branch_zero_fill"])
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_triton_schedules_bf16(schedule, causal):
    """Every fused schedule passes the same bar on the nested LongNet-like config
    (the default at D=128 is per-branch: test_dilated_bf16)."""
    test_dilated_bf16("triton", causal, 4, [512, 1024, 2048, 8192], 6000, tuning=DilatedTuning(schedule=schedule))


def test_dilated_triton_op_compiles_with_inductor():
    """backend='triton' under torch.compile (Inductor): the graph holds our
    Triton kernels (triton_op + wrap_triton), which Inductor compiles into its
    own code; forward and backward match eager."""
    from torch._inductor.utils import run_and_get_code

    segs, rates = [512, 1024, 4096, 8192], [1, 2, 4, 8]
    q, k, v, do = _inputs(1, 8192, 8, 4, 128)
    fn = lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                    causal=True, backend="triton")
    compiled = torch.compile(fn, fullgraph=True)
    (o, _, g), codes = run_and_get_code(lambda: grads_of(compiled, [q, k, v], do))
    eo, _, eg = grads_of(fn, [q, k, v], do)
    code = "\n".join(codes)
    assert "_fwd_kernel" in code and "_dq_kernel" in code and "_dkdv_kernel" in code
    assert rel_err(o, eo) < 1e-3 and all(rel_err(a, b) < 1e-3 for a, b in zip(g, eg))


def test_flex_small_head_dim_raises_before_compiling():
    """Inductor's flex kernels refuse head dims below 16 at compile time, deep
    in a traceback (and mid-ring for ring_flex_attention); the op says so first."""
    q = torch.randn(1, 64, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="head dims >= 16"):
        longattn.flex_attention(q, q, q, mask_mod=longattn.masks.causal())
