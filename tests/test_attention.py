"""Dense attention: every CPU backend against the float64 reference."""
import pytest
import torch

import longattn
from longattn import backends as bk
from torch.utils._python_dispatch import TorchDispatchMode

from reference import attention_ref, check_op, dilated_ref

TOL = 1e-4


def _cases():
    for be in ("math", "flash"):
        for causal in (False, True):
            for hkv in (4, 2, 1):
                yield be, causal, hkv, 33, 33, (-1, -1)
    yield "math", True, 2, 17, 40, (-1, -1)   # Sq < Sk, bottom-right causal
    yield "math", True, 1, 40, 17, (-1, -1)   # Sq > Sk: first rows see nothing
    yield "math", False, 2, 20, 31, (4, 6)
    yield "math", True, 4, 31, 31, (5, 0)
    yield "flash", False, 2, 20, 31, (-1, -1)


@pytest.mark.parametrize("be,causal,hkv,sq,sk,window", list(_cases()))
def test_attention_vs_reference(be, causal, hkv, sq, sk, window):
    q = torch.randn(2, sq, 4, 16)
    k = torch.randn(2, sk, hkv, 16)
    v = torch.randn(2, sk, hkv, 16)
    do, dl = torch.randn_like(q), torch.randn(2, 4, sq)
    fn = lambda q, k, v: longattn.attention(q, k, v, causal=causal, window_size=window, return_lse=True,
                                            backend=be, softmax_scale=0.3)
    ref = lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window, scale=0.3)
    check_op(fn, ref, [q, k, v], do, dl, TOL)


def test_rows_without_keys_are_zero_with_neg_inf_lse():
    q, k = torch.randn(1, 6, 2, 8), torch.randn(1, 3, 2, 8)
    q.requires_grad_()
    out, lse = longattn.attention(q, k, k, causal=True, return_lse=True)
    # bottom-right causal: query rows 0..2 sit before key 0
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, :3] < 0).all()
    out.sum().backward()
    assert torch.equal(q.grad[:, :3], torch.zeros_like(q.grad[:, :3]))
    assert not torch.isnan(q.grad).any()


def test_auto_picks_and_explains():
    q = torch.randn(1, 8, 2, 8)
    spec = bk.BlockSpec(8 ** -0.5)
    assert bk.select_backend(q, q, spec).name == "flash"  # CPU flash before math
    why = bk.explain(q, q, spec)
    assert why["math"] == [] and any("device" in r for r in why["cudnn"])
    # a window on CPU: flash refuses, auto falls back to math
    assert bk.select_backend(q, q, bk.BlockSpec(1.0, window=(2, 2))).name == "math"
    assert bk.select_backend(q.double(), q.double(), spec).name in ("flash", "math")
    one = torch.randn(1, 1, 2, 8)  # cuDNN's frontend refuses a single query over a single key
    assert any("seqlen_q = seqlen_k = 1" in r for r in bk.explain(one, one, spec)["cudnn"])


def test_forced_backend_errors_list_reasons():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="cudnn.*device"):
        longattn.attention(q, q, q, backend="cudnn")
    with pytest.raises(ValueError, match="backend='nope'"):
        longattn.attention(q, q, q, backend="nope")
    with longattn.use_backend("math"):
        assert bk.select_backend(q, q, bk.BlockSpec(1.0), bk.resolve("auto")).name == "math"
    assert bk.select_backend(q, q, bk.BlockSpec(1.0), bk.resolve("auto")).name == "flash"


def test_backward_runs_the_backend_the_forward_chose(monkeypatch):
    """A backend forced for the forward is the one the backward runs, also
    when .backward() is called after the use_backend block has closed."""
    ran = []
    for name in ("math", "flash"):
        b = bk.BACKENDS[name]
        monkeypatch.setattr(b, "backward", lambda *a, _f=b.backward, _n=name, **kw: ran.append(_n) or _f(*a, **kw))
    q, k, v = (torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3))
    with longattn.use_backend("math"):
        out = longattn.attention(q, k, v, causal=True)
    out.sum().backward()
    assert ran == ["math"]
    ran.clear()
    longattn.attention(q, k, v, causal=True).sum().backward()  # outside the block: auto (flash on CPU)
    assert ran == ["flash"]


def test_backend_selection_cache_follows_what_refusals_read():
    """select_backend caches its answer; the key holds everything the
    refusals read, so a forced backend, another dtype or another shape gives
    a fresh answer."""
    q = torch.randn(1, 8, 2, 16)
    spec = bk.BlockSpec(1.0)
    assert bk.select_backend(q, q, spec).name == "flash"
    with longattn.use_backend("math"):
        assert bk.select_backend(q, q, spec, bk.resolve("auto")).name == "math"
    assert bk.select_backend(q, q, spec).name == "flash"
    win = bk.BlockSpec(1.0, window=(2, 2))  # CPU flash has no window: math (triton, interpreted, only where named)
    assert bk.select_backend(q, q, win).name == "math"
    if longattn.kernels_available("cpu"):
        assert bk.available_backends(q, q, win)[0] == "triton"
        assert bk.select_backend(q, q, win, "triton").name == "triton"
        assert bk.BACKENDS["triton"].auto_refusals(q) and not bk.BACKENDS["math"].auto_refusals(q)
    assert bk.select_backend(q.double(), q.double(), win).name == "math"
    assert "triton" not in bk.available_backends(q.double(), q.double(), win)  # no float64 kernel, even when named
    q3 = torch.randn(1, 8, 2, 12)  # head dim 12: no Triton kernel
    assert bk.select_backend(q3, q3, win).name == "math" and "triton" not in bk.available_backends(q3, q3, win)


def test_cudnn_stats_layout_and_dead_rows():
    """The lse the cuDNN backward reads: contiguous (B, H, S, 1) from any
    strides, rows that saw no key (-inf) as +inf so exp(S - lse) is 0."""
    lse = torch.randn(2, 5, 3).transpose(1, 2)  # (2, 3, 5) strided
    lse[0, 1, 2] = float("-inf")
    from longattn.backends.aten import cudnn_stats

    st = cudnn_stats(lse)
    assert st.shape == (2, 3, 5, 1) and st.is_contiguous()
    want = torch.where(torch.isneginf(lse), float("inf"), lse)
    assert torch.equal(st[..., 0], want)


@pytest.mark.parametrize("bad,exc,match", [
    (dict(q=torch.randn(2, 8, 4)), ValueError, "q must have 4 dims"),
    (dict(k=torch.randn(3, 8, 2, 16), v=torch.randn(3, 8, 2, 16)), ValueError, "batch"),
    (dict(k=torch.randn(2, 8, 3, 16), v=torch.randn(2, 8, 3, 16)), ValueError, "multiple of nheads"),
    (dict(k=torch.randn(2, 8, 2, 8), v=torch.randn(2, 8, 2, 8)), ValueError, "head dim"),
    (dict(v=torch.randn(2, 9, 2, 16)), ValueError, "same shape"),
    (dict(q=torch.randint(0, 3, (2, 8, 4, 16))), TypeError, "floating"),
    (dict(q=[1, 2]), TypeError, "torch.Tensor"),
])
def test_bad_inputs_raise(bad, exc, match):
    args = dict(q=torch.randn(2, 8, 4, 16), k=torch.randn(2, 8, 2, 16), v=torch.randn(2, 8, 2, 16))
    args.update(bad)
    with pytest.raises(exc, match=match):
        longattn.attention(args["q"], args["k"], args["v"])


def test_bad_flags_raise():
    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(TypeError, match="window_size"):
        longattn.attention(q, q, q, window_size=4)
    with pytest.raises(ValueError, match="window_size"):
        longattn.attention(q, q, q, window_size=(-3, 0))
    with pytest.raises(ValueError, match="softmax_scale"):
        longattn.attention(q, q, q, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="causal"):
        longattn.attention(q, q, q, causal="yes")


def test_torch_compile_traces_custom_ops():
    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    f = torch.compile(lambda q: longattn.attention(q, q, q, causal=True).sum(), backend="aot_eager", fullgraph=True)
    f(q).backward()
    ref = torch.autograd.grad(longattn.attention(q, q, q, causal=True).sum(), q)[0]
    assert torch.allclose(q.grad, ref, atol=1e-6)
    torch.library.opcheck(torch.ops.longattn.attention_fwd.default,
                          (q.detach(), q.detach(), q.detach(), 0.3, True, -1, -1, 0, "math"))


class _Recorder(TorchDispatchMode):
    """Records the ops that reach the dispatcher, changing nothing (as FakeTensor,
    export or FlopCounterMode would see them)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


_OP_NAMES = {"attention": "attention", "dilated_attention": "dilated", "attention_varlen": "varlen"}


@pytest.mark.parametrize("op", ["attention", "dilated_attention", "attention_varlen"])
def test_eager_calls_skip_the_dispatcher_others_run_the_custom_op(op):
    """Eagerly an op runs its two functions under one autograd.Function (no
    torch.library dispatch: tens of microseconds per pass); under a dispatch
    mode the custom ops run. Both match the float64 reference in outputs, lse
    and gradients."""
    q, k, v = torch.randn(1, 40, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
    do, dl = torch.randn_like(q), torch.randn(1, 4, 40)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    fns = {
        "attention": (lambda q, k, v: longattn.attention(q, k, v, causal=True, return_lse=True),
                      lambda q, k, v: attention_ref(q, k, v, causal=True)),
        "dilated_attention": (lambda q, k, v: longattn.dilated_attention(
            q, k, v, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True, return_lse=True),
                              lambda q, k, v: dilated_ref(q, k, v, [8, 16], [1, 2], causal=True)),
        "attention_varlen": (lambda q, k, v: tuple(x[None] for x in longattn.attention_varlen(
            q[0], k[0], v[0], cu, causal=True, return_lse=True)),
                             lambda q, k, v: _varlen_ref(q, k, v, cu)),
    }
    fn, ref = fns[op]
    leaf = q.clone().requires_grad_()
    node, names = fn(leaf, k, v)[0].grad_fn, []
    while node is not None:  # the chain back to the leaf: the direct autograd.Function on it
        names.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    assert any(n.startswith(f"longattn_{_OP_NAMES[op]}_fwd") for n in names), names
    check_op(fn, ref, [q, k, v], do, dl, TOL, tag="direct")
    mode = _Recorder()
    with mode:
        check_op(fn, ref, [q, k, v], do, dl, TOL, tag="dispatcher")
    assert {n for n in mode.ops if n.startswith("longattn.")} >= {f"longattn.{n}_{p}" for n in [_OP_NAMES[op]]
                                                                  for p in ("fwd", "bwd")}


def _paths():
    """One dense op call two ways: the autograd.Function eager calls run, and
    the torch.library op everything else runs."""
    from longattn.ops.attention import _attention

    args = (16 ** -0.5, True, -1, -1, 0, "math")
    return (lambda q, k, v: _attention.function.apply(q, k, v, *args),
            lambda q, k, v: _attention.fwd_op(q, k, v, *args))


def _scenario(name, path, q, k, v):
    """One autograd situation on one path: its outputs and q/k/v grads (or the error)."""
    if name == "no_grad":
        with torch.no_grad():
            out, lse = path(q, k, v)[:2]
        return out, lse, out.requires_grad
    if name == "inference_mode":
        with torch.inference_mode():
            out, lse = path(q, k, v)[:2]
        return out, lse, out.requires_grad, out.is_inference()
    if name.startswith("checkpoint"):
        out, lse = torch.utils.checkpoint.checkpoint(path, q, k, v, use_reentrant=name.endswith("reentrant"))[:2]
    else:
        out, lse = path(q, k, v)[:2]
    if name == "double_backward":
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError) as e:
            g.sum().backward()
        return (type(e.value),)
    loss = {"lse_only": lse.sum(), "out_only": out.sum()}.get(name, out.sum() + lse.sum())
    loss.backward()
    return out, lse, *(x.grad for x in (q, k, v))


@pytest.mark.parametrize("name", ["partial_requires_grad", "no_grad", "inference_mode", "lse_only", "out_only",
                                  "checkpoint", "checkpoint_reentrant", "double_backward"])
def test_direct_path_matches_the_custom_op_in_autograd_corners(name):
    """The dispatcher-free eager path and the custom op agree: inputs of which
    only some need grad, no_grad / inference_mode, one output used, activation
    checkpointing both ways; double backward raises in both (the backward is
    once-differentiable)."""
    results = []
    for path in _paths():
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
        q.requires_grad_(name != "partial_requires_grad")
        k.requires_grad_()
        results.append(_scenario(name, path, q, k, v))
    direct, custom = results
    assert len(direct) == len(custom)
    for a, b in zip(direct, custom):
        assert (a is None and b is None) or (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name


def test_meta_tensors_get_the_fake_kernel():
    """On meta tensors the custom op runs its fake kernel (shapes for deferred
    init and size estimates); the direct path would run the kernels on them."""
    q = torch.empty(2, 64, 4, 16, device="meta", requires_grad=True)
    out, lse = longattn.dilated_attention(q, q, q, segment_lengths=[16, 32], dilation_rates=[1, 2],
                                          return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 64) and out.is_meta
    dq, = torch.autograd.grad(out.sum() + lse.sum(), q)
    assert dq.shape == q.shape and dq.is_meta
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    out, lse = longattn.attention_varlen(q[0], q[0], q[0], cu, causal=True, return_lse=True)
    assert out.shape == q[0].shape and lse.shape == (4, 64) and out.is_meta


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_jit_trace_records_the_custom_op(tmp_path):
    """torch.jit.trace records the custom op (an autograd.Function would be a
    Python op that torch.jit.save refuses); the saved trace reloads and matches."""

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return longattn.attention(q, k, v, causal=True)

    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    traced = torch.jit.trace(M(), (q, k, v), check_trace=False)
    assert "longattn::attention_fwd" in {n.kind() for n in traced.graph.nodes()}
    torch.jit.save(traced, tmp_path / "m.pt")
    assert torch.allclose(torch.jit.load(tmp_path / "m.pt")(q, k, v), M()(q, k, v))


def test_forward_mode_ad_raises_instead_of_dropping_tangents():
    """The ops have no forward-mode formula: an eager call on dual tensors
    raises (the custom op path would return no tangent without a word)."""
    import torch.autograd.forward_ad as fwAD

    q = torch.randn(1, 12, 2, 16)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="jvp"):
        longattn.attention(fwAD.make_dual(q, torch.ones_like(q)), q, q)


def _varlen_ref(q, k, v, cu):
    outs = [attention_ref(q[:, a:b], k[:, a:b], v[:, a:b], causal=True) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat([o for o, _ in outs], 1), torch.cat([lse for _, lse in outs], 2)


triton_ok = pytest.mark.skipif(not longattn.kernels_available(),
                               reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


@triton_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal,hkv,sq,sk,window,q_offset", [
    (False, 4, 37, 29, (-1, -1), None),
    (True, 2, 37, 37, (-1, -1), None),
    (True, 1, 20, 45, (-1, -1), None),
    (False, 2, 33, 33, (5, 3), None),
    (True, 4, 33, 33, (7, -1), None),
    (True, 2, 24, 24, (6, 0), 10),   # ring-style partial block: queries 10 positions after keys
])
def test_triton_dense(dtype, causal, hkv, sq, sk, window, q_offset):
    q = torch.randn(2, sq, 4, 32, dtype=dtype)
    k = torch.randn(2, sk, hkv, 32, dtype=dtype)
    v = torch.randn(2, sk, hkv, 32, dtype=dtype)
    do, dl = torch.randn(2, sq, 4, 32, dtype=dtype), torch.randn(2, 4, sq)
    off = sk - sq if q_offset is None else q_offset
    spec = bk.BlockSpec(32 ** -0.5, causal, window, off)

    class F(torch.autograd.Function):  # drive the backend directly (q_offset is internal)
        @staticmethod
        def forward(ctx, q, k, v):
            o, l = bk.block_forward(q, k, v, spec, "triton")
            ctx.save_for_backward(q, k, v, o, l)
            return o, l

        @staticmethod
        def backward(ctx, do_, dl_):
            q, k, v, o, l = ctx.saved_tensors
            return bk.block_backward(do_, q, k, v, o, l, spec, "triton", dlse=dl_)

    check_op(F.apply, lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window, q_offset=off),
             [q, k, v], do, dl, TOL if dtype == torch.float32 else 3e-3)


def test_unused_lse_gradient_is_not_materialised(monkeypatch):
    seen = []
    orig = bk.block_backward

    def spy(*a, **kw):
        seen.append(kw.get("dlse"))
        return orig(*a, **kw)

    monkeypatch.setattr(bk, "block_backward", spy)
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    longattn.attention(q, q, q).sum().backward()
    out, lse = longattn.attention(q, q, q, return_lse=True)
    out.sum().backward()
    assert seen == [None, None]  # a zero dlse would take the slower folding path
    q.grad = None
    out, lse = longattn.attention(q, q, q, return_lse=True)
    lse.sum().backward()  # only lse used: dout is None inside, still correct
    ref = torch.autograd.grad(torch.logsumexp(torch.einsum("bqhd,bkhd->bhqk", q, q) * 8 ** -0.5, -1).sum(), q)[0]
    assert seen[-1] is not None and torch.allclose(q.grad, ref, atol=1e-5)
