"""The float32 lse merge against logaddexp, with rows that saw no key."""
import pytest
import torch

from longattn._merge import merge_, merge_stack


def _case():
    o, ob = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    l, lb = torch.randn(2, 5, 3) * 30, torch.randn(2, 5, 3) * 30  # large gaps: stability
    l[0, 0, 0] = float("-inf")                                      # a saw nothing
    lb[0, 0, 1] = float("-inf")                                     # b saw nothing
    l[1, 1, 1] = lb[1, 1, 1] = float("-inf")                        # neither
    o[0, 0, 0] = o[1, 1, 1] = ob[0, 0, 1] = ob[1, 1, 1] = 0.0      # empty rows carry 0
    return o, l, ob, lb


def _want(o, l, ob, lb):
    want_l = torch.logaddexp(l.double(), lb.double())
    fin = torch.isfinite(want_l)
    wa = torch.exp(l.double() - want_l).nan_to_num(0.0)[..., None]
    wb = torch.exp(lb.double() - want_l).nan_to_num(0.0)[..., None]
    want_o = torch.where(fin[..., None], o.double() * wa + ob.double() * wb, 0.0)
    return want_o, want_l, fin


def test_merge_matches_logaddexp_and_handles_empty_rows():
    o, l, ob, lb = _case()
    want_o, want_l, fin = _want(o, l, ob, lb)
    merge_(o, l, ob, lb)
    assert not torch.isnan(o).any() and not torch.isnan(l).any()
    assert torch.equal(torch.isneginf(l), ~fin)
    assert torch.allclose(l[fin].double(), want_l[fin], atol=1e-5)
    assert torch.allclose(o.double(), want_o, atol=1e-6)


def test_merge_stack_matches_pairwise_merges():
    """The c-way merge (one pass) against logaddexp in float64 and the chain of
    pairwise merges, with rows empty in some partials and in all of them."""
    c = 4
    o, l = torch.randn(c, 2, 5, 3, 4), torch.randn(c, 2, 5, 3) * 30
    l[:2, 0, 0, 0] = float("-inf")   # some partials saw nothing
    l[:, 1, 1, 1] = float("-inf")    # none saw anything
    o[:2, 0, 0, 0] = o[:, 1, 1, 1] = 0.0
    out, lse = merge_stack(o, l)
    want_l = torch.logsumexp(l.double(), 0)
    fin = torch.isfinite(want_l)
    want_o = (o.double() * torch.exp(l.double() - want_l).nan_to_num(0.0)[..., None]).sum(0)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), ~fin) and out[~fin].abs().max() == 0
    assert torch.allclose(lse[fin].double(), want_l[fin], atol=1e-5)
    assert torch.allclose(out.double(), want_o, atol=1e-6)
    po, pl = o[0].clone(), l[0].clone()
    for j in range(1, c):
        merge_(po, pl, o[j], l[j])
    assert torch.allclose(out, po, atol=1e-5) and torch.equal(torch.isneginf(pl), torch.isneginf(lse))


def test_triton_merge_on_strided_views():
    """The one-pass Triton merge (dilated attention's MHA path) on views strided
    like a dilated part of (B, S, H, D) / (B, H, S) buffers: same results."""
    from longattn.kernels import merge as kmerge

    if not kmerge.usable(torch.empty(1)):
        pytest.skip("Triton kernels unavailable here (CPU needs TRITON_INTERPRET=1)")
    o, l, ob, lb = _case()
    want_o, want_l, fin = _want(o, l, ob, lb)
    # (N, M, Hc, D) as every other row and head of a bigger buffer, lse laid out (N, Hc, M)
    big = torch.full((2, 10, 6, 4), 7.0)
    big[:, ::2, ::2] = o
    lbig = torch.full((2, 6, 10), 7.0)
    lbig[:, ::2, ::2] = l.transpose(1, 2)
    ov, lv = big[:, ::2, ::2], lbig[:, ::2, ::2].transpose(1, 2)
    kmerge.merge_into(ov, lv, ob, lb)
    assert torch.equal(torch.isneginf(lv), ~fin)
    assert torch.allclose(lv[fin].double(), want_l[fin], atol=1e-5)
    assert torch.allclose(ov.double(), want_o, atol=1e-6)
    big[:, ::2, ::2] = 7.0  # the rows and heads between were left alone
    lbig[:, ::2, ::2] = 7.0
    assert (big == 7.0).all() and (lbig == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_add_into_strided_views(dtype):
    """The fused strided add of the dilated backward: dst += src for one to
    three pairs, dst every other row and head of a bigger buffer, src in
    another layout; float32 arithmetic, one rounding; the rest untouched."""
    from longattn.kernels import merge as kmerge

    if not kmerge.usable(torch.empty(1)):
        pytest.skip("Triton kernels unavailable here (CPU needs TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    for npair in (1, 2, 3):
        bigs = [torch.full((2, 10, 6, 8), 7.0, dtype=dtype) for _ in range(npair)]
        dsts = [b[:, ::2, ::2] for b in bigs]                                       # (2, 5, 3, 8)
        srcs = [torch.randn(2, 3, 5, 8, dtype=dtype).transpose(1, 2) for _ in range(npair)]
        want = [(d.float() + s.float()).to(dtype) for d, s in zip(dsts, srcs)]
        kmerge.add_into(dsts, srcs)
        for b, d, w in zip(bigs, dsts, want):
            assert torch.equal(d, w)
            b[:, ::2, ::2] = 7.0
            assert (b == 7.0).all()


def test_triton_five_dim_merge_copy_add():
    """The 5-D (N, R, M, Hc, D) forms the gathered dilated branches use: the
    offset classes of a branch shift rows and heads together (no single
    stride), as in longattn.dilated.schedule.Unit._five. Merge, gather (copy) and add against
    torch on the same views; everything outside the views untouched."""
    from longattn.kernels import merge as kmerge

    if not kmerge.usable(torch.empty(1)):
        pytest.skip("Triton kernels unavailable here (CPU needs TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    nseg, r, w, h, d = 3, 2, 8, 4, 8
    m, hc = w // r, h // r

    def five(x):  # (S, H, D) -> (nseg, r, m, hc, D); (H, S) lse -> (nseg, r, m, hc)
        if x.dim() == 3:
            ss, sh, sd = x.stride()
            return x.as_strided((nseg, r, m, hc, d), (w * ss, ss + sh, r * ss, r * sh, sd))
        sh, ss = x.stride()
        return x.as_strided((nseg, r, m, hc), (w * ss, ss + sh, r * ss, r * sh))

    big = torch.randn(nseg * w, h, d)
    lbig = torch.randn(h, nseg * w)
    lbig[0, :5] = float("-inf")  # rows that saw no key: lse -inf, output 0
    big[:5, 0] = 0.0
    ob, lb = torch.randn(nseg, r, m, hc, d), torch.randn(nseg, r, m, hc)
    lb[0, 0, :2] = float("-inf")
    ob[0, 0, :2] = 0.0
    ov, lv = five(big), five(lbig)
    want_o, want_l = ov.clone(), lv.clone()
    merge_(want_o, want_l, ob, lb)
    keep, lkeep = big.clone(), lbig.clone()
    kmerge.merge_into(ov, lv, ob, lb)
    assert torch.allclose(ov, want_o, atol=1e-6)
    assert torch.equal(torch.isneginf(lv), torch.isneginf(want_l))
    fin = torch.isfinite(want_l)
    assert torch.allclose(lv[fin], want_l[fin], atol=1e-5)
    ov.copy_(five(keep)), lv.copy_(five(lkeep))
    assert torch.equal(big, keep) and torch.equal(lbig, lkeep)  # only the views' elements were written

    srcs = [five(torch.randn(nseg * w, h, d)) for _ in range(3)]
    dense = [torch.empty(x.shape) for x in srcs]
    kmerge.copy_into(dense, srcs)
    assert all(torch.equal(a, b) for a, b in zip(dense, srcs))
    bigs = [torch.randn(nseg * w, h, d) for _ in range(3)]
    want = [b.clone() for b in bigs]
    for x, y in zip(want, dense):
        five(x).add_(y)
    kmerge.add_into([five(b) for b in bigs], dense)
    assert all(torch.allclose(a, b) for a, b in zip(bigs, want))


def test_gradient_adds_of_gqa_views():
    """The dilated backward's fused adds when a class's kv views have fewer
    heads than its query view (GQA, rate dividing the group): dQ and dK/dV go
    in separate launches, each inside its own view; one launch of mixed
    shapes raises instead of writing out of bounds."""
    from longattn.dilated import views
    from longattn.dilated.schedule import Part
    from longattn.kernels import merge as kmerge

    if not kmerge.usable(torch.empty(1)):
        pytest.skip("Triton kernels unavailable here (CPU needs TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    dq_buf, dk_buf, dv_buf = torch.zeros(1, 12, 8, 4), torch.zeros(1, 12, 2, 4), torch.zeros(1, 12, 2, 4)
    part = Part(w=6, r=2, c=1, start=0, nseg=2, seg_len=6)  # rows 1, 3, 5 of each segment
    dsts = [part.q_view(dq_buf, 0), part.kv_view(dk_buf, 8, 0), part.kv_view(dv_buf, 8, 0)]
    assert dsts[0].shape[2] == 4 and dsts[1].shape[2] == 2  # query heads 1, 3, 5, 7; every kv head
    srcs = [torch.randn(d.shape) for d in dsts]
    with pytest.raises(ValueError, match="shape"):
        kmerge.add_into(dsts, srcs)
    views.add_grads(dsts, srcs, fused=True)
    for buf, d, s in zip((dq_buf, dk_buf, dv_buf), dsts, srcs):
        assert torch.equal(d, s)
        d.zero_()
        assert (buf == 0).all()  # nothing written outside the view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_stack_and_sum_rows_into_listed_rows(dtype):
    """The carved one-device flex call's two fused launches (longattn.flex.fa4.SplitStep):
    c partials merged by lse into listed rows of (S, H, D) / (H, S) buffers (rows no partial saw: 0 and -inf),
    and c partial gradients summed into listed rows, float32 arithmetic, one rounding; the other rows untouched.
    Against merge_stack and torch's float32 sum."""
    from longattn.kernels import merge as kmerge

    if not kmerge.usable(torch.empty(1)):
        pytest.skip("Triton kernels unavailable here (CPU needs TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    c, m, s, h, d = 3, 5, 12, 2, 8
    rows = torch.tensor([7, 0, 3, 11, 4])
    parts = torch.randn(c, m, h, d).to(dtype)
    parts_lse = torch.randn(c, h, m) * 30
    parts_lse[:2, 0, 1] = float("-inf")  # some partials saw nothing
    parts_lse[:, 1, 2] = float("-inf")   # none did
    parts[:2, 1, 0] = parts[:, 2, 1] = 0
    out, lse = torch.full((s, h, d), 7.0, dtype=dtype), torch.full((h, s), 7.0)
    kmerge.stack_into(out, lse, parts, parts_lse, rows)
    want_o, want_l = merge_stack(parts, parts_lse.transpose(1, 2))
    assert torch.equal(torch.isneginf(lse[:, rows]), torch.isneginf(want_l.t()))
    fin = torch.isfinite(want_l.t())
    assert torch.allclose(lse[:, rows][fin], want_l.t()[fin], atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out[rows].float(), want_o, rtol=tol, atol=tol)
    assert out[rows][2, 1].abs().max() == 0
    others = torch.ones(s, dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all() and (lse[:, others] == 7.0).all()
    dst = torch.full((s, h, d), 7.0, dtype=dtype)
    kmerge.sum_rows_into(dst, parts, rows)
    # one rounding of a float32 sum (the order of its adds, and the interpreter's rounding, may move the last bit)
    assert torch.allclose(dst[rows].float(), parts.sum(0, dtype=torch.float32), rtol=tol, atol=tol)
    assert (dst[others] == 7.0).all()
