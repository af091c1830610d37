"""longattn.flex_attention on one device (CPU: torch's eager FlexAttention)
against the float64 masked reference: outputs, lse and all gradients; a ring
step's backward (the graph its forward recorded, run with the merged out and
lse: no recompute, no tensor kept) on two merged key halves; the compiled path
CUDA takes (FlexAttention's operator under torch.compile, traced with the
aot_eager backend on CPU) and its backward through FlexAttention's autograd;
input checks."""
import os
import sys
import traceback
import types

import pytest
import torch

import longattn
from longattn import masks
from longattn.flex import plan as fp
from longattn.flex.step import FlexStep
from reference import assert_close, check_op, dense_mask, flex_ref, results

TOL = 1e-4
B, S, H, D = 2, 40, 4, 16
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
DOCS = torch.tensor([0] * 7 + [1] * 13 + [2] * 20)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


PATTERNS = {
    "full": (None, None),
    "causal": (masks.causal(), None),
    "sliding window": (masks.sliding_window(6, 0), None),
    "local + global": (masks.local_global(3, 4), None),
    "causal documents": (masks.and_(masks.causal(), masks.document(DOCS)), None),
    "prefix-LM": (masks.prefix_lm(9), None),
    "block-sparse per head": (masks.block_sparse(torch.rand(H, 5, 5, generator=torch.Generator().manual_seed(1)) < 0.5,
                                                 8), None),
    "dilated": (masks.dilated((8, 20), (1, 2), causal=True), None),
    "alibi + causal": (masks.causal(), alibi),
    "softcap": (None, softcap),
    "softcap + documents": (masks.document(DOCS), softcap),
}


def _inputs(hkv, sq=S, sk=S):
    q = torch.randn(B, sq, H, D)
    k, v = torch.randn(B, sk, hkv, D), torch.randn(B, sk, hkv, D)
    return q, k, v, torch.randn(B, sq, H, D), torch.randn(B, H, sq)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_flex_matches_reference(name, hkv):
    mask_mod, score_mod = PATTERNS[name]
    q, k, v, do, dl = _inputs(hkv)
    ref = lambda q, k, v: flex_ref(q, k, v, mask_mod, score_mod)
    dl = torch.where(torch.isfinite(ref(q, k, v)[1]), dl, 0)  # rows with no key have no lse to differentiate
    fn = lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, return_lse=True)
    check_op(fn, ref, (q, k, v), do, dl, TOL, name)


def test_cross_lengths_mqa_scale_and_output_only():
    """seqlen_q != seqlen_k (FlexAttention's indices: both from 0), MQA, a given scale, no lse."""
    q, k, v, do, _ = _inputs(1, sq=24, sk=40)
    mask = masks.prefix_lm(10)
    fn = lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mask, score_mod=alibi, softmax_scale=0.3)
    check_op(fn, lambda q, k, v: flex_ref(q, k, v, mask, alibi, scale=0.3), (q, k, v), do, tol=TOL)


def test_rows_without_keys():
    """Rows that see no key: output 0, lse -inf, no NaN in any gradient; a
    mask with no visible key at all gives zeros everywhere."""
    q, k, v, do, _ = _inputs(2)
    for mask in (masks.and_(masks.causal(), lambda b, h, qi, ki: qi >= 10), lambda b, h, qi, ki: qi < 0):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = longattn.flex_attention(*xs, mask_mod=mask, return_lse=True)
        (out * do).sum().backward()
        assert torch.all(out[:, :10] == 0) and torch.all(lse[:, :, :10] == float("-inf"))
        assert not any(torch.isnan(t).any() for t in (out, lse, *(x.grad for x in xs)))
    assert torch.all(out == 0) and torch.all(xs[1].grad == 0)


class _BackwardSpy:
    """Records who calls FlexAttention's backward operator (``callers[i]``: the
    file of the frame that called it) and counts calls of its forward operator."""

    def __init__(self, monkeypatch):
        bwd, fwd = torch.ops.higher_order.flex_attention_backward, torch.ops.higher_order.flex_attention
        self.callers, self.forwards, call_bwd, call_fwd = [], 0, type(bwd).__call__, type(fwd).__call__

        def spy(op, *args, **kwargs):
            self.callers.append(sys._getframe(1).f_code.co_filename)
            return call_bwd(op, *args, **kwargs)

        def count(op, *args, **kwargs):
            self.forwards += 1
            return call_fwd(op, *args, **kwargs)
        monkeypatch.setattr(type(bwd), "__call__", spy)
        monkeypatch.setattr(type(fwd), "__call__", count)

    @property
    def ours(self) -> list:
        return [f for f in self.callers if "longattn" in f]


def _half_steps(mask, score, compile, s, h, block, device=None):
    """FlexSteps of all queries (positions 0..s-1) against each key half."""
    qmap = fp.position_map("contiguous", 0, 1, s, device)
    qpos = fp.global_positions("contiguous", 0, 1, s, device)
    steps = []
    for r in range(2):
        kmap = fp.position_map("contiguous", r, 2, s // 2, device)
        table = fp.block_table(mask, B, h, qpos, fp.global_positions("contiguous", r, 2, s // 2, device), block)
        assert not table.empty
        bm = fp.block_mask(table, mask, qmap, kmap, (s, s // 2), block=block)
        steps.append(FlexStep(bm, fp.localize_score(score, qmap, kmap), D ** -0.5, compile, ("halves", compile)))
    return steps


def _merged_halves(steps, q, k, v, do, dl, spy=None) -> dict:
    """Each half's (o_b, lse_b) recorded and merged by lse as the ring merges
    them (into the first half's out, in place), then each step's backward with
    the merged (O, L) (K/V passed again as copies, as the ring's backward
    receives them): {out, lse, dq, dk, dv}. With ``spy``: no FlexAttention
    forward runs in the backwards."""
    s = k.shape[1]
    halves = [(k[:, :s // 2].clone(), v[:, :s // 2].clone()), (k[:, s // 2:].clone(), v[:, s // 2:].clone())]
    rec = [st.record(q, kh, vh) for st, (kh, vh) in zip(steps, halves)]
    (o0, l0, _), (o1, l1, _) = rec
    lse = torch.logaddexp(l0, l1)
    w0, w1 = (torch.exp(lb - lse).nan_to_num(0).transpose(1, 2)[..., None] for lb in (l0, l1))
    out = o0.mul_(w0).add_(w1 * o1)
    before = spy and spy.forwards
    grads = [st.backward(do, q, kh.clone(), vh.clone(), out, lse, dl, g)
             for st, (kh, vh), (_, _, g) in zip(steps, halves, rec)]
    assert spy is None or spy.forwards == before
    return dict(out=out, lse=lse, dq=grads[0][0] + grads[1][0], dk=torch.cat([grads[0][1], grads[1][1]], 1),
                dv=torch.cat([grads[0][2], grads[1][2]], 1))


def _crossing_pattern(s, device=None):
    """Causal documents with one document across the two key halves, no key
    for rows 0-2, and an alibi score_mod capturing a tensor."""
    n = [s // 8, s // 2, s - s // 8 - s // 2]  # rows of documents 0, 1 (across s // 2), 2
    docs = masks.document(torch.repeat_interleave(torch.arange(3), torch.tensor(n)).to(device))
    slopes = SLOPES.to(device)
    return (masks.and_(masks.causal(), lambda b, h, qi, ki: qi >= 3, docs),
            lambda score, b, h, qi, ki: score - slopes[h] * (qi - ki).abs())


@pytest.mark.parametrize("compile", [None, "aot_eager"])
def test_step_backward_two_merged_halves(compile, monkeypatch):
    """A ring step's backward on one device: the keys in two halves, each
    half's (o_b, lse_b) recorded and merged by lse as the ring merges them,
    then each step's recorded graph run with the MERGED (O, L) and (dO, dL);
    dQ summed and dK, dV concatenated equal the float64 reference's gradients
    of the whole. Rows that see no key in one half or in both (their dL is
    ignored: no lse) have no NaN; no forward is recomputed; the backward
    operator is called by FlexAttention's autograd only; the recorded graphs
    keep none of q, k, v, out, lse (only the block mask's tensors and
    captured buffers, all smaller than one row statistic)."""
    spy = _BackwardSpy(monkeypatch)
    # rows 0-2 see no key, 3-19 the first half only, 20-24 both (a document across the halves), 25-39 the second
    mask, score = _crossing_pattern(S)
    q, k, v, do, dl = _inputs(2)
    steps = _half_steps(mask, score, compile, S, H, 8)
    for st in steps:
        graph = st.record(q, k[:, :S // 2], v[:, :S // 2])[2]
        assert {"q", "k", "v", "out", "lse"} <= {s.name for s in graph.saved}
        kept = [s.tensor for s in graph.saved if s.name is None]
        assert all(t.numel() < B * H * S for t in kept) and all(s.tensor is None for s in graph.saved if s.name)
    got = _merged_halves(steps, q, k, v, do, dl, spy)
    want = results(lambda q, k, v: flex_ref(q, k, v, mask, score), [x.double() for x in (q, k, v)], do, dl)
    assert torch.all(got["lse"][:, :, :3] == float("-inf")) and torch.isfinite(got["lse"][:, :, 3:]).all()
    assert_close(got, want, TOL, f"compile={compile}")
    assert spy.callers and not spy.ours


def test_step_backward_with_a_captured_table_the_size_of_lse(monkeypatch):
    """A score_mod that captures a float table with as many elements as a
    row statistic (B * H * S): compiled, it is saved as a buffer beside out
    and lse, and the recorded step must keep it (not mistake it for a copy
    of lse); the merged halves still give the float64 reference's gradients."""
    bias = torch.randn(H, B * S)
    score = lambda sc, b, h, qi, ki: sc + bias[h, b * S + qi]
    mask = masks.causal()
    q, k, v, do, dl = _inputs(2)
    steps = _half_steps(mask, score, "aot_eager", S, H, 8)
    got = _merged_halves(steps, q, k, v, do, dl)
    want = results(lambda q, k, v: flex_ref(q, k, v, mask, score), [x.double() for x in (q, k, v)], do, dl)
    assert_close(got, want, TOL, "captured table")


@pytest.mark.gpu
def test_cuda_compiled_forward_backward(monkeypatch):
    """The compiled path on CUDA (inductor's Triton FlexAttention), float32
    against the float64 reference: flex_attention (FlexAttention's autograd)
    and a ring step's backward on two merged key halves (the recorded graphs
    run with the merged out and lse); FlexAttention's backward operator is
    never called by longattn."""
    spy = _BackwardSpy(monkeypatch)
    dev, s = torch.device("cuda"), 512
    mask, score = _crossing_pattern(s, dev)
    q, k, v = torch.randn(B, s, H, D), torch.randn(B, s, 2, D), torch.randn(B, s, 2, D)
    do, dl = torch.randn(B, s, H, D), torch.randn(B, H, s)
    ref_mask, ref_score = _crossing_pattern(s)
    want = results(lambda q, k, v: flex_ref(q, k, v, ref_mask, ref_score), [x.double() for x in (q, k, v)], do, dl)
    on = [x.to(dev) for x in (q, k, v, do, dl)]
    single = results(lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mask, score_mod=score, return_lse=True),
                     on[:3], on[3], on[4])
    halves = _merged_halves(_half_steps(mask, score, "inductor", s, H, 128, dev), *on, spy=spy)
    for name, got in (("flex_attention", single), ("two merged halves", halves)):
        assert_close({n: t.cpu() for n, t in got.items()}, want, 1e-3, name)  # float32 dots may run as TF32
    assert not spy.ours  # (inductor's backward is a kernel: the operator is not called at all)


def test_compiled_path_graphs(monkeypatch):
    """The step executor as CUDA runs it (torch.compile of FlexAttention's
    operator; the backward the graph AOTAutograd made for the recorded
    forward), traced here with the aot_eager backend: the same values as the
    eager executor, and one graph without autograd (the forward) and one with
    it (the recorded forward) for every step of a ring: positions and block
    masks are graph inputs, not constants. Dynamo sees the forward operator
    only (never FlexAttention's backward operator, which it refuses on CUDA),
    the score_mod looks up a captured tensor, and a step's backward runs twice
    (a second backward through the same graph)."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    spy = _BackwardSpy(monkeypatch)
    world, length, hkv = 3, 12, 2
    q, k, v, do, dl = (x[:, :length] if x.dim() == 4 else x[..., :length] for x in _inputs(hkv))
    mask = masks.and_(masks.causal(), masks.document(DOCS[:world * length]))
    qmap = fp.position_map("zigzag", 1, world, length)
    tables = fp.rank_tables(mask, "zigzag", 1, world, length, B, H, block=4)
    for s, table in enumerate(tables):
        kmap = fp.position_map("zigzag", (1 - s) % world, world, length)
        bm = fp.block_mask(table, mask, qmap, kmap, (length, length), block=4)
        score = fp.localize_score(alibi, qmap, kmap)
        res = []
        for step in (FlexStep(bm, score, D ** -0.5, None), FlexStep(bm, score, D ** -0.5, counting, "ring")):
            out, lse = step.forward(q, k, v)
            o2, l2, graph = step.record(q, k, v)
            torch.testing.assert_close((o2, l2), (out, lse), rtol=0, atol=0)
            res.append((out, lse, *step.backward(do, q, k, v, out, lse, dl, graph),
                        *step.backward(do, q, k, v, out, lse, None, graph)))
        for a, b in zip(*res):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    ops = [{n.target for n in g.graph.nodes if n.op == "call_function"} for g in graphs]
    assert len(graphs) == 2  # attention without and with autograd
    assert all(torch.ops.higher_order.flex_attention in o for o in ops)
    assert not any(torch.ops.higher_order.flex_attention_backward in o for o in ops)
    assert spy.callers and not spy.ours


def test_input_checks():
    q, k, v, _, _ = _inputs(2)
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        longattn.flex_attention(q, k, v, mask_mod="causal")
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor"):
        longattn.flex_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi - ki)
    w = torch.ones(H, requires_grad=True)
    with pytest.raises(ValueError, match="score_mod captures a tensor that requires grad"):
        longattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * w[h])
    with pytest.raises(ValueError, match="multiple of nheads"):
        longattn.flex_attention(q, torch.randn(B, S, 3, D), torch.randn(B, S, 3, D))
    with pytest.raises(TypeError, match="return_lse"):
        longattn.flex_attention(q, k, v, return_lse=1)


def test_signature_read_once_per_function(monkeypatch):
    """A mask function's arity is read on its first call as a mask (reading a signature is a third of a call's
    own host time); a wrong one is refused on every call, and the same function as a score_mod is checked."""
    from longattn.flex import checks

    reads = []
    real = checks.inspect.signature
    monkeypatch.setattr(checks.inspect, "signature", lambda fn: reads.append(fn) or real(fn))
    mask = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    for _ in range(3):
        checks.check_mod(mask, "mask_mod")
    assert reads == [mask]
    with pytest.raises(TypeError, match="score_mod must take 5"):
        checks.check_mod(mask, "score_mod")
    bad = lambda q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    for _ in range(2):
        with pytest.raises(TypeError, match="mask_mod must take 4"):
            checks.check_mod(bad, "mask_mod")
    assert reads == [mask, mask, bad, bad]


@pytest.mark.parametrize("name,fn,want", [
    ("mask_mod", lambda q_idx, kv_idx: kv_idx <= q_idx, r"mask_mod must take 4 positional arguments, "
                                                        r"mask_mod\(b, h, q_idx, kv_idx\)"),
    ("mask_mod", lambda score, b, h, q_idx, kv_idx: kv_idx <= q_idx, "mask_mod must take 4"),
    ("score_mod", lambda score, q_idx, kv_idx: score, r"score_mod must take 5 positional arguments, "
                                                      r"score_mod\(score, b, h, q_idx, kv_idx\)"),
])
def test_wrong_arity_raises_at_the_call(name, fn, want):
    """A mask or score function of the wrong arity: a TypeError naming the
    argument and FlexAttention's signature, raised by the argument checks (not
    inside the block planner or torch's vmap)."""
    q, k, v, _, _ = _inputs(2)
    with pytest.raises(TypeError, match=want) as info:
        longattn.flex_attention(q, k, v, **{name: fn})
    files = [f.filename for f in traceback.extract_tb(info.tb)]
    assert files[-1].endswith(os.path.join("longattn", "flex", "checks.py")), files
    assert not any(f.endswith(("plan.py", "schedule.py")) or "_functorch" in f for f in files), files
    with pytest.raises(TypeError, match=r"and_\(\) argument 2 must take 4"):
        masks.and_(masks.causal(), lambda q_idx, kv_idx: kv_idx <= q_idx)
    # extra parameters with defaults, or *args, fit FlexAttention's call
    out = longattn.flex_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx, w=2: kv_idx <= q_idx,
                                  score_mod=lambda score, *idx: score)
    torch.testing.assert_close(out, longattn.flex_attention(q, k, v, mask_mod=masks.causal()))


def test_dilated_mask_against_dilated_attention():
    """One branch: the mask version is LongNet's branch exactly. Several
    branches: dilated_attention counts a pair two branches give twice, the
    mask once (masks.dilated's docstring), so the two differ."""
    q, k, v, _, _ = _inputs(4)
    one = longattn.dilated_attention(q, k, v, segment_lengths=[20], dilation_rates=[2], causal=True)
    got = longattn.flex_attention(q, k, v, mask_mod=masks.dilated_branch(20, 2, causal=True))
    torch.testing.assert_close(got, one, rtol=TOL, atol=TOL)
    segs, rates = [8, 20], [1, 2]
    many = longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates)
    union = longattn.flex_attention(q, k, v, mask_mod=masks.dilated(segs, rates))
    assert (many - union).abs().max() > 1e-2


@pytest.mark.parametrize("pattern", ["swg", "doc", "prefix", "bsparse"])
def test_bench_flex_configs(pattern):
    """The bench's pattern configs: pairs counted exactly (FLOPs count only
    those), and longattn-flex through the bench's runner on CPU."""
    from longattn.bench import configs as C
    from longattn.bench import impls as I
    from longattn.bench.single import bench_impl

    for causal in (False, True):
        cfg = C.get(f"flex_{pattern}_tiny").with_overrides(seqlen=300, causal=causal)
        assert I.flex_pairs(cfg) == dense_mask(I.flex_mask(cfg, "cpu"), 1, 1, 300).sum().item()
    cfg = C.get(f"flex_{pattern}_tiny").with_overrides(seqlen=128)
    row = bench_impl(cfg, "longattn-flex", torch.device("cpu"), torch.float32, warmup=1, iters=1, bwd_alone=False)
    assert row["status"] == "ok" and row["fwd_bwd_ms"] > 0 and "mask=" in row["shape"]
    assert I.IMPLS["dense-cudnn"].reason(cfg, torch.device("cpu")) and I.IMPLS["torch-flex"].computes is None


def test_one_device_calls_never_evict_plans_across_ranks():
    """Plans whose building runs collectives live in their own cache: a flood of
    one-device calls (on one rank alone, e.g. an evaluation on rank 0) cannot
    evict them there only, which would make that rank plan again, with
    collectives the other ranks skip."""
    from longattn.flex import schedule

    sentinel = object()
    schedule.RING_PLANS.get_or(("test-sentinel",), lambda: sentinel)
    for n in range(schedule.PLANS.size + 6):  # more distinct shapes than the one-device cache holds
        q = torch.randn(1, 8 + n, 1, 8)
        longattn.flex_attention(q, q, q, mask_mod=longattn.masks.causal())
    assert schedule.RING_PLANS.get_or(("test-sentinel",), lambda: None) is sentinel


def test_planning_refused_under_cuda_graph_capture(monkeypatch):
    """A flex call plans a new (shape, pattern) on the host (block tables; across ranks with collectives): under
    CUDA graph capture that raises a ValueError naming the fix (call once before capturing), on CUDA tensors only."""
    from longattn.flex.checks import plan_outside_capture

    cuda_like = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    plan_outside_capture(cuda_like, "flex_attention")  # not capturing: nothing to say
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="call it once with these shapes and this pattern before capturing"):
        plan_outside_capture(cuda_like, "ring_flex_attention")
    plan_outside_capture(torch.zeros(1), "flex_attention")  # CPU tensors are never captured


def test_agreement_refused_under_cuda_graph_capture(monkeypatch):
    """A distributed call's first agreement on its arguments (a collective on the GPU under NCCL, read on the
    host) under CUDA graph capture: a ValueError naming the fix before any collective, or the rank's own problem;
    an agreed signature skips it (a captured call of an agreed shape runs)."""
    from longattn.distributed import checks

    monkeypatch.setattr(checks, "_device_for", lambda group: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    group = object()
    with pytest.raises(ValueError, match="ring_attention: a first call .* call it once with these arguments before"):
        checks.handshake(group, "ring_attention", once=True, q=(1, 8, 2, 4))
    with pytest.raises(TypeError, match="bad q"):
        checks.handshake(group, "ring_attention", TypeError("bad q"), q=(1, 8, 2, 4))
    checks._checked.add((id(group), "ring_attention", (("q", (1, 8, 2, 4)),)))
    try:
        checks.handshake(group, "ring_attention", once=True, q=(1, 8, 2, 4))  # agreed before: nothing runs
    finally:
        checks._checked.discard((id(group), "ring_attention", (("q", (1, 8, 2, 4)),)))
