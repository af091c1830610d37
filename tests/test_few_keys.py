"""Rows against a few keys every row sees, merged into a running (out, lse)
and added into a running dQ in place (longattn.kernels.few_keys under the
Triton interpreter, and longattn.flex.pieces.FewKeys's PyTorch form), against
float64: the merged out and lse, and the piece's dQ, dK, dV from the merged
statistics with an lse gradient, on strided views, GQA, a head dim Triton
pads, rows the running result left empty."""
import pytest
import torch

from longattn.flex.pieces import FewKeys
from longattn.kernels import _common, few_keys
from reference import assert_close

TOL = 1e-4


def _reference(q, k, v, out0, lse0, dout, dlse, scale):
    """float64: (out, lse) of (out0, lse0) merged with attention(q, k, v), and the gradients of q, k, v through
    that merge (out0, lse0 held fixed)."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(g, 2) for x in (k, v))
    s = torch.einsum("bnhd,bghd->bhng", q, kk) * scale
    lse1 = torch.logsumexp(s, -1)
    o1 = torch.einsum("bhng,bghd->bnhd", torch.softmax(s, -1), vv)
    l0 = lse0.double()
    lse = torch.logaddexp(l0, lse1)
    w = lambda a: torch.exp(a - lse).transpose(1, 2)[..., None]
    out = out0.double() * w(l0) + o1 * w(lse1)
    ((out * dout.double()).sum() + (lse * dlse.double()).sum()).backward()
    return dict(out=out.detach(), lse=lse.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _case(b, n, h, hkv, g, d, seed=0):
    """Views: the rows [5, 5 + n) of a shard, the keys [3, 3 + g) of a halo, out and lse of the shard's rows."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, dout = r(b, n + 9, h, d)[:, 5:5 + n], r(b, n + 9, h, d)[:, 5:5 + n]
    k, v = r(b, g + 6, hkv, d)[:, 3:3 + g], r(b, g + 6, hkv, d)[:, 3:3 + g]
    out0 = r(b, n + 9, h, d)
    lse0 = r(b, h, n + 9) + 2
    lse0[:, :, 5:8] = float("-inf")  # rows the own piece left empty: its out is 0 there
    out0[:, 5:8] = 0
    dlse = r(b, h, n)
    return q, k, v, out0, lse0, dout, dlse


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("b,n,h,hkv,g,d", [(2, 70, 4, 2, 40, 16), (1, 64, 2, 2, 128, 24), (1, 33, 3, 1, 7, 16)])
def test_few_keys_merge_and_gradients(impl, b, n, h, hkv, g, d):
    if impl == "triton" and not _common.available(torch.device("cpu")):
        pytest.skip(_common.unavailable_reason(torch.device("cpu")))
    q, k, v, out0, lse0, dout, dlse = _case(b, n, h, hkv, g, d)
    scale = d ** -0.5
    want = _reference(q, k, v, out0[:, 5:5 + n], lse0[:, :, 5:5 + n], dout, dlse, scale)
    out, lse = out0.clone(), lse0.clone()
    o, l_ = out[:, 5:5 + n], lse[:, :, 5:5 + n]  # merged in place through the views
    dq_own = torch.randn(b, n + 9, h, d)
    dq = dq_own.clone()
    if impl == "triton":
        few_keys.forward_into(q, k, v, o, l_, scale)
        dk, dv = few_keys.backward_into(dout, q, k, v, o, l_, dlse, dq[:, 5:5 + n], scale)
    else:
        piece = FewKeys(scale)
        piece.forward_into(q, k, v, o, l_)
        dk, dv = piece.backward_into(dout, q, k, v, o, l_, dlse, dq[:, 5:5 + n])
    assert dk.dtype == dv.dtype == torch.float32 and dk.shape == k.shape
    got = dict(out=o, lse=l_, dq=dq[:, 5:5 + n] - dq_own[:, 5:5 + n], dk=dk, dv=dv)
    assert_close(got, want, TOL, f"{impl} b={b} n={n} h={h}/{hkv} g={g} d={d}")
    # rows outside the views are untouched
    for x, x0 in ((out, out0), (lse, lse0), (dq, dq_own)):
        idx = [i for i in range(x.shape[1 if x.dim() == 4 else 2]) if not 5 <= i < 5 + n]
        sel = (lambda t: t[:, idx]) if x.dim() == 4 else (lambda t: t[:, :, idx])
        assert torch.equal(sel(x), sel(x0))


def test_few_keys_without_lse_gradient_and_empty_rows():
    """No dlse: delta is rowsum(dO * O) alone; zero rows: nothing runs, zero dK/dV."""
    if not _common.available(torch.device("cpu")):
        pytest.skip(_common.unavailable_reason(torch.device("cpu")))
    q, k, v, out0, lse0, dout, _ = _case(1, 40, 2, 2, 16, 16, seed=1)
    scale = 0.3
    want = _reference(q, k, v, out0[:, 5:45], lse0[:, :, 5:45], dout, torch.zeros(1, 2, 40), scale)
    o, l_ = out0[:, 5:45].clone(), lse0[:, :, 5:45].clone()
    few_keys.forward_into(q, k, v, o, l_, scale)
    dq = torch.zeros_like(q)
    dk, dv = few_keys.backward_into(dout, q, k, v, o, l_, None, dq, scale)
    assert_close(dict(out=o, lse=l_, dq=dq, dk=dk, dv=dv), want, TOL, "no dlse")
    e = q[:, :0]
    dk, dv = few_keys.backward_into(e, e, k, v, e, l_[:, :, :0], None, e.clone(), scale)
    assert not dk.any() and not dv.any() and dk.shape == k.shape


def test_few_keys_rejects_mismatched_shapes():
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 5, 3, 16), torch.randn(1, 5, 3, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        few_keys.forward_into(q, k, v, torch.zeros_like(q), torch.zeros(1, 4, 8), 1.0)
    with pytest.raises(ValueError, match=r"\(B, H, N\) float32"):
        few_keys.forward_into(q, k[:, :, :2], v[:, :, :2], torch.zeros_like(q), torch.zeros(1, 8, 4), 1.0)
    q2 = torch.randn(1, 8, 4, 32)[..., ::2]
    with pytest.raises(ValueError, match="q, dq must have a unit stride"):
        few_keys.backward_into(q, q2, k[:, :, :2], v[:, :, :2], q, torch.zeros(1, 4, 8), None, q2, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [16, 4])
def test_few_keys_bf16_on_gpu(hkv):
    """bf16 on CUDA: rows against 128 keys from an empty running state (out 0, lse -inf: plain attention) and
    merged into a running one, out and gradients within 2x PyTorch's bf16 SDPA error on the same float64
    reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch.nn.functional as F
    from reference import grads_of, rel_err

    dev, n, g, h, d = "cuda", 4096, 128, 16, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).bfloat16()
    q, k, v, dout = mk(1, n, h, d), mk(1, g, hkv, d), mk(1, g, hkv, d), mk(1, n, h, d)
    scale = d ** -0.5
    rep = h // hkv
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        scale=scale).transpose(1, 2)
    zero, none = torch.zeros(1, n, h, d, device=dev), torch.full((1, h, n), float("-inf"), device=dev)
    want = _reference(q, k, v, zero, none, dout, torch.zeros(1, h, n, device=dev), scale)
    o, _, gr = grads_of(sdpa, [q, k, v], dout)
    bar = dict(zip(("out", "dq", "dk", "dv"), [rel_err(o, want["out"])] + [rel_err(a, want[x]) for a, x in
                                                                            zip(gr, ("dq", "dk", "dv"))]))
    for own in ("empty", "merged"):
        out0 = zero.bfloat16() if own == "empty" else mk(1, n, h, d)
        lse0 = none.clone() if own == "empty" else torch.randn(1, h, n, device=dev, generator=gen) + 3
        ref = want if own == "empty" else _reference(q, k, v, out0, lse0, dout, torch.zeros(1, h, n, device=dev),
                                                    scale)
        out, lse, dq = out0.clone(), lse0.clone(), torch.zeros_like(q)
        few_keys.forward_into(q, k, v, out, lse, scale)
        dk, dv = few_keys.backward_into(dout, q, k, v, out, lse, None, dq, scale)
        got = dict(out=rel_err(out, ref["out"]), dq=rel_err(dq, ref["dq"]), dk=rel_err(dk, ref["dk"]),
                   dv=rel_err(dv, ref["dv"]))
        assert all(got[x] <= 2 * bar[x] for x in bar), (own, got, bar)
