"""The FlashAttention-4 backend: its capability table and the choice on CPU
(fake tensors and a substituted capability lookup, no FA4 needed), the one
module that reaches FA4's private functions, and on a GPU with FA4 installed
every result against float64 references, within 2x the error of PyTorch's own
bf16 flash kernel (the ``flash`` backend) on the same call."""
import subprocess
import sys
import types

import pytest
import torch

import longattn
from longattn import backends as bk
from longattn import tuning
from longattn.backends import _fa4_api
from longattn.backends import varlen as _varlen
from longattn.backends.fa4 import FA4Backend
from longattn.distributed.fused_varlen import FA4Varlen, fused_call, step_kernel
from longattn.distributed.plan import local_length
from reference import assert_close, attention_ref, rel_err, results
from test_varlen import varlen_ref

CUDA = torch.device("cuda", 0)


class _Api:
    """A stand-in for :mod:`longattn.backends._fa4_api`: installed or not."""

    def __init__(self, why=None):
        self.why, self.asked = why, 0

    def problem(self):
        self.asked += 1
        return self.why


class _Fake(FA4Backend):
    """FA4 on a GPU of the given compute capability."""

    def __init__(self, cap=(9, 0), why=None):
        super().__init__(_Api(why))
        self.cap = cap

    def capability(self, device):
        return self.cap


def _t(*shape, dtype=torch.bfloat16, device=CUDA):
    """Only what refusals read: device, dtype, shape."""
    return types.SimpleNamespace(device=device, dtype=dtype, shape=tuple(shape))


SPEC = bk.BlockSpec(0.1)


# ------------------------------------------------------------------ capabilities and refusals (CPU)
def test_capability_table():
    b = bk.BACKENDS["fa4"]
    assert isinstance(b, FA4Backend) and bk.AUTO_ORDER[0] == "fa4"
    assert b.devices == ("cuda",) and set(b.dtypes) == {torch.float16, torch.bfloat16}
    assert (b.min_headdim, b.max_headdim, b.headdim_multiple) == (8, 256, 8)
    assert b.supports_window and b.supports_gqa_native and b.supports_softcap and b.min_capability == (9, 0)
    assert b.arch_max_headdim == {9: 256, 10: 128}


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_accepts_hopper_calls(d):
    b = _Fake()
    q, k = _t(2, 64, 8, d), _t(2, 64, 2, d)
    for spec in (SPEC, bk.BlockSpec(0.1, True), bk.BlockSpec(0.1, False, (16, 0)), bk.BlockSpec(0.1, True, (8, -1))):
        assert b.refusals(spec, q, k) == []
    assert b.refusals(bk.BlockSpec(0.1, True, q_offset=64), _t(1, 16, 4, d), _t(1, 80, 4, d)) == []
    assert b.varlen_refusals(_t(500, 8, d)) == []


@pytest.mark.parametrize("case,q,cap,spec,k,expect", [
    ("cpu", _t(1, 8, 2, 64, device=torch.device("cpu")), (9, 0), SPEC, None, "device cpu"),
    ("fp32", _t(1, 8, 2, 64, dtype=torch.float32), (9, 0), SPEC, None, "dtype torch.float32"),
    ("d12", _t(1, 8, 2, 12), (9, 0), SPEC, None, "not a multiple of 8"),
    ("d4", _t(1, 8, 2, 4), (9, 0), SPEC, None, "head dim 4 < 8"),
    ("d264", _t(1, 8, 2, 264), (9, 0), SPEC, None, "head dim 264 > 256"),
    ("sm100_d192", _t(1, 8, 2, 192), (10, 0), SPEC, None, "head dim 192 > 128 on sm_100"),
    ("sm90_d8", _t(1, 8, 2, 8), (9, 0), SPEC, None, "head dim 8 on sm_90: verified only"),
    ("sm90_d72", _t(1, 8, 2, 72), (9, 0), SPEC, None, "head dim 72 on sm_90: verified only"),
    ("sm80", _t(1, 8, 2, 64), (8, 0), SPEC, None, "compute capability (8, 0) < (9, 0)"),
    ("sm120", _t(1, 8, 2, 64), (12, 0), SPEC, None, "sm_90 and sm_100 only"),
    # causal with the query rows aligned to the first keys (a ring step's diagonal block with sq != sk)
    ("top_left", _t(1, 4, 2, 64), (9, 0), bk.BlockSpec(0.1, True, q_offset=0), _t(1, 8, 2, 64), "bottom-right"),
    ("window_offset", _t(1, 8, 2, 64), (9, 0), bk.BlockSpec(0.1, False, (4, 4), q_offset=3), None,
     "not bottom-right aligned (0)"),
])
def test_refusals(case, q, cap, spec, k, expect):
    b = _Fake(cap)
    why = b.refusals(spec, q, k or q)
    assert any(expect in r for r in why), why


def test_unmasked_calls_take_any_offset():
    assert _Fake().refusals(bk.BlockSpec(0.1, q_offset=5), _t(1, 4, 2, 64), _t(1, 32, 2, 64)) == []


def test_not_installed_is_a_reason_and_asked_only_on_cuda():
    b = _Fake(why="flash-attn-4 not installed (x); pip install 'longattn[fa4]'")
    q = _t(1, 8, 2, 64)
    assert b.refusals(SPEC, q, q) == [b._api.why] and b.varlen_refusals(_t(8, 2, 64)) == [b._api.why]
    cpu = _Fake()
    cpu.refusals(SPEC, torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64))
    cpu.varlen_refusals(torch.randn(8, 2, 64))
    assert cpu._api.asked == 0  # a CPU call never imports FA4


def test_varlen_refusals():
    b = _Fake()
    assert any("CUDA" in r for r in b.varlen_refusals(torch.randn(8, 2, 64)))
    assert any("fp16/bf16" in r for r in b.varlen_refusals(_t(8, 2, 64, dtype=torch.float32)))
    assert any("head dim 20" in r for r in b.varlen_refusals(_t(8, 2, 20)))
    assert any("(8, 6)" in r for r in _Fake((8, 6)).varlen_refusals(_t(8, 2, 64)))
    assert any("> 128 on sm_100" in r for r in _Fake((10, 0)).varlen_refusals(_t(8, 2, 256)))


# ------------------------------------------------------------------------------ the choice (CPU)
def test_auto_takes_fa4_first_on_hopper(monkeypatch):
    fa4 = bk.BACKENDS["fa4"]
    monkeypatch.setattr(fa4, "_api", _Api())
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (9, 0))
    q, k = _t(1, 128, 8, 128), _t(1, 128, 2, 128)
    assert bk._select(q, k, bk.BlockSpec(0.1, True, q_offset=0), "auto", ()).name == "fa4"
    assert bk._select(q, k, SPEC, "fa4", ()).name == "fa4"
    assert _varlen.choose(_t(4096, 8, 128), "auto", ndocs=1) == "fa4"  # long documents too
    assert _varlen.choose(_t(4096, 8, 128), "fa4", ndocs=40) == "fa4"


def test_without_fa4_the_choice_is_unchanged(monkeypatch):
    fa4 = bk.BACKENDS["fa4"]
    monkeypatch.setattr(fa4, "_api", _Api("flash-attn-4 not installed"))
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (9, 0))
    q, k = _t(1, 128, 8, 128), _t(1, 128, 2, 128)
    spec = bk.BlockSpec(0.1, True, q_offset=0)
    got = bk._select(q, k, spec, "auto", ())
    assert got.name != "fa4" and got is bk._select(q, k, spec, "auto", ("fa4",))
    with pytest.raises(ValueError, match="backend='fa4' cannot run this call: flash-attn-4 not installed"):
        bk._select(q, k, spec, "fa4", ())
    for ndocs in (1, 64):
        assert _varlen.choose(_t(4096, 8, 128), "auto", ndocs) in ("loop", "flash")
    with pytest.raises(ValueError, match="backend='fa4' cannot run this varlen call: flash-attn-4 not installed"):
        _varlen.choose(_t(4096, 8, 128), "fa4", 4)


def test_cpu_calls_never_pick_fa4():
    q = torch.randn(1, 8, 2, 16)
    assert bk.select_backend(q, q, SPEC).name == "flash"
    assert any("device cpu" in r for r in bk.explain(q, q, SPEC)["fa4"])
    assert _varlen.choose(torch.randn(16, 2, 16), "auto", 2) == "loop"
    with pytest.raises(ValueError, match="cannot run this call: device cpu"):
        longattn.attention(q, q, q, backend="fa4")


def test_softcap_is_a_capability(monkeypatch):
    """FA4 soft-caps in both passes: with it installed on Hopper, auto sends a
    soft-capped call (dense, and packed documents in one launch) to FA4;
    without it the dense call goes to a backend that soft-caps (math), packed
    documents loop over them, and the flash and Triton varlen kernels refuse."""
    fa4 = bk.BACKENDS["fa4"]
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (9, 0))
    q, k = _t(1, 128, 8, 128), _t(1, 128, 2, 128)
    spec = bk.BlockSpec(0.1, True, softcap=30.0)
    monkeypatch.setattr(fa4, "_api", _Api())
    assert bk.explain(q, k, spec)["fa4"] == [] and bk._select(q, k, spec, "auto", ()).name == "fa4"
    assert _varlen.choose(_t(4096, 8, 128), "auto", ndocs=40, softcap=30.0) == "fa4"
    assert _varlen.choose(_t(4096, 8, 128), "fa4", ndocs=40, softcap=30.0) == "fa4"
    monkeypatch.setattr(fa4, "_api", _Api("flash-attn-4 not installed"))
    assert bk._select(q, k, spec, "auto", ()).name == "math"
    for ndocs in (1, 64):
        assert _varlen.choose(_t(4096, 8, 128), "auto", ndocs, softcap=30.0) == "loop"
    for name in ("flash", "triton"):
        with pytest.raises(ValueError, match=f"backend='{name}' cannot run this varlen call: logit soft-capping"):
            _varlen.choose(_t(4096, 8, 128), name, 4, softcap=30.0)


def test_import_longattn_does_not_import_fa4():
    code = "import sys, longattn; bad = {'flash_attn', 'cutlass'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ---------------------------------------------------------------------- the private-API module (CPU)
def _fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
         softmax_scale=None, causal=False, softcap=None, window_size_left=None, window_size_right=None, num_splits=1,
         return_lse=False, pack_gqa=None, **more):
    pass


def _bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
         window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
         deterministic=False, dlse=None):
    pass


def test_signature_check_names_the_version_written_for():
    ok = types.SimpleNamespace(_flash_attn_fwd=_fwd, _flash_attn_bwd=_bwd)
    assert _fa4_api.signature_problem(ok, "4.0.0b36") is None
    moved = types.SimpleNamespace(_flash_attn_fwd=_fwd)
    why = _fa4_api.signature_problem(moved, "4.1.0")
    assert "4.1.0" in why and "no _flash_attn_bwd" in why and f"written for flash-attn-4=={_fa4_api.WRITTEN_FOR}" in why
    renamed = types.SimpleNamespace(_flash_attn_fwd=_fwd, _flash_attn_bwd=lambda q, k, v, out, dout, lse: None)
    why = _fa4_api.signature_problem(renamed, "4.1.0")
    assert "'dlse'" in why and _fa4_api.WRITTEN_FOR in why


def test_window_bounds():
    assert _fa4_api._window((-1, -1)) == (None, None)
    assert _fa4_api._window((-1, 0)) == (None, 0)
    assert _fa4_api._window((128, -1)) == (128, None)


class _MathInterface:
    """Stands in for ``flash_attn.cute.interface`` on CPU: FA4's conventions
    (bottom-right masks, per document in varlen calls whose query and key
    documents may differ, and per row of a cache read to ``seqused_k``; None an
    unbounded window side and a negative one a real bound; softcap None or 0
    for none; varlen lse (H, T); the 5-tuple the forward returns) over the
    math backend, so the paths from the backend, the varlen kinds, the fused
    ring step and the decode engine to FA4 run without a GPU."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def _spec(q, k, scale, causal, left, right, softcap):
        assert all(w is None or w >= 0 for w in (left, right)), (left, right)
        return bk.BlockSpec(scale, causal, (-1 if left is None else left, -1 if right is None else right),
                            k.shape[1] - q.shape[1], softcap or 0.0)

    def _flash_attn_fwd(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, max_seqlen_q=None,
                        max_seqlen_k=None, softmax_scale=None, causal=False, softcap=None, window_size_left=None,
                        window_size_right=None, num_splits=1, return_lse=False, pack_gqa=None):
        assert return_lse and (cu_seqlens_q is None) == (max_seqlen_q is None)
        assert (cu_seqlens_q is None) == (cu_seqlens_k is None)
        self.calls.append(dict(varlen=cu_seqlens_q is not None, seqused_k=seqused_k is not None,
                               num_splits=num_splits, softcap=softcap, max_seqlen_k=max_seqlen_k, pack_gqa=pack_gqa))
        win = (softmax_scale, causal, window_size_left, window_size_right, softcap)
        run = lambda qd, kd, vd: bk.MATH.forward(qd, kd, vd, self._spec(qd, kd, *win))
        if cu_seqlens_q is None and seqused_k is None:
            return (*run(q, k, v), None, None, None)
        out = torch.zeros_like(q)
        if seqused_k is not None:  # one cache row at a time, read to its length
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))
            for b, n in enumerate(seqused_k.tolist()):
                if n:
                    out[b:b + 1], lse[b:b + 1] = run(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
            return out, lse, None, None, None
        lse = torch.full(q.shape[1::-1], float("-inf"))
        for (a, e), (c, f) in zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_k)):
            if e > a and f > c:
                o, l = run(q[None, a:e], k[None, c:f], v[None, c:f])
                out[a:e], lse[:, a:e] = o[0], l[0]
        return out, lse, None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, dlse=None):
        assert lse.dtype == torch.float32 and (dlse is None or dlse.shape == lse.shape)
        win = (softmax_scale, causal, window_size_left, window_size_right, softcap)
        if cu_seqlens_q is None:
            return bk.MATH.backward(dout, q, k, v, out, lse, self._spec(q, k, *win), dlse)
        grads = [torch.zeros_like(x) for x in (q, k, v)]
        for (a, e), (c, f) in zip(_pairs(cu_seqlens_q), _pairs(cu_seqlens_k)):
            qd, kd = q[None, a:e], k[None, c:f]
            if e == a or f == c:
                continue
            g = bk.MATH.backward(dout[None, a:e], qd, kd, v[None, c:f], out[None, a:e], lse[None, :, a:e],
                                 self._spec(qd, kd, *win), None if dlse is None else dlse[None, :, a:e])
            grads[0][a:e] += g[0][0]
            grads[1][c:f] += g[1][0]
            grads[2][c:f] += g[2][0]
        return tuple(grads)


def _pairs(cu):
    b = cu.tolist()
    return list(zip(b[:-1], b[1:]))


@pytest.fixture
def fake_interface(monkeypatch):
    """_fa4_api's calls land on a :class:`_MathInterface` (returned: it records them)."""
    fake = _MathInterface()
    assert _fa4_api.signature_problem(fake, _fa4_api.WRITTEN_FOR) is None
    monkeypatch.setattr(_fa4_api, "_interface", lambda: fake)
    return fake


@pytest.fixture
def math_fa4(fake_interface):
    return bk.BACKENDS["fa4"]


def _cpu_inputs(b, sq, sk, h, hkv, d=16):
    mk = lambda *shape: torch.randn(*shape, dtype=torch.float64)
    return mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, h, d), mk(b, h, sq)


@pytest.mark.parametrize("causal,window,sq,sk", [(False, (-1, -1), 24, 24), (True, (-1, -1), 30, 20),
                                                 (False, (5, -1), 16, 24), (True, (6, -1), 24, 24),
                                                 (False, (-1, 3), 24, 24)])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_plumbing_to_fa4(math_fa4, causal, window, sq, sk, softcap):
    """forward and backward (with the lse's gradient) through _fa4_api's calls."""
    q, k, v, do, dl = _cpu_inputs(2, sq, sk, 4, 2)
    spec = bk.BlockSpec(0.25, causal, window, sk - sq, softcap)
    out, lse = math_fa4.forward(q, k, v, spec)
    dq, dk, dv = math_fa4.backward(do, q, k, v, out, lse, spec, dlse=dl)
    want = results(lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window, scale=0.25, softcap=softcap),
                   [q, k, v], do, dl)
    assert_close(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), want, 1e-6, f"{causal} {window} softcap={softcap}")


def test_pack_gqa_choice(fake_interface):
    """Causal GQA calls of the tuned query lengths (the dilated views' 2048-row
    squares) run FA4 unpacked; every other call leaves FA4's choice."""
    b = FA4Backend()
    lo, hi = b.tuning.unpacked_gqa_causal_rows
    causal, full = bk.BlockSpec(0.1, True), bk.BlockSpec(0.1)
    rows = lambda s, h=8, hkv=2: (_t(1, s, h, 64), _t(1, s, hkv, 64))
    assert b.pack_gqa(*rows(hi), causal) is False and b.pack_gqa(*rows(lo), causal) is False
    for q, k, spec in [(*rows(hi), full), (*rows(hi, 8, 8), causal), (*rows(hi + 1), causal), (*rows(lo - 1), causal),
                       (*rows(1), causal), (_t(1, hi, 8, 64), _t(1, 2 * hi, 2, 64), causal)]:
        assert b.pack_gqa(q, k, spec) is None, (q.shape, k.shape, spec)
    with pytest.raises(ValueError, match="unpacked_gqa_causal_rows"):
        tuning.Fa4Tuning(unpacked_gqa_causal_rows=(8,))
    # the choice reaches FA4's call, and the result stays exact
    q, k, v, do, dl = _cpu_inputs(1, 6, 6, 4, 2)
    b.forward(q, k, v, bk.BlockSpec(0.25, True))
    assert fake_interface.calls[-1]["pack_gqa"] is None  # 6 rows: FA4's choice
    out, lse = FA4Backend(tuning=tuning.Fa4Tuning(unpacked_gqa_causal_rows=(1, 8))).forward(
        q, k, v, bk.BlockSpec(0.25, True))
    assert fake_interface.calls[-1]["pack_gqa"] is False
    want = results(lambda q, k, v: attention_ref(q, k, v, causal=True, scale=0.25), [q, k, v], do, dl)
    assert_close(dict(out=out, lse=lse), {n: want[n] for n in ("out", "lse")}, 1e-6, "unpacked")


def test_plumbing_merged_backward(math_fa4):
    q, k, v, do, dl = _cpu_inputs(1, 20, 40, 4, 2)
    spec = bk.BlockSpec(0.25)
    halves = [(k[:, :15], v[:, :15]), (k[:, 15:], v[:, 15:])]
    parts = [math_fa4.forward(q, kh, vh, spec) for kh, vh in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in parts)
    g = [math_fa4.backward(do, q, kh, vh, out, lse, spec, dlse=dl) for kh, vh in halves]
    got = dict(out=out, lse=lse, dq=g[0][0] + g[1][0], dk=torch.cat([g[0][1], g[1][1]], 1),
               dv=torch.cat([g[0][2], g[1][2]], 1))
    want = results(lambda q, k, v: attention_ref(q, k, v, scale=0.25), [q, k, v], do, dl)
    assert_close(got, want, 1e-6, "merged")


def _compiled_dense(math: _MathInterface):
    """FA4's dense entries as a replay sees them: each a function with a ``compile_cache`` (looked up through
    the function at each call, as FA4's are) whose compiled kernels take positional arguments. The forward
    allocates out and lse and runs one kernel; the backward runs preprocessing (delta; the dQ accumulator
    zeroed), main (dQ added into the accumulator, reading delta; dK, dV written) and conversion kernels, over
    ``math``. ``entries`` / ``kernels`` count the Python entries and the kernel calls."""
    ns = types.SimpleNamespace(entries=0, kernels=0)

    def compiled(fn, key, kernel):
        fn.compile_cache.setdefault(key, kernel)
        return fn.compile_cache[key]

    def fwd_kernel(q, k, v, out, lse, scale, causal, left, right, softcap, pack):
        ns.kernels += 1
        o, l_ = math._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, softcap=softcap,
                                     window_size_left=left, window_size_right=right, return_lse=True,
                                     pack_gqa=pack)[:2]
        out.copy_(o)
        lse.copy_(l_)

    def _flash_attn_fwd(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        softmax_scale=None, causal=False, softcap=0.0, window_size_left=None, window_size_right=None,
                        return_lse=False, seqused_k=None, num_splits=1, pack_gqa=None):
        assert cu_seqlens_q is None and seqused_k is None and return_lse
        ns.entries += 1
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        key = (q.shape, k.shape, q.dtype, causal, window_size_left, window_size_right, pack_gqa)
        compiled(_flash_attn_fwd, key, fwd_kernel)(q.detach(), k.detach(), v.detach(), out, lse, softmax_scale,
                                                   causal, window_size_left, window_size_right, softcap, pack_gqa)
        return out, lse, None, None, None

    def pre(out, dout, delta, acc):
        ns.kernels += 1
        delta.copy_((out * dout).sum(-1).transpose(1, 2))
        acc.zero_()

    def main(q, k, v, out, dout, lse, dlse, delta, acc, dk, dv, scale, causal, left, right, softcap):
        ns.kernels += 1
        g = math._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, softcap=softcap,
                                 window_size_left=left, window_size_right=right, dlse=dlse)
        acc.add_(g[0] + 0 * delta.sum())  # reads delta, as FA4's kernel does
        dk.copy_(g[1])
        dv.copy_(g[2])

    def post(acc, dq):
        ns.kernels += 1
        dq.copy_(acc)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, dlse=None):
        assert cu_seqlens_q is None
        ns.entries += 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=q.dtype)
        acc = torch.empty(q.shape, dtype=q.dtype)
        key = (q.shape, k.shape, q.dtype, causal, window_size_left, window_size_right)
        compiled(pre, key, pre)(out, dout, delta, acc)
        compiled(main, key, main)(q.detach(), k.detach(), v.detach(), out, dout, lse, dlse, delta, acc, dk, dv,
                                  softmax_scale, causal, window_size_left, window_size_right, softcap)
        compiled(post, key, post)(acc, dq)
        return dq, dk, dv

    for f in (_flash_attn_fwd, _flash_attn_bwd, pre, main, post):
        f.compile_cache = {}
    ns._flash_attn_fwd, ns._flash_attn_bwd, ns._bwd_preprocess, ns._bwd_main, ns._bwd_postprocess_convert = (
        _flash_attn_fwd, _flash_attn_bwd, pre, main, post)
    return ns


@pytest.mark.parametrize("causal,window,hkv", [(False, (-1, -1), 4), (True, (-1, -1), 2), (True, (6, -1), 2)])
def test_dense_calls_replay_their_compiled_calls(monkeypatch, causal, window, hkv):
    """A dense layout's first call takes FA4's entries, its second records their compiled calls (the kernels
    twice: the replay is checked), later ones replay them without an entry; out, lse and every gradient (the
    lse's too) stay the float64 definition's for new inputs. Another scale is another key and starts over;
    a recording that failed (k and v the same tensor: the recording cannot tell their slots apart) leaves
    FA4's own calls, while a recorded layout replays such a call; past
    ``Fa4Tuning.replay_max_tokens`` nothing is recorded."""
    ns = _compiled_dense(_MathInterface())
    monkeypatch.setattr(_fa4_api, "_interface", lambda: ns)

    def step(b, scale, tag, same_kv=False):
        q, k, v, do, dl = _cpu_inputs(2, 24, 24, 4, hkv)
        v = k if same_kv else v
        spec = bk.BlockSpec(scale, causal, window)
        before = (ns.entries, ns.kernels)
        out, lse = b.forward(q, k, v, spec)
        dq, dk, dv = b.backward(do, q, k, v, out, lse, spec, dlse=dl)
        want = results(lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window, scale=scale),
                       [q, k, v], do, dl)
        if same_kv:  # one tensor: its gradient is the sum of dK and dV
            want["dk"] = want["dv"] = want["dk"] + want["dv"]
            dk = dv = dk + dv
        assert_close(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), want, 1e-6, tag)
        return ns.entries - before[0], ns.kernels - before[1]

    b = FA4Backend()
    assert [step(b, 0.25, f"call {i}") for i in range(4)] == [(2, 4), (2, 8), (0, 4), (0, 4)]
    keys = list(b._replays)
    assert len(keys) == 2 and all(isinstance(b._replays[k], _fa4_api.Replay) for k in keys)
    assert all(a[i] is None for r in b._replays.values() for _, a, slots in r.calls for i in slots)  # no tensors
    assert [step(b, 0.3, f"scale 0.3, call {i}") for i in range(3)] == [(2, 4), (2, 8), (0, 4)]
    assert step(b, 0.25, "k is v, replayed", same_kv=True) == (0, 4)  # a replay reads aliased inputs alike
    fresh = FA4Backend()
    assert [step(fresh, 0.25, f"k is v, call {i}", same_kv=True)[0] for i in range(3)] == [2, 2, 2]
    assert any(isinstance(r, str) and "same tensor" in r for r in fresh._replays.values())
    short = FA4Backend(tuning=tuning.Fa4Tuning(replay_max_tokens=2 * 24 - 1))
    assert [step(short, 0.25, f"not replayed, call {i}") for i in range(3)] == [(2, 4)] * 3 and not short._replays


def test_dense_replays_keep_a_bounded_store(monkeypatch):
    """At most ``FA4Backend.MAX_REPLAYS`` keys are kept, the oldest dropped first."""
    ns = _compiled_dense(_MathInterface())
    monkeypatch.setattr(_fa4_api, "_interface", lambda: ns)
    b = FA4Backend()
    monkeypatch.setattr(b, "MAX_REPLAYS", 3)
    for n in (8, 16, 24, 32, 8):
        q, k, v, *_ = _cpu_inputs(1, n, n, 2, 2)
        b.forward(q, k, v, bk.BlockSpec(0.25))
    assert len(b._replays) == 3 and [k[1][0][1] for k in b._replays] == [24, 32, 8]


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (3, 2), 0.0),
                                                   (True, (4, 0), 0.0), (True, (-1, -1), 1.5)])
def test_plumbing_varlen(math_fa4, causal, window, softcap):
    lens = [5, 17, 1, 0, 9]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q, k, v, do = (torch.randn(total, n, 16, dtype=torch.float64) for n in (4, 2, 2, 4))
    dl = torch.randn(4, total, dtype=torch.float64)
    spec = bk.BlockSpec(16 ** -0.5, causal, window, softcap=softcap)
    out, lse = _varlen.forward("fa4", q, k, v, cu, max(lens), spec, "auto")
    dq, dk, dv = _varlen.backward("fa4", do, q, k, v, out, lse, dl, cu, max(lens), spec, "auto")
    want = results(lambda q, k, v: varlen_ref(q, k, v, cu, causal=causal, window=window, softcap=softcap), [q, k, v],
                   do, dl)
    assert_close(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), want, 1e-6, f"varlen {causal} {window} {softcap}")


def test_missing_fa4_is_reported(monkeypatch):
    """Where flash-attn-4 does not import (not installed: here its modules are made unimportable, whether or
    not it is), the fa4 backend says so with the install hint, and a call raises instead of running."""
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.setitem(sys.modules, name, None)
    _fa4_api._load.cache_clear()
    try:
        why = _fa4_api.problem()
        assert "flash-attn-4 not installed" in why and "longattn[fa4]" in why, why
        with pytest.raises(RuntimeError, match="not installed"):
            _fa4_api.forward(None, None, None, 1.0, False, (-1, -1))
    finally:
        _fa4_api._load.cache_clear()  # the next call imports it again (monkeypatch restores the modules)


def test_installed_fa4_has_what_longattn_calls():
    """Fails loudly when an installed flash-attn-4 moved or renamed the private
    functions :mod:`longattn.backends._fa4_api` calls, or is not the pinned release."""
    version = _fa4_api.installed_version()
    if version == "unknown":
        pytest.skip(f"{_fa4_api.DIST} is not installed ({_fa4_api.INSTALL_HINT})")
    import flash_attn.cute.interface as interface  # installed: a module that moved fails here, not skips

    assert _fa4_api.signature_problem(interface, version) is None
    assert version == _fa4_api.WRITTEN_FOR, (
        f"flash-attn-4 {version} installed, longattn's fa4 backend was checked against {_fa4_api.WRITTEN_FOR}: run "
        "the GPU tests of this file, then update WRITTEN_FOR and the pin in pyproject.toml")


# --------------------------------------------------------------------------------- GPU, FA4 installed
@pytest.fixture
def fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if _fa4_api.installed_version() == "unknown":
        pytest.skip(f"{_fa4_api.DIST} is not installed ({_fa4_api.INSTALL_HINT})")
    b = bk.BACKENDS["fa4"]
    if b.capability(CUDA)[0] not in b.arch_max_headdim:
        pytest.skip(f"FA4 backend runs on sm_90 / sm_100, not {b.capability(CUDA)}")
    assert _fa4_api.problem() is None, _fa4_api.problem()
    return b


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()


def _inputs(b, sq, sk, h, hkv, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (_randn(b, sq, h, d, gen=g), _randn(b, sk, hkv, d, gen=g), _randn(b, sk, hkv, d, gen=g),
            _randn(b, sq, h, d, gen=g), _randn(b, h, sq, gen=g, scale=0.3).float())


def _within_bar(fn, bar_fn, ref_fn, inputs, dout, dlse, tag, bar_dlse=True):
    """fn's out, lse and gradients within 2x bar_fn's error against ref_fn
    (float64); the lse within 1e-3 (both kernels keep it in float32).
    ``bar_dlse=False``: the bar's error is measured without the lse's gradient
    (PyTorch's flash varlen kernel takes none: with one, the call would loop
    over documents through ``auto``, which is FA4 itself)."""
    doubled = [x.double() for x in inputs]
    want = results(ref_fn, doubled, dout, dlse)
    got = results(fn, inputs, dout, dlse)
    bar_want = want if bar_dlse else results(ref_fn, doubled, dout)
    bar = results(bar_fn, inputs, dout, dlse if bar_dlse else None)
    tol = {n: 2 * rel_err(bar[n], bar_want[n]) for n in ("out", "dq", "dk", "dv")}
    errs = {n: rel_err(got[n], want[n]) for n in tol}
    assert all(errs[n] <= tol[n] for n in tol), (tag, errs, tol)
    assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, tag)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 32)), (True, (100, -1)),
                                           (False, (-1, 0)), (False, (200, -1))])
@pytest.mark.parametrize("sq,sk,h,hkv", [(512, 512, 8, 8), (384, 640, 8, 2), (300, 200, 4, 1)])
def test_dense_against_reference(fa4, causal, window, sq, sk, h, hkv):
    """Bottom-right masks (sq > sk: rows before key 0 see nothing), windows, GQA;
    with a gradient on the lse (the kernel's own dlse term)."""
    q, k, v, do, dl = _inputs(2, sq, sk, h, hkv, 128)
    kw = dict(causal=causal, window_size=window, return_lse=True)
    got = _within_bar(lambda q, k, v: longattn.attention(q, k, v, backend="fa4", **kw),
                      lambda q, k, v: longattn.attention(q, k, v, backend="flash", **kw),
                      lambda q, k, v: attention_ref(q, k, v, causal=causal, window=window), [q, k, v], do, dl,
                      f"causal={causal} window={window} {sq}x{sk} {h}/{hkv}")
    if causal and sq > sk:
        dead = slice(0, sq - sk)
        assert torch.equal(got["out"][:, dead], torch.zeros_like(got["out"][:, dead]))
        assert (got["lse"][:, :, dead] == float("-inf")).all() and torch.isfinite(got["dq"]).all()


@pytest.mark.gpu
def test_unpacked_gqa_causal(fa4):
    """The causal GQA squares FA4 runs unpacked (Fa4Tuning.unpacked_gqa_causal_rows:
    the dilated views' 2048 rows), against float64."""
    s = fa4.tuning.unpacked_gqa_causal_rows[1]
    q, k, v, do, dl = _inputs(1, s, s, 8, 2, 128)
    assert fa4.pack_gqa(q, k, bk.BlockSpec(128 ** -0.5, True)) is False
    _within_bar(lambda q, k, v: longattn.attention(q, k, v, backend="fa4", causal=True, return_lse=True),
                lambda q, k, v: longattn.attention(q, k, v, backend="flash", causal=True, return_lse=True),
                lambda q, k, v: attention_ref(q, k, v, causal=True), [q, k, v], do, dl, f"unpacked {s} rows 8/2")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 40, 64, 96, 192, 256])
def test_head_dims(fa4, d):
    q, k, v, do, _ = _inputs(1, 256, 256, 4, 2, d)
    if torch.cuda.get_device_capability()[0] == 9 and d not in fa4.sm90_headdims:
        # wrong gradients at these head dims on sm_90: refused, auto takes the next backend, within the bar
        assert bk.explain(q, k, bk.BlockSpec(d ** -0.5))["fa4"]
        assert bk.select_backend(q, k, bk.BlockSpec(d ** -0.5)).name != "fa4"
        _within_bar(lambda q, k, v: longattn.attention(q, k, v, return_lse=True),
                    lambda q, k, v: longattn.attention(q, k, v, backend="flash", return_lse=True),
                    lambda q, k, v: attention_ref(q, k, v), [q, k, v], do, None, f"auto at d={d}")
        return
    _within_bar(lambda q, k, v: longattn.attention(q, k, v, backend="fa4", return_lse=True),
                lambda q, k, v: longattn.attention(q, k, v, backend="flash", return_lse=True),
                lambda q, k, v: attention_ref(q, k, v), [q, k, v], do, None, f"d={d}")


@pytest.mark.gpu
def test_auto_picks_fa4(fa4):
    q, k, v, *_ = _inputs(1, 256, 256, 8, 2, 128)
    spec = bk.BlockSpec(128 ** -0.5, True)
    assert bk.explain(q, k, spec)["fa4"] == [] and bk.select_backend(q, k, spec).name == "fa4"
    assert _varlen.choose(q[0], "auto", ndocs=3) == "fa4"


@pytest.mark.gpu
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("hkv", [8, 2])
def test_backward_from_merged_out_and_lse(fa4, with_dlse, hkv):
    """Two key halves attended apart and merged: each half's backward from the
    merged out and lse gives the gradients of attention over all keys (the
    ring-attention identity ring and dilated branches rely on)."""
    q, k, v, do, dl = _inputs(1, 512, 1024, 8, hkv, 128)
    dl = dl if with_dlse else None
    spec = bk.BlockSpec(128 ** -0.5)
    halves = [(k[:, :400], v[:, :400]), (k[:, 400:], v[:, 400:])]
    parts = [fa4.forward(q, kh, vh, spec) for kh, vh in halves]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in parts).to(q.dtype)
    grads = [fa4.backward(do, q, kh, vh, out, lse, spec, dlse=dl) for kh, vh in halves]
    merged = dict(out=out, lse=lse, dq=grads[0][0] + grads[1][0], dk=torch.cat([grads[0][1], grads[1][1]], 1),
                  dv=torch.cat([grads[0][2], grads[1][2]], 1))
    want = results(lambda q, k, v: attention_ref(q, k, v), [q.double(), k.double(), v.double()], do, dl)
    whole = results(lambda q, k, v: longattn.attention(q, k, v, backend="flash", return_lse=True), [q, k, v], do, dl)
    errs = {n: rel_err(merged[n], want[n]) for n in ("out", "dq", "dk", "dv")}
    bars = {n: 2 * rel_err(whole[n], want[n]) for n in errs}
    assert all(errs[n] <= bars[n] for n in errs), (errs, bars)
    assert_close(dict(lse=lse), dict(lse=want["lse"]), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window,hkv", [(False, (-1, -1), 8), (True, (-1, -1), 2), (True, (100, 0), 8),
                                               (False, (64, 32), 2)])
def test_dense_replay_on_gpu(fa4, causal, window, hkv):
    """On FA4 itself a dense layout's third call replays the compiled calls its second recorded: for new
    inputs the replayed forward equals FA4's own call bit for bit and the replayed backward (with an lse
    gradient) FA4's own within its run-to-run spread (dQ added by float32 atomics); GQA's backward included
    (dK, dV summed over query heads in float32 buffers that start as zeros)."""
    b = FA4Backend()
    spec = bk.BlockSpec(128 ** -0.5, causal, window)
    for seed in range(3):
        q, k, v, do, dl = _inputs(2, 384, 384, 8, hkv, 128, seed=seed)
        out, lse = b.forward(q, k, v, spec)
        grads = b.backward(do, q, k, v, out, lse, spec, dlse=dl)
    assert len(b._replays) == 2 and all(isinstance(r, _fa4_api.Replay) for r in b._replays.values()), b._replays
    own = FA4Backend(tuning=tuning.Fa4Tuning(replay_max_tokens=0))
    want = own.forward(q, k, v, spec)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    for g, w in zip(grads, own.backward(do, q, k, v, out, lse, spec, dlse=dl)):
        assert rel_err(g, w) < 1e-2, rel_err(g, w)
    assert not own._replays


def _block_results(backend, q, k, v, do, dl, spec):
    """One block's forward and backward called directly (the views stay views:
    the autograd helpers clone their inputs into contiguous tensors)."""
    out, lse = backend.forward(q, k, v, spec)
    dq, dk, dv = backend.backward(do, q, k, v, out, lse, spec, dlse=dl)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views(fa4, causal):
    """The dilated views engine's calls: q[:, off::r] of larger tensors, no copies."""
    r, off = 4, 1
    big = _inputs(1, 2048, 2048, 8, 2, 128)
    q, k, v, do = (x[:, off::r] for x in big[:4])
    dl = big[4][:, :, off::r]
    assert not q.is_contiguous() and not dl.is_contiguous()
    spec = bk.BlockSpec(128 ** -0.5, causal)
    want = results(lambda q, k, v: attention_ref(q, k, v, causal=causal), [q.double(), k.double(), v.double()],
                   do, dl)
    got = _block_results(fa4, q, k, v, do, dl, spec)
    bar = _block_results(bk.BACKENDS["flash"], q, k, v, do, dl, spec)
    errs = {n: rel_err(got[n], want[n]) for n in ("out", "dq", "dk", "dv")}
    tol = {n: 2 * rel_err(bar[n], want[n]) for n in errs}
    assert all(errs[n] <= tol[n] for n in errs), (errs, tol)
    assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3)
    o_copy, l_copy = fa4.forward(q.contiguous(), k.contiguous(), v.contiguous(), spec)
    assert torch.equal(got["out"], o_copy) and torch.equal(got["lse"], l_copy)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,causal,window,hkv", [
    ([500, 17, 1, 900, 0, 130], False, (-1, -1), 8),
    ([500, 17, 1, 900, 0, 130], True, (-1, -1), 2),
    ([300, 2, 700], True, (64, 0), 4),
    ([256, 256, 512], False, (32, 16), 8),
])
def test_varlen_one_launch(fa4, lens, causal, window, hkv):
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    total, h = int(cu[-1]), 8
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (_randn(total, n, 128, gen=g) for n in (h, hkv, hkv, h))
    dl = _randn(h, total, gen=g, scale=0.3).float()
    assert _varlen.choose(q, "auto", len(lens)) == "fa4"
    kw = dict(causal=causal, window_size=window, return_lse=True)
    _within_bar(lambda q, k, v: longattn.attention_varlen(q, k, v, cu, backend="fa4", **kw),
                lambda q, k, v: longattn.attention_varlen(q, k, v, cu, backend="flash", **kw),
                lambda q, k, v: varlen_ref(q, k, v, cu.cpu(), causal=causal, window=window), [q, k, v], do, dl,
                f"varlen {lens} causal={causal} window={window}", bar_dlse=False)


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [2.0, 30.0])
@pytest.mark.parametrize("causal,sq,sk,hkv", [(True, 512, 512, 2), (False, 384, 640, 8), (True, 300, 200, 1)])
def test_softcap(fa4, softcap, causal, sq, sk, hkv):
    """Soft-capping in FA4's kernels (auto picks it), with the lse's gradient
    and sinks merged after: within 2x the error the flash backend makes on the
    same call without soft-capping (flash has none; its bf16 error is the bar
    of every FA4 test here), against float64."""
    q, k, v, do, dl = _inputs(2, sq, sk, 8, hkv, 128, seed=3)
    spec = bk.BlockSpec(128 ** -0.5, causal, q_offset=sk - sq, softcap=softcap)
    assert bk.select_backend(q, k, spec).name == "fa4"
    sinks = torch.randn(8, device="cuda")
    ref = lambda q, k, v, s=None: attention_ref(q, k, v, causal=causal, softcap=softcap, sinks=s)
    plain = lambda q, k, v: attention_ref(q, k, v, causal=causal)
    bar_got = results(lambda q, k, v: longattn.attention(q, k, v, causal=causal, return_lse=True, backend="flash"),
                      [q, k, v], do, dl)
    bar_want = results(plain, [x.double() for x in (q, k, v)], do, dl)
    tol = {n: 2 * rel_err(bar_got[n], bar_want[n]) for n in ("out", "dq", "dk", "dv")}
    for with_sinks in (False, True):
        xs = [q, k, v] + ([sinks] if with_sinks else [])
        fn = lambda *a: longattn.attention(*a[:3], causal=causal, softcap=softcap, sinks=a[3] if with_sinks else None,
                                           return_lse=True, backend="fa4")
        got = results(fn, xs, do, dl)
        want = results(ref, [x.double() for x in xs], do, dl)
        errs = {n: rel_err(got[n], want[n]) for n in tol}
        assert all(errs[n] <= tol[n] for n in tol), (softcap, with_sinks, errs, tol)
        assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, f"softcap={softcap} sinks={with_sinks}")
        if with_sinks:
            assert_close(dict(dsinks=got["dsinks"]), dict(dsinks=want["dsinks"]), 2e-2, "dsinks")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_varlen_one_launch(fa4, causal):
    lens = [500, 17, 1, 900, 0, 130]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    total, h = int(cu[-1]), 8
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, do = (_randn(total, n, 128, gen=g) for n in (h, 2, 2, h))
    dl = _randn(h, total, gen=g, scale=0.3).float()
    assert _varlen.choose(q, "auto", len(lens), softcap=5.0) == "fa4"
    got = results(lambda q, k, v: longattn.attention_varlen(q, k, v, cu, causal=causal, softcap=5.0, return_lse=True),
                  [q, k, v], do, dl)
    want = results(lambda q, k, v: varlen_ref(q, k, v, cu.cpu(), causal=causal, softcap=5.0),
                   [x.double() for x in (q, k, v)], do, dl)
    bar_got = results(lambda q, k, v: longattn.attention_varlen(q, k, v, cu, causal=causal, return_lse=True,
                                                                backend="flash"), [q, k, v], do)
    bar_want = results(lambda q, k, v: varlen_ref(q, k, v, cu.cpu(), causal=causal), [x.double() for x in (q, k, v)],
                       do)
    tol = {n: 2 * rel_err(bar_got[n], bar_want[n]) for n in ("out", "dq", "dk", "dv")}
    errs = {n: rel_err(got[n], want[n]) for n in tol}
    assert all(errs[n] <= tol[n] for n in tol), (errs, tol)
    assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, "varlen softcap")


# ------------------------------------------------------------- the fused ring step of packed documents
FUSE_DOCS = (3, 40, 1, 17, 2, 5, 9, 30, 12, 6, 4)


def _step_ref(calls, q, k, v, dout, dlse):
    """A fused step's plain calls one by one through the math backend, merged
    by lse: (out, lse) and the gradients from the merged out and lse (the ring's
    own per-call path)."""
    h, t = q.shape[2], q.shape[1]
    lse = torch.full((1, h, t), float("-inf"), dtype=torch.float32)
    parts = []
    for c in calls:
        o, l = bk.block_forward(q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], c.spec, "math")
        parts.append((c, o, l))
        lse[:, :, c.q0:c.q1] = torch.logaddexp(lse[:, :, c.q0:c.q1], l)
    out = torch.zeros_like(q)
    for c, o, l in parts:
        w = torch.exp(l - lse[:, :, c.q0:c.q1]).nan_to_num(0.0).transpose(1, 2)[..., None]
        out[:, c.q0:c.q1] += o * w.to(o.dtype)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for c, _, _ in parts:
        qs, ks = slice(c.q0, c.q1), slice(c.k0, c.k1)
        g = bk.block_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs].contiguous(),
                              c.spec, "math", dlse=None if dlse is None else dlse[:, :, qs].contiguous())
        grads[0][:, qs] += g[0]
        grads[1][:, ks] += g[1]
        grads[2][:, ks] += g[2]
    return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])


def _fused_step(layout, world, rank, src, causal, q, hkv, kernel):
    cu = tuple(torch.tensor((0,) + FUSE_DOCS).cumsum(0).tolist())
    step = fused_call(cu, layout, world, rank, src, causal, (-1, -1), q.shape[-1] ** -0.5, str(q.device),
                      q.shape[2] * q.shape[3], kernel)
    assert step is not None, "the step did not fuse"
    return step[0].run


def test_step_kernel_choice(monkeypatch):
    """FA4's varlen kernel where it runs (auto or forced fa4), else FlashAttention-2's
    (auto or flash), never with a window or soft-capping; none on CPU."""
    fa4 = bk.BACKENDS["fa4"]
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (9, 0))
    q = _t(4096, 8, 128)
    monkeypatch.setattr(fa4, "_api", _Api())
    assert [step_kernel(q, (-1, -1), b) for b in ("auto", "fa4", "flash", "cudnn")] == ["fa4", "fa4", "flash", ""]
    assert step_kernel(q, (8, 0), "auto") == "" and step_kernel(q, (-1, -1), "auto", softcap=5.0) == ""
    monkeypatch.setattr(fa4, "_api", _Api("flash-attn-4 not installed"))
    assert [step_kernel(q, (-1, -1), b) for b in ("auto", "fa4", "flash")] == ["flash", "", "flash"]
    assert step_kernel(_t(4096, 8, 128, dtype=torch.float32), (-1, -1), "auto") == ""
    assert step_kernel(torch.randn(64, 2, 16), (-1, -1), "auto") == ""


@pytest.mark.parametrize("layout,world,rank,src", [("zigzag", 2, 0, 0), ("zigzag", 3, 2, 1), ("contiguous", 3, 1, 1)])
@pytest.mark.parametrize("causal,hkv,with_dlse", [(True, 2, True), (False, 4, True), (True, 4, False)])
def test_fused_step_on_fa4(fake_interface, layout, world, rank, src, causal, hkv, with_dlse):
    """The fused step's launches through _fa4_api (separate query and key
    documents, the lse's gradient taken in the launch, not one call per
    document) against its plain calls merged by lse."""
    torch.manual_seed(5)
    total = sum(FUSE_DOCS)
    t = local_length(tuple(torch.tensor((0,) + FUSE_DOCS).cumsum(0).tolist()), layout, world)
    q, do = (torch.randn(1, t, 4, 16, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, t, hkv, 16, dtype=torch.float64) for _ in range(2))
    dl = torch.randn(1, 4, t, dtype=torch.float64) if with_dlse else None
    step = _fused_step(layout, world, rank, src, causal, q, hkv, "fa4")
    assert isinstance(step.kernel, FA4Varlen) and total > t
    out, lse = step.forward(q, k, v)
    assert fake_interface.calls and all(c["varlen"] for c in fake_interface.calls)
    g = step.backward(do, q, k, v, out, lse, dl)
    assert g is not None  # FA4 takes the lse gradient: no fallback to the plain calls
    want = _step_ref(step.calls, q, k, v, do, dl)
    assert_close(dict(out=out, lse=lse, dq=g[0], dk=g[1], dv=g[2]), want, 1e-6, f"{layout} {rank}<-{src} {causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal,hkv", [(True, 2), (False, 8)])
def test_fused_step_gpu(fa4, causal, hkv):
    """One fused ring step on FA4's varlen kernel (bf16, the lse's gradient in
    the launch) against its plain calls in float64."""
    t = local_length(tuple(torch.tensor((0,) + FUSE_DOCS).cumsum(0).tolist()), "zigzag", 2)
    g = torch.Generator(device="cuda").manual_seed(4)
    q, do = (_randn(1, t, 8, 128, gen=g) for _ in range(2))
    k, v = (_randn(1, t, hkv, 128, gen=g) for _ in range(2))
    dl = _randn(1, 8, t, gen=g, scale=0.3).float()
    step = _fused_step("zigzag", 2, 0, 0, causal, q, hkv, step_kernel(q[0], (-1, -1), "auto"))
    assert isinstance(step.kernel, FA4Varlen)
    out, lse = step.forward(q, k, v)
    grads = step.backward(do, q, k, v, out, lse, dl)
    assert grads is not None
    want = _step_ref(step.calls, *(x.double().cpu() for x in (q, k, v, do, dl)))
    got = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    assert_close(dict(lse=lse.cpu()), dict(lse=want["lse"]), 1e-3, "lse")
    assert_close({n: x.cpu() for n, x in got.items() if n != "lse"}, {n: want[n] for n in ("out", "dq", "dk", "dv")},
                 2e-2, f"fused step causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_ring_varlen_on_fa4(fa4, monkeypatch, tmp_path, causal):
    """ring_attention_varlen on one rank (NCCL): its many-document step fuses
    into FA4's varlen launches (counted), output, lse and gradients within 2x
    FA4's own one-launch attention_varlen error against float64. The
    multi-rank runs are the NCCL tests of test_ring_varlen.py."""
    import torch.distributed as dist

    launches = []
    real = FA4Varlen.forward
    monkeypatch.setattr(FA4Varlen, "forward", staticmethod(lambda *a: launches.append(1) or real(*a)))
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already up")
    try:
        lens = list(FUSE_DOCS) * 8
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        total, h = int(cu[-1]), 8
        g = torch.Generator(device="cuda").manual_seed(6)
        q, k, v, do = (_randn(total, n, 128, gen=g) for n in (h, 2, 2, h))
        dl = _randn(h, total, gen=g, scale=0.3).float()
        sh = lambda x: longattn.shard_varlen(x, cu)[0]
        us = lambda x: longattn.unshard_varlen(x, cu)

        def ring(q, k, v):
            out, lse = longattn.ring_attention_varlen(sh(q), sh(k), sh(v), cu, causal=causal, return_lse=True)
            return us(out), us(lse.t()).t()

        _within_bar(ring, lambda q, k, v: longattn.attention_varlen(q, k, v, cu.cuda(), causal=causal,
                                                                    return_lse=True, backend="fa4"),
                    lambda q, k, v: varlen_ref(q, k, v, cu, causal=causal), [q, k, v], do, dl,
                    f"ring varlen causal={causal}")
        assert launches, "no ring step fused into FA4's varlen kernel"
    finally:
        if own:
            dist.destroy_process_group()


def test_private_fa4_calls_live_in_one_module():
    """FA4's private functions (the interface's underscored calls) are called
    from longattn.backends._fa4_api alone, where its version check guards them."""
    import pathlib
    import re

    root = pathlib.Path(longattn.__file__).parent
    calls = re.compile(r"\.(_flash_attn_(fwd|bwd|varlen_fwd|varlen_bwd)|_bwd_preprocess|_bwd_postprocess\w*)\(")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "_fa4_api.py" and calls.search(p.read_text())]
    assert offenders == [], offenders
