"""attention_varlen against a float64 block-diagonal reference."""
import pytest
import torch

import longattn
from reference import check_op, varlen_ref

TOL = 1e-4


CASES = [
    ([5, 17, 1, 9], False, (-1, -1), 4),
    ([5, 17, 1, 9], True, (-1, -1), 2),
    ([30, 2, 0, 11], True, (4, 0), 1),
    ([12, 12], False, (3, 2), 2),
]


@pytest.mark.parametrize("lens,causal,window,hkv", CASES)
@pytest.mark.parametrize("backend", ["math", "auto", "triton"])
def test_varlen(lens, causal, window, hkv, backend):
    if backend == "triton" and not longattn.kernels_available():
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1")
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, 4, 16)
    k = torch.randn(total, hkv, 16)
    v = torch.randn(total, hkv, 16)
    do, dl = torch.randn_like(q), torch.randn(4, total)
    fn = lambda q, k, v: longattn.attention_varlen(q, k, v, cu, causal=causal, window_size=window, return_lse=True,
                                                   backend=backend)
    check_op(fn, lambda q, k, v: varlen_ref(q, k, v, cu, causal, window), [q, k, v], do, dl, TOL)


def test_varlen_bad_inputs():
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        longattn.attention_varlen(q, q, q, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="must equal"):
        longattn.attention_varlen(q, q, q, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        longattn.attention_varlen(q, q, q, torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="3 dims"):
        longattn.attention_varlen(q[None], q[None], q[None], torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen"):
        longattn.attention_varlen(q, q, q, torch.tensor([0, 10], dtype=torch.int32), max_seqlen=4)


def test_varlen_kernel_without_the_loop():
    """Under CUDA graph capture (``loop_ok=False``) the per-document loop, which
    reads cu_seqlens on the host, is never chosen: a forced dense backend and a
    call no varlen kernel takes raise ValueError with the fix."""
    from longattn.backends import varlen as _varlen

    q = torch.randn(10, 2, 8)
    assert _varlen.choose(q, "cudnn", 3) == "loop"
    with pytest.raises(ValueError, match="one call per document.*capture.*backend='auto'"):
        _varlen.choose(q, "cudnn", 3, loop_ok=False)
    with pytest.raises(ValueError, match="no varlen kernel takes this call.*capture"):
        _varlen.choose(q, "auto", 3, loop_ok=False)


def test_varlen_reads_cu_seqlens_each_call():
    """cu_seqlens is read at every call (no cache that a write outside autograd's
    version counter, e.g. a broadcast into the buffer, would leave stale), also
    for tensors made under inference mode (which have no version counter)."""
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    longattn.attention_varlen(q, q, q, cu, max_seqlen=7)
    cu.data[1] = 1  # no version bump: the longest document is now 9
    with pytest.raises(ValueError, match="max_seqlen"):
        longattn.attention_varlen(q, q, q, cu, max_seqlen=7)
    with torch.inference_mode():
        cu_inf = torch.tensor([0, 4, 10], dtype=torch.int32)
        out = longattn.attention_varlen(q, q, q, cu_inf, causal=True)
    want = torch.cat([longattn.attention(q[None, a:b], q[None, a:b], q[None, a:b], causal=True)[0]
                      for a, b in ((0, 4), (4, 10))])
    torch.testing.assert_close(out, want)
