"""Logit soft-capping and attention sinks in attention / attention_varlen
against float64 references: outputs, lse, every gradient (the sink's too),
rows that see no key, the backend choice, and bad inputs."""
import pytest
import torch

import longattn
from longattn import backends as bk
from reference import attention_ref, check_op, rel_err, varlen_ref

TOL = 1e-4
H, D = 4, 16


def _sinks():
    return torch.randn(H) * 2


# (sq, sk, hkv, causal, window): causal, a window, GQA, queries fewer than keys (bottom-right)
DENSE = [
    (9, 9, 4, True, (-1, -1)),
    (9, 9, 2, False, (2, 1)),
    (5, 11, 1, True, (3, 0)),
    (8, 8, 2, False, (-1, -1)),
]


@pytest.mark.parametrize("sq,sk,hkv,causal,window", DENSE)
@pytest.mark.parametrize("softcap,with_sinks", [(1.5, False), (0.0, True), (1.5, True)])
def test_dense(sq, sk, hkv, causal, window, softcap, with_sinks):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, sq, H, D), torch.randn(2, sk, hkv, D), torch.randn(2, sk, hkv, D)
    do, dl = torch.randn_like(q), torch.randn(2, H, sq)
    inputs = [q, k, v] + ([_sinks()] if with_sinks else [])
    fn = lambda q, k, v, s=None: longattn.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                    sinks=s, return_lse=True)
    ref = lambda q, k, v, s=None: attention_ref(q, k, v, causal=causal, window=window, softcap=softcap, sinks=s)
    errs = check_op(fn, ref, inputs, do, dl, TOL)
    assert ("dsinks" in errs) == with_sinks


def test_softcap_changes_the_result():
    """The comparisons above can tell a cap from none: a cap that bites moves the float64 reference's out far
    past their tolerance, and longattn's capped out is the capped reference's, not the uncapped one's."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 8, H, D) * 2 for _ in range(3))
    capped, plain = attention_ref(q, k, v, softcap=1.0)[0], attention_ref(q, k, v)[0]
    assert rel_err(capped, plain) > 100 * TOL
    got = longattn.attention(q, k, v, softcap=1.0)
    assert rel_err(got, capped) < TOL < rel_err(got, plain)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_that_see_no_key(with_sinks):
    """Queries longer than keys under causal: the first rows see no key. Out 0,
    lse -inf (with a sink: the sink), no NaN in any gradient."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 7, H, D), torch.randn(1, 4, H, D), torch.randn(1, 4, H, D)
    sinks = _sinks() if with_sinks else None
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    fn = lambda q, k, v, s=None: longattn.attention(q, k, v, causal=True, softcap=2.0, sinks=s, return_lse=True)
    ref = lambda q, k, v, s=None: attention_ref(q, k, v, causal=True, softcap=2.0, sinks=s)
    check_op(fn, ref, inputs, torch.randn_like(q), torch.randn(1, H, 7), TOL)
    out, lse = fn(*inputs)
    assert not out[:, :3].any()
    want = sinks.float()[None, :, None].expand(1, H, 3) if with_sinks else torch.full((1, H, 3), float("-inf"))
    assert torch.equal(lse[:, :, :3], want)


VARLEN = [
    ([5, 0, 7, 4], True, (-1, -1), 2),
    ([6, 9], False, (2, 2), 4),
    ([3, 10, 1], True, (3, 0), 1),
]


@pytest.mark.parametrize("lens,causal,window,hkv", VARLEN)
@pytest.mark.parametrize("softcap,with_sinks", [(1.5, False), (0.0, True), (1.5, True)])
def test_varlen(lens, causal, window, hkv, softcap, with_sinks):
    torch.manual_seed(3)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    t = int(cu[-1])
    q, k, v = torch.randn(t, H, D), torch.randn(t, hkv, D), torch.randn(t, hkv, D)
    do, dl = torch.randn_like(q), torch.randn(H, t)
    inputs = [q, k, v] + ([_sinks()] if with_sinks else [])
    fn = lambda q, k, v, s=None: longattn.attention_varlen(q, k, v, cu, causal=causal, window_size=window,
                                                           softcap=softcap, sinks=s, return_lse=True)
    ref = lambda q, k, v, s=None: varlen_ref(q, k, v, cu, causal, window, softcap, s)
    check_op(fn, ref, inputs, do, dl, TOL)


def test_sink_gradient_float64():
    """The sink's gradient in float64 inputs against float64 autograd of the
    reference, tighter than the float32 tests (lse stays float32: 1e-6)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 6, H, D, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(H, dtype=torch.float64)
    fn = lambda q, k, v, s: longattn.attention(q, k, v, causal=True, sinks=s, softcap=3.0, return_lse=True)
    ref = lambda q, k, v, s: attention_ref(q, k, v, causal=True, sinks=s, softcap=3.0)
    errs = check_op(fn, ref, [q, k, v, sinks], torch.randn_like(q), torch.randn(2, H, 6, dtype=torch.float64), 1e-5)
    assert errs["dsinks"] < 1e-5


def test_backend_choice_follows_softcap():
    """softcap is a capability: auto picks a backend that applies it (math
    here), a forced backend without it raises naming the reason, and
    explain() lists it."""
    q = torch.randn(1, 8, H, D)
    spec = bk.BlockSpec(D ** -0.5, True, softcap=5.0)
    assert bk.select_backend(q, q, spec).name == "math"
    assert "logit soft-capping (softcap) not supported" in bk.explain(q, q, spec)["flash"]
    assert bk.explain(q, q, spec)["math"] == []
    with pytest.raises(ValueError, match="soft-capping"):
        longattn.attention(q, q, q, causal=True, softcap=5.0, backend="flash")
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for name in ("triton", "flash"):
        with pytest.raises(ValueError, match="soft-capping"):
            longattn.attention_varlen(q[0], q[0], q[0], cu, softcap=5.0, backend=name)
    with longattn.use_backend("flash"):
        with pytest.raises(ValueError, match="soft-capping"):
            longattn.attention(q, q, q, causal=True, softcap=5.0)


def test_bad_inputs():
    q = torch.randn(1, 4, H, D)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            longattn.attention(q, q, q, softcap=bad)
        with pytest.raises(ValueError, match="softcap"):
            longattn.attention_varlen(q[0], q[0], q[0], cu, softcap=bad)
    with pytest.raises(TypeError, match="softcap"):
        longattn.attention(q, q, q, softcap=True)
    with pytest.raises(TypeError, match="softcap"):
        longattn.attention(q, q, q, softcap="50")
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(4,\)"):
        longattn.attention(q, q, q, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks must hold"):
        longattn.attention_varlen(q[0], q[0], q[0], cu, sinks=torch.zeros(1, H))
    with pytest.raises(ValueError, match="floating"):
        longattn.attention(q, q, q, sinks=torch.zeros(H, dtype=torch.long))
    with pytest.raises(TypeError, match="sinks"):
        longattn.attention(q, q, q, sinks=[0.0] * H)


def test_custom_op_with_softcap_and_compile():
    """The forward op with soft-capping passes opcheck (fake kernel, schema);
    torch.compile traces a call with soft-capping and sinks."""
    q = torch.randn(1, 6, H, D)
    torch.library.opcheck(torch.ops.longattn.attention_fwd.default,
                          (q, q, q, D ** -0.5, True, -1, -1, 0, "math", 2.0))
    sinks = torch.randn(H, requires_grad=True)
    f = torch.compile(lambda q, s: longattn.attention(q, q, q, causal=True, softcap=2.0, sinks=s).sum(),
                      backend="aot_eager", fullgraph=True)
    got = f(q, sinks)
    got.backward()
    want = longattn.attention(q, q, q, causal=True, softcap=2.0, sinks=sinks.detach()).sum()
    assert torch.allclose(got, want) and sinks.grad is not None and torch.isfinite(sinks.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "triton", "math"])
def test_bf16_on_cuda(backend):
    """bf16 on CUDA, GQA, causal, 1K tokens: sinks on every backend (their
    backward takes the lse gradient the sink merge gives), soft-capping where
    the backend applies it (auto picks one: math) and refused elsewhere;
    output, lse and all gradients near float64."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    q, k, v = mk(2, 1024, 8, 64), mk(2, 1024, 2, 64), mk(2, 1024, 2, 64)
    sinks = torch.randn(8, device="cuda", generator=g)
    do, dl = mk(2, 1024, 8, 64), torch.randn(2, 8, 1024, device="cuda", generator=g)
    for softcap in (0.0, 20.0):
        spec = bk.BlockSpec(64 ** -0.5, True, softcap=softcap)
        if backend != "auto" and bk.BACKENDS[backend].refusals(spec, q, k):
            with pytest.raises(ValueError):
                longattn.attention(q, k, v, causal=True, softcap=softcap, sinks=sinks, backend=backend)
            continue
        fn = lambda q, k, v, s: longattn.attention(q, k, v, causal=True, softcap=softcap, sinks=s, return_lse=True,
                                                   backend=backend)
        ref = lambda q, k, v, s: attention_ref(q, k, v, causal=True, softcap=softcap, sinks=s)
        check_op(fn, ref, [q, k, v, sinks], do, dl, tol=3e-2, tag=f"{backend} softcap={softcap}")


def test_sink_of_minus_inf_is_no_sink():
    """A head whose sink is -inf gives what no sink gives, also on rows that
    see no key (0 / -inf, gradients finite: no NaN through the merge)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.tensor([float("-inf"), 0.5], dtype=torch.float64, requires_grad=True)
    # fewer keys than queries, causal bottom-right: row 0 sits before the first key and sees none
    kk, vv = k[:, :5], v[:, :5]
    out, lse = longattn.attention(q, kk, vv, causal=True, window_size=(0, 0), return_lse=True, sinks=sinks)
    ref, ref_lse = longattn.attention(q, kk, vv, causal=True, window_size=(0, 0), return_lse=True)
    assert torch.equal(out[:, :, 0], ref[:, :, 0]) and torch.equal(lse[:, 0], ref_lse[:, 0])
    (out.sum() + lse.nan_to_num(neginf=0.0).sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v, sinks))
