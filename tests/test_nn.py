import os
import sys

import pytest
import torch

from longattn.nn import DilatedAttention, LongNetLM, MultiheadDilatedAttention
from reference import dilated_ref, rel_err


def test_dilated_module_matches_functional():
    q = torch.randn(2, 24, 4, 8)
    m = DilatedAttention([8, 24], [1, 2], causal=True)
    ref, _ = dilated_ref(q, q, q, [8, 24], [1, 2], causal=True)
    assert rel_err(m(q, q, q), ref) < 1e-4
    ref_nc, _ = dilated_ref(q, q, q, [8, 24], [1, 2])
    assert rel_err(m(q, q, q, is_causal=False), ref_nc) < 1e-4


def test_multihead_shapes_gqa_and_grad():
    m = MultiheadDilatedAttention(64, 8, [8, 16], [1, 2], num_kv_heads=2)
    assert m.k_proj.out_features == 16 and m.norm is not None
    x = torch.randn(2, 32, 64, requires_grad=True)
    out, w = m(x, x, x, is_causal=True)
    assert out.shape == x.shape and w is None
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())


@pytest.mark.parametrize("kv_heads,norm,causal", [(2, True, True), (8, False, False)])
def test_multihead_values_against_its_definition(kv_heads, norm, causal):
    """MultiheadDilatedAttention's output and every gradient (input, weights, biases, norm) against its
    definition written out: the projections split into heads (GQA: fewer key/value heads), dilated attention
    (float64 reference), heads merged, the sub-layer LayerNorm, the output projection."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    segs, rates = [8, 16], [1, 2]
    m = MultiheadDilatedAttention(64, 8, segs, rates, num_kv_heads=kv_heads, layer_norm=norm)
    x = torch.randn(2, 32, 64, requires_grad=True)
    g = torch.randn(2, 32, 64)
    out, _ = m(x, x, x, is_causal=causal)
    params = [p for p in m.parameters()]
    got = torch.autograd.grad(out, [x, *params], g)

    xd, pd = x.detach().double().requires_grad_(), [p.detach().double().requires_grad_() for p in params]
    named = dict(zip([n for n, _ in m.named_parameters()], pd))
    lin = lambda t, n: F.linear(t, named[f"{n}.weight"], named[f"{n}.bias"])
    q = lin(xd, "q_proj").view(2, 32, 8, 8)
    k, v = (lin(xd, n).view(2, 32, kv_heads, 8) for n in ("k_proj", "v_proj"))
    o, _ = dilated_ref(q, k, v, segs, rates, causal=causal)
    y = o.reshape(2, 32, 64)
    if norm:
        y = F.layer_norm(y, (64,), named["norm.weight"], named["norm.bias"], m.norm.eps)
    want_out = lin(y, "out_proj")
    want = torch.autograd.grad(want_out, [xd, *pd], g.double())
    assert rel_err(out, want_out) < 1e-4, rel_err(out, want_out)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for n, a, w in zip(names, got, want):
        if n == "k_proj.bias":  # adds q.b to a row's every score: softmax ignores it, its gradient is 0 up to roundings
            assert a.norm() < 1e-5 * got[names.index("q_proj.bias")].norm(), (n, a.norm())
            continue
        assert rel_err(a, w) < 1e-4, (n, rel_err(a, w))


def test_multihead_is_causal_really_causal():
    m = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2])
    x = torch.randn(1, 16, 32)
    y = x.clone()
    y[:, 10:] = torch.randn(1, 6, 32)  # change the future only
    a, _ = m(x, x, x, is_causal=True)
    b, _ = m(y, y, y, is_causal=True)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)


def test_multihead_rejects_dropout_and_bad_args():
    with pytest.raises(ValueError, match="dropout"):
        MultiheadDilatedAttention(32, 4, [8], [1], dropout=0.1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadDilatedAttention(32, 4, [8], [1], num_kv_heads=3)
    with pytest.raises(ValueError, match="same length"):
        MultiheadDilatedAttention(32, 4, [8, 16], [1])
    m = MultiheadDilatedAttention(32, 4, [8], [1])
    with pytest.raises(ValueError, match="need_weights"):
        m(torch.randn(1, 8, 32), torch.randn(1, 8, 32), torch.randn(1, 8, 32), need_weights=True)
    with pytest.raises(ValueError, match="query"):
        m(torch.randn(1, 8, 16), torch.randn(1, 8, 32), torch.randn(1, 8, 32))


def test_gamma_init_scales_value_and_out():
    torch.manual_seed(0)
    a = MultiheadDilatedAttention(256, 4, [8], [1], gamma_init=1.0)
    torch.manual_seed(0)
    b = MultiheadDilatedAttention(256, 4, [8], [1], gamma_init=0.5)
    ratio = b.v_proj.weight.std() / a.v_proj.weight.std()
    assert abs(ratio - 0.5) < 0.02
    assert abs(b.q_proj.weight.std() / a.q_proj.weight.std() - 1.0) < 0.02


def test_longnet_lm_learns():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import train_longnet

    hist = train_longnet.main(["--steps", "60", "--seqlen", "64", "--batch", "4", "--dim", "64", "--depth", "1",
                               "--log-every", "1000"])
    first, last = sum(hist[:5]) / 5, sum(hist[-5:]) / 5
    assert last < first - 1.0, (first, last)


def test_longnet_lm_rejects_long_input():
    m = LongNetLM(10, dim=32, depth=1, num_heads=2, segment_lengths=[8], dilation_rates=[1], max_seqlen=16)
    with pytest.raises(ValueError, match="max_seqlen"):
        m(torch.zeros(1, 32, dtype=torch.long))


def test_multihead_self_attention_defaults_key_value_to_query():
    m = MultiheadDilatedAttention(32, 4, [8, 16], [1, 2], num_kv_heads=2)
    x, y = torch.randn(1, 16, 32), torch.randn(1, 16, 32)
    assert torch.equal(m(x, is_causal=True)[0], m(x, x, x, is_causal=True)[0])
    assert torch.equal(m(x, y)[0], m(x, y, y)[0])  # value defaults to key
    assert not torch.allclose(m(x, y)[0], m(x)[0])


def test_longnet_lm_rejects_out_of_range_token_ids():
    m = LongNetLM(10, dim=32, depth=1, num_heads=2, segment_lengths=[8], dilation_rates=[1], max_seqlen=16)
    with pytest.raises(ValueError, match="vocab_size=10"):
        m(torch.tensor([[1, 2, 10]]))
    with pytest.raises(ValueError, match="vocab_size"):
        m(torch.tensor([[-1, 2, 3]]))
    with pytest.raises(TypeError, match="integer"):
        m(torch.zeros(1, 4))
    logits, _ = m(torch.tensor([[0, 9]]))
    assert logits.shape == (1, 2, 10)
