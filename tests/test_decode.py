"""Decoding with a KV cache on one device against float64 references over the
whole context: decode_attention (dense, GQA, rows of different lengths, one
and several queries, soft-capping and sinks), KVCache.attend with chunks and
sliding windows, dilated_decode_attention (the last rows of causal
dilated attention), KVCache step by step, the placement bookkeeping, what a
dilated cache must keep, LongNetLM.generate against recomputing the forward,
and bad inputs."""
import dataclasses
import itertools

import pytest
import torch

import longattn
from longattn import backends as bk
from longattn.distributed.cache import CacheLayout, prefill_pieces
from longattn.decode import dilated_read_start
from reference import assert_close, attention_ref, dilated_ref, masked_attention
from test_fa4 import _Api, _MathInterface, fa4  # noqa: F401 - fa4: the FA4 GPU tests' fixture

TOL = 1e-4
I32 = torch.int32


def _dense_ref(q, k, v, n, causal=True):
    """One row: q (1, Lq, H, D) over its first n keys."""
    if n == 0:
        return torch.zeros(q.shape, dtype=torch.float64), torch.full((1, q.shape[2], q.shape[1]), float("-inf"),
                                                                     dtype=torch.float64)
    return attention_ref(q, k[:, :n], v[:, :n], causal=causal)


def _dilated_ref(q, k, v, n, segs, rates, seed=0):
    """The last Lq rows of causal dilated attention over one row's n tokens
    (the earlier queries are arbitrary: they do not change the last rows)."""
    lq = q.shape[1]
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(1, n, q.shape[2], q.shape[3], generator=g)
    full[:, n - lq:] = q
    out, lse = dilated_ref(full, k[:, :n], v[:, :n], segs, rates, causal=True)
    return out[:, n - lq:], lse[:, :, n - lq:]


def _rows(fn_got, fn_ref, lens, tag):
    out, lse = fn_got
    for b, n in enumerate(lens):
        ro, rl = fn_ref(b, n)
        assert_close(dict(out=out[b:b + 1], lse=lse[b:b + 1]), dict(out=ro, lse=rl), TOL, f"{tag} row {b} n={n}")


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_decode_attention_matches_reference(h, hkv):
    torch.manual_seed(1)
    b, cap, d = 3, 24, 8
    k, v = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    for lq, causal, lens in ((1, True, [17, 5, 24]), (3, True, [3, 20, 9]), (2, False, [0, 11, 11])):
        q = torch.randn(b, lq, h, d)
        got = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), causal=causal,
                                        return_lse=True)
        _rows(got, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, causal), lens,
              f"h={h}/{hkv} lq={lq} causal={causal}")
    # equal lengths: one call for the batch, scale given
    q = torch.randn(b, 1, h, d)
    out = longattn.decode_attention(q, k, v, cache_seqlens=torch.full((b,), 13, dtype=I32), softmax_scale=0.3)
    ref, _ = attention_ref(q, k[:, :13], v[:, :13], causal=True, scale=0.3)
    assert_close(dict(out=out), dict(out=ref), TOL, "equal lengths")


def bounded_ref(q, k, v, n, chunk=None, left=-1, softcap=0.0, sinks=None, scale=None):
    """One row: the last Lq queries of n tokens, causal, each query at p seeing
    keys from its chunk's start ``p - p % chunk`` and ``p - left`` on."""
    lq = q.shape[1]
    pos_q, pos_k = torch.arange(n - lq, n)[:, None], torch.arange(n)[None, :]
    m = pos_k <= pos_q
    if chunk is not None:
        m &= pos_k >= pos_q - pos_q % chunk
    if left >= 0:
        m &= pos_k >= pos_q - left
    return masked_attention(q, k[:, :n], v[:, :n], m, q.shape[-1] ** -0.5 if scale is None else scale, softcap,
                            sinks)


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_decode_softcap_sinks_match_reference(backend):
    """decode_attention with soft-capping and sinks (GQA, ragged rows, one and
    several queries, a row with no key: 0 and the sink's lse)."""
    torch.manual_seed(11)
    b, cap, h, hkv, d = 3, 20, 4, 2, 8
    k, v = torch.randn(b, cap, hkv, d) * 2, torch.randn(b, cap, hkv, d)
    sinks = torch.linspace(-1.0, 2.0, h)
    for lq, causal, lens, softcap, sk in ((1, True, [17, 5, 20], 1.5, sinks), (3, True, [3, 20, 9], 2.0, None),
                                          (2, False, [0, 11, 11], 0.0, sinks), (2, False, [0, 7, 4], 1.0, sinks)):
        q = torch.randn(b, lq, h, d) * 2
        got = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), causal=causal,
                                        return_lse=True, softcap=softcap, sinks=sk, backend=backend)
        _rows(got, lambda i, n: attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal,
                                              softcap=softcap, sinks=sk), lens, f"lq={lq} softcap={softcap}")
        if lens[0] == 0 and sk is not None:  # no key: 0 and the sink
            assert torch.equal(got[0][0], torch.zeros_like(got[0][0])) and torch.equal(got[1][0, :, 0], sk)
    # the soft-cap bites: without it the result differs
    q = torch.randn(b, 1, h, d) * 2
    lens = torch.full((b,), 13, dtype=I32)
    a = longattn.decode_attention(q, k, v, cache_seqlens=lens, softcap=1.0)
    assert not torch.allclose(a, longattn.decode_attention(q, k, v, cache_seqlens=lens), atol=1e-3)


def test_kv_cache_chunks_windows_softcap_sinks():
    """KVCache.attend with chunk_size and window_size (Llama 4's chunks, a
    sliding window), soft-capping and sinks, on a right-padded cache, step by
    step with one and several queries (across chunk edges): against the
    float64 reference over each row's whole context."""
    torch.manual_seed(12)
    b, s, h, hkv, d = 2, 12, 4, 2, 8
    lens = [12, 7]
    k, v = torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    cache = longattn.KVCache.from_prefill(k, v, seqlens=lens)
    full = [[k[i:i + 1, :n], v[i:i + 1, :n]] for i, n in enumerate(lens)]
    sinks = torch.linspace(-1.0, 2.0, h)
    for step, n_new in enumerate((1, 3, 1, 2, 5)):
        kn, vn, q = torch.randn(b, n_new, hkv, d), torch.randn(b, n_new, hkv, d), torch.randn(b, n_new, h, d)
        cache.append(kn, vn)
        for i in range(b):
            full[i] = [torch.cat([full[i][0], kn[i:i + 1]], 1), torch.cat([full[i][1], vn[i:i + 1]], 1)]
        now = cache.seqlens.tolist()
        for kw in (dict(chunk_size=4), dict(chunk_size=3, softcap=1.0, sinks=sinks), dict(window_size=(3, 0)),
                   dict(window_size=(2, -1), chunk_size=5, sinks=sinks), dict(softcap=1.5, sinks=sinks)):
            chunk, left = kw.get("chunk_size"), kw.get("window_size", (-1, -1))[0]
            _rows(cache.attend(q, return_lse=True, **kw),
                  lambda i, n: bounded_ref(q[i:i + 1], *full[i], n, chunk, left, kw.get("softcap", 0.0),
                                           kw.get("sinks")), now, f"step {step} {kw}")


def test_bounded_calls_group_queries():
    """Consecutive queries become one block call: the same keys, causal, or
    causal with a window; an empty range stands alone."""
    from longattn.decode.bounded import _calls

    assert _calls([(0, 5), (0, 5)]) == [(0, 2, 0, 5, "all")]
    assert _calls([(0, 5), (0, 6), (0, 7), (7, 8)]) == [(0, 3, 0, 7, "causal"), (3, 4, 7, 8, "all")]
    assert _calls([(2, 5), (3, 6), (4, 7)]) == [(0, 3, 2, 7, "window")]
    assert _calls([(3, 3), (3, 4)]) == [(0, 1, 3, 3, "all"), (1, 2, 3, 4, "all")]


triton_ok = pytest.mark.skipif(not longattn.kernels_available(),
                               reason="Triton kernels run on CPU only under TRITON_INTERPRET=1")


@triton_ok
@pytest.mark.parametrize("h,hkv,lq", [(4, 4, 1), (8, 2, 1), (6, 1, 3), (4, 2, 2)])
def test_split_kv_kernel_matches_reference(h, hkv, lq):
    """The split-KV decode kernel (backend="triton"): rows of different
    lengths in one launch (lengths on the host and as a tensor), equal lengths,
    several splits per row, causal and not, an empty row, a strided cache, a
    head-major one."""
    from longattn.kernels import decode as kdec
    from longattn.decode.engine import dense_engine

    torch.manual_seed(2)
    b, cap, d = 3, 80, 16
    big_k, big_v = torch.randn(b, cap, hkv + 1, d), torch.randn(b, cap, hkv + 1, d)
    k, v = big_k[:, :, 1:], big_v[:, :, 1:]  # views: the kernel reads strides, never copies
    q = torch.randn(b, lq, h, d)
    assert dense_engine(q, k, v, "triton", False) == "split_kv"
    assert dense_engine(q, k, v, "auto", True) == "backend"  # CPU: flash
    # a KVCache step on CPU is never replayed from a graph; a backend other than auto/triton never takes the kernel
    assert dense_engine(q, k, v, "triton", False, graph_steps=True) == "split_kv"
    assert dense_engine(q, k, v, "flash", True) == dense_engine(q, k, v, "auto", True, graph_steps=True) == "backend"
    # the kernel does not soft-cap: such a call runs a backend that does, on views of the cache
    assert dense_engine(q, k, v, "triton", False, graph_steps=True, softcap=1.0) == "backend"
    for causal, lens in ((True, [77, lq, 40]), (False, [0, 33, 80]), (True, [50, 50, 50])):
        got = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), causal=causal,
                                        return_lse=True, backend="triton")
        _rows(got, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, causal), lens,
              f"triton h={h}/{hkv} lq={lq} causal={causal}")
        # many splits (16 tokens each) and lengths passed as a tensor
        for heads_first in (False, True):  # either launch order (DecodeTuning.heads_fastest)
            many = kdec.decode(q, k, v, lens, causal and lq > 1, d ** -0.5, block_n=16, num_warps=1, num_stages=1,
                               programs_per_sm=64, min_split=16, lens_tensor=torch.tensor(lens, dtype=I32),
                               heads_fastest=heads_first)
            assert kdec.splits(max(lens), b * hkv, q.device, 64, 16, 16)[1] > 1
            _rows(many, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, causal), lens,
                  f"triton splits h={h}/{hkv} lq={lq} causal={causal} heads first={heads_first}")
        # lengths known on the device only (a captured step): a launch sized for the capacity, the lengths a
        # strided view, one past the capacity (clamped)
        big = torch.tensor([[n, -5] for n in lens], dtype=I32)
        dev_only = kdec.decode(q, k, v, None, causal and lq > 1, d ** -0.5, block_n=16, num_warps=1, num_stages=1,
                               programs_per_sm=64, min_split=16, lens_tensor=big[:, 0])
        _rows(dev_only, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, causal), lens,
              f"triton device lengths h={h}/{hkv} lq={lq} causal={causal}")
    # a cache stored head-major (B, Hkv, S, D), as SDPA's, read through (B, S, Hkv, D) views
    kh, vh = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    lens = [77, lq, 40]
    got = longattn.decode_attention(q, kh, vh, cache_seqlens=torch.tensor(lens, dtype=I32), causal=True,
                                    return_lse=True, backend="triton")
    _rows(got, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, True), lens,
          f"triton head-major cache h={h}/{hkv} lq={lq}")
    over = kdec.decode(q, k, v, None, False, d ** -0.5, block_n=16, num_warps=1, num_stages=1, programs_per_sm=4,
                       min_split=16, lens_tensor=torch.tensor([cap + 7, 3, cap], dtype=I32))
    _rows(over, lambda i, n: _dense_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, False), [cap, 3, cap],
          "lengths past the capacity read the capacity")


@triton_ok
@pytest.mark.parametrize("lq,h,hkv", [(1, 4, 2), (3, 6, 2)])
def test_split_kv_descriptor_loads(lq, h, hkv):
    """K and V read through tensor descriptors (``descriptors=True``,
    ``DecodeTuning.descriptor_loads``) give the float64 reference's out and
    lse as the pointer loads do: splits ending inside a tile, ragged rows, an
    empty row, lengths on the device, past the capacity (clamped), the
    unwritten slots after each row's length holding NaN (never read into a
    result), a capacity that ends inside a tile (the descriptor's zeros past
    it), token-major and head-major caches, int64 lengths on the device;
    caches TMA cannot address (a head dim that is not a power of two, strides
    off 16 bytes, an empty cache) fall back to pointers."""
    from longattn.kernels import decode as kdec

    torch.manual_seed(7)
    b, cap, d = 3, 77, 16  # 77: the last tile of 16 keys ends past the capacity
    kw = dict(block_n=16, num_warps=1, num_stages=1, programs_per_sm=64, min_split=16, descriptors=True)
    k, v, q = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d), torch.randn(b, lq, h, d)
    lens = [77, lq, 0]
    ref = lambda kk, vv, causal: (lambda i, n: _dense_ref(q[i:i + 1], kk[i:i + 1], vv[i:i + 1], n, causal))
    kn, vn = k.clone(), v.clone()
    for i, n in enumerate(lens):  # what no row may read: NaN past its length
        kn[i, n:], vn[i, n:] = float("nan"), float("nan")
    for causal in (True, False):
        for kk, vv, what in ((kn, vn, "token-major"),
                             tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (kn, vn)) + ("head-major",)):
            assert kdec.descriptor_refusals(kk, vv) == []
            got = kdec.decode(q, kk, vv, lens, causal and lq > 1, d ** -0.5, **kw)
            _rows(got, ref(k, v, causal), lens, f"descriptors {what} lq={lq} causal={causal}")
            dev = kdec.decode(q, kk, vv, None, causal and lq > 1, d ** -0.5,
                              lens_tensor=torch.tensor(lens, dtype=I32), **kw)
            _rows(dev, ref(k, v, causal), lens, f"descriptors device lengths {what} lq={lq} causal={causal}")
    over = kdec.decode(q, k, v, None, False, d ** -0.5, lens_tensor=torch.tensor([cap + 9, 5, cap], dtype=I32), **kw)
    _rows(over, ref(k, v, False), [cap, 5, cap], "descriptors, lengths past the capacity")
    wide = kdec.decode(q, kn, vn, None, True, d ** -0.5, lens_tensor=torch.tensor(lens, dtype=torch.int64), **kw)
    _rows(wide, ref(k, v, True), lens, "descriptors, int64 lengths")
    empty = torch.zeros(b, 0, hkv, d)
    assert any("empty" in r for r in kdec.descriptor_refusals(empty, empty))
    got = kdec.decode(q, empty, empty, [0] * b, False, d ** -0.5, **kw)
    _rows(got, ref(empty, empty, False), [0] * b, "descriptors, an empty cache")
    # caches the descriptors cannot address: pointer loads, same results
    k24, v24, q24 = torch.randn(b, cap, hkv, 24), torch.randn(b, cap, hkv, 24), torch.randn(b, lq, h, 24)
    assert any("power of two" in r for r in kdec.descriptor_refusals(k24, v24))
    got = kdec.decode(q24, k24, v24, lens, False, 24 ** -0.5, **kw)
    _rows(got, lambda i, n: _dense_ref(q24[i:i + 1], k24[i:i + 1], v24[i:i + 1], n, False), lens, "head dim 24")
    odd_k = torch.randn(b, cap, hkv * d + 1)[..., 1:].view(b, cap, hkv, d)  # base and token stride 4 bytes off
    assert any("16-byte" in r for r in kdec.descriptor_refusals(odd_k, v))
    got = kdec.decode(q, odd_k, v, lens, False, d ** -0.5, **kw)
    _rows(got, ref(odd_k, v, False), lens, "strides off 16 bytes")


@triton_ok
def test_split_kv_one_launch_calls_in_a_row_leave_the_counters_zero():
    """The split programs' last arrival merges its (batch row, kv head) in the
    same launch: calls in a row (batch sizes, kv heads, one and several
    queries, equal and ragged lengths, lengths on the host, as a tensor and on
    the device only, a row with no key, one split, splits merged over several
    chunks, a batch past the counter workspace, which grows) each equal the
    float64 reference, and each leaves every counter buffer zero (the next
    call, or a CUDA graph's replay, starts clean with no fill)."""
    from longattn.kernels import decode as kdec

    torch.manual_seed(5)
    d, cap = 16, 80
    scale = d ** -0.5
    calls = [  # (b, h, hkv, lq, causal, lens, how, programs_per_sm, min_split, splits)
        (3, 4, 2, 1, True, [80, 0, 37], "host", 64, 16, 5),  # ragged, a row with no key, 3 chunks of 2 splits
        (3, 4, 2, 1, True, [64, 64, 64], "host", 1, 64, 1),  # equal lengths
        (2, 6, 2, 3, True, [50, 3], "tensor", 64, 16, 4),
        (1, 4, 4, 2, False, [0], "tensor", 64, 16, 1),  # no key anywhere
        (2, 8, 2, 1, True, [17, 80], "device", 64, 16, 5),  # launch sized for the capacity
        (3, 4, 2, 1, True, [30, 0, 64], "host", 1, 64, 1),  # ragged
        (9, 8, 8, 1, True, [5 * i for i in range(9)], "host", 64, 16, 3),  # 72 pairs: past the first workspace
        (3, 4, 2, 1, True, [80, 0, 37], "host", 64, 16, 5),  # the first call again, on the grown workspace
    ]
    for i, (b, h, hkv, lq, causal, lens, how, pps, min_split, want) in enumerate(calls):
        k, v, q = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d), torch.randn(b, lq, h, d)
        lt = torch.tensor(lens, dtype=I32)
        got = kdec.decode(q, k, v, None if how == "device" else lens, causal and lq > 1, scale, block_n=16,
                          num_warps=1, num_stages=1, programs_per_sm=pps, min_split=min_split,
                          lens_tensor=None if how == "host" else lt)
        nsplit = kdec.splits(cap if how == "device" else max(lens), b * hkv, q.device, pps, 16, min_split)[1]
        assert nsplit == want, (i, nsplit)
        _rows(got, lambda j, n: _dense_ref(q[j:j + 1], k[j:j + 1], v[j:j + 1], n, causal), lens,
              f"call {i} ({how}, {nsplit} splits)")
        held = kdec._COUNTERS[q.device]
        assert kdec.counters(b * hkv, q) is held[-1] and held[-1].numel() >= b * hkv
        assert all(not c.any() for c in held), f"call {i}: a counter left set"
    assert len(held) >= 2, "the 72-pair call grew the workspace; the outgrown buffer stays alive"


@triton_ok
def test_split_kv_launch_advances_the_device_lengths():
    """``advance``: a launch over lengths kept on the device counts the tokens
    appended since they were written and leaves them advanced (the last of a
    row's kv-head merges writes them), with every counter back at zero:
    repeated launches walk the rows forward as a captured step's replays do.
    Without lengths on the device it is refused."""
    from longattn.kernels import decode as kdec

    torch.manual_seed(6)
    b, cap, h, hkv, d = 3, 80, 4, 2, 16
    k, v = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    lens = torch.tensor([40, 0, 61], dtype=I32)
    kw = dict(block_n=16, num_warps=1, num_stages=1, programs_per_sm=64, min_split=16)
    for step in range(3):
        q = torch.randn(b, 1, h, d)
        want = [n + 1 for n in lens.tolist()]
        got = kdec.decode(q, k, v, None, False, d ** -0.5, lens_tensor=lens, advance=1, **kw)
        assert lens.tolist() == want, step
        _rows(got, lambda j, n: _dense_ref(q[j:j + 1], k[j:j + 1], v[j:j + 1], n, False), want, f"step {step}")
        assert all(not c.any() for c in kdec._COUNTERS[q.device]), f"step {step}: a counter left set"
    with pytest.raises(ValueError, match="lens_tensor"):
        kdec.decode(q, k, v, [4, 4, 4], False, d ** -0.5, advance=1, **kw)
    with pytest.raises(ValueError, match="its own per batch row"):  # one element read by every row: advanced 3 times
        kdec.decode(q, k, v, None, False, d ** -0.5, lens_tensor=torch.tensor([9], dtype=I32).expand(b), advance=1,
                    **kw)


# (segments, rates, heads, kv heads): GQA whose rates and group size divide each
# other both ways, and one where they do not (group 3, rate 2); a segment longer
# than the context; a repeated branch (its keys count twice)
DILATED = [([4, 8, 16], [1, 2, 4], 4, 2), ([6, 12, 64], [1, 2, 3], 6, 2), ([4, 8], [2, 4], 8, 2),
           ([5, 5, 10], [1, 1, 2], 4, 4)]


@pytest.mark.parametrize("segs,rates,h,hkv", DILATED)
def test_dilated_decode_is_the_last_rows_of_dilated_attention(segs, rates, h, hkv):
    torch.manual_seed(2)
    b, cap, d = 3, 30, 8
    k, v = torch.randn(b, cap, hkv, d), torch.randn(b, cap, hkv, d)
    for lq, lens in ((1, [29, 8, 17]), (3, [12, 30, 5])):
        q = torch.randn(b, lq, h, d)
        got = longattn.dilated_decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32),
                                                segment_lengths=segs, dilation_rates=rates, return_lse=True)
        _rows(got, lambda i, n: _dilated_ref(q[i:i + 1], k[i:i + 1], v[i:i + 1], n, segs, rates), lens,
              f"{segs}/{rates} h={h}/{hkv} lq={lq}")


def test_dilated_cache_needs_only_the_current_segments():
    """Keys before dilated_read_start are never read: poisoning them changes nothing."""
    torch.manual_seed(3)
    segs, rates = [4, 8, 16], [1, 2, 4]
    k, v = torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8)
    q = torch.randn(1, 1, 4, 8)
    n = 37
    start = dilated_read_start(n - 1, segs)
    assert start == 32
    want = longattn.dilated_decode_attention(q, k, v, cache_seqlens=torch.tensor([n], dtype=I32),
                                             segment_lengths=segs, dilation_rates=rates)
    k[:, :start], v[:, :start] = float("nan"), float("nan")
    got = longattn.dilated_decode_attention(q, k, v, cache_seqlens=torch.tensor([n], dtype=I32),
                                            segment_lengths=segs, dilation_rates=rates)
    assert torch.equal(got, want)


def test_kv_cache_steps_match_full_context():
    """A right-padded prompt through KVCache.from_prefill, then decoding steps
    (one token, then two at once, then one): after every append, dense and
    dilated attention of the new queries equal the float64 reference over the
    row's whole context."""
    torch.manual_seed(4)
    b, s, h, hkv, d = 2, 12, 4, 2, 8
    segs, rates = [4, 8], [1, 2]
    lens = [12, 7]
    k, v = torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d)
    cache = longattn.KVCache.from_prefill(k, v, seqlens=lens, reserve=2)
    assert cache.seqlens.tolist() == lens and cache.capacity == 14
    full_k = [k[i:i + 1, :n] for i, n in enumerate(lens)]
    full_v = [v[i:i + 1, :n] for i, n in enumerate(lens)]
    for step, n_new in enumerate((1, 2, 1, 1)):  # the third step outgrows the reserve: the cache grows
        kn, vn, q = torch.randn(b, n_new, hkv, d), torch.randn(b, n_new, hkv, d), torch.randn(b, n_new, h, d)
        cache.append(kn, vn)
        for i in range(b):
            full_k[i] = torch.cat([full_k[i], kn[i:i + 1]], 1)
            full_v[i] = torch.cat([full_v[i], vn[i:i + 1]], 1)
        now = cache.seqlens.tolist()
        _rows(cache.attend(q, return_lse=True),
              lambda i, n: _dense_ref(q[i:i + 1], full_k[i], full_v[i], n), now, f"dense step {step}")
        _rows(cache.attend(q, segment_lengths=segs, dilation_rates=rates, return_lse=True),
              lambda i, n: _dilated_ref(q[i:i + 1], full_k[i], full_v[i], n, segs, rates), now, f"dilated step {step}")
    assert cache.capacity >= 17


@pytest.mark.parametrize("seqlens", [[40, 23], [40, 40]])
def test_kv_cache_attend_with_the_new_tokens(seqlens):
    """attend(q, k_new=, v_new=) is append then attend in one call: equal
    results and caches, dense (a step, return_lse), dilated and windowed,
    rows of different lengths and of one (whose copies the step makes); a
    call that fails its checks keeps the append (as two calls would); k_new
    alone is refused."""
    torch.manual_seed(8)
    b, n, h, hkv, d = 2, 40, 4, 2, 16
    k, v = torch.randn(b, n, hkv, d), torch.randn(b, n, hkv, d)
    apart = longattn.KVCache.from_prefill(k, v, seqlens=seqlens, reserve=2)
    fused = longattn.KVCache.from_prefill(k, v, seqlens=seqlens, reserve=2)
    calls = [dict(), dict(return_lse=True), dict(segment_lengths=[8, 16], dilation_rates=[1, 2]),
             dict(window_size=(5, 0)), dict(return_lse=True)]  # the cache grows at the third call
    for i, kw in enumerate(calls):
        lq = 2 if i == 1 else 1
        kn, vn, q = torch.randn(b, lq, hkv, d), torch.randn(b, lq, hkv, d), torch.randn(b, lq, h, d)
        apart.append(kn, vn)
        want = apart.attend(q, **kw)
        got = fused.attend(q, k_new=kn, v_new=vn, **kw)
        want, got = (x if isinstance(x, tuple) else (x,) for x in (want, got))
        assert all(torch.allclose(a_, g_, atol=1e-6) for a_, g_ in zip(want, got)), (i, kw)
        if not kw or kw == dict(return_lse=True):  # dense: the float64 reference over each row's whole context
            out, lse = fused.attend(q, return_lse=True)
            _rows((out, lse), lambda j, m: _dense_ref(q[j:j + 1], fused.k[j:j + 1], fused.v[j:j + 1], m),
                  fused.layout.local[0], f"call {i}")
        assert fused.layout.seqlens == apart.layout.seqlens and fused._deferred is None
        for row, m in enumerate(fused.layout.local[0]):
            assert torch.equal(fused.k[row, :m], apart.k[row, :m]) and torch.equal(fused.v[row, :m], apart.v[row, :m])
    kn, vn = torch.randn(b, 1, hkv, d), torch.randn(b, 1, hkv, d)
    with pytest.raises(ValueError, match="softmax_scale"):
        fused.attend(torch.randn(b, 1, h, d), k_new=kn, v_new=vn, softmax_scale=-1.0)
    apart.append(kn, vn)
    assert fused.layout.seqlens == apart.layout.seqlens
    m = fused.layout.local[0][0]
    assert torch.equal(fused.k[0, m - 1], kn[0, 0]) and torch.equal(fused.v[1, fused.layout.local[0][1] - 1], vn[1, 0])
    with pytest.raises(ValueError, match="k_new and v_new go together"):
        fused.attend(torch.randn(b, 1, h, d), k_new=kn)
    with pytest.raises(ValueError, match="nheads_kv"):  # the append's own checks, before anything is stored
        fused.attend(torch.randn(b, 1, h, d), k_new=torch.randn(b, 1, hkv + 1, d), v_new=torch.randn(b, 1, hkv + 1, d))
    assert fused.layout.seqlens == apart.layout.seqlens


def test_cache_layout_placement():
    # pieces: contiguous and zigzag, divisible or not
    assert prefill_pieces("contiguous", 1, 3, 12) == [(4, 4)]
    assert prefill_pieces("zigzag", 0, 2, 8) == [(0, 2), (6, 2)]
    pieces = sorted(p for r in range(3) for p in prefill_pieces("zigzag", r, 3, 13))
    assert [g for g, _ in pieces] == [0, 2, 4, 6, 8, 10] and sum(n for _, n in pieces) == 13
    # a right-padded zigzag prefill keeps real tokens only, in slot order
    lay = CacheLayout.from_prefill([8, 3], 8, layout="zigzag", world=2, block=2)
    assert lay.runs[0] == [[(0, 0, 2), (6, 2, 2)], [(0, 0, 2)]]
    assert lay.runs[1] == [[(2, 0, 2), (4, 2, 2)], [(2, 0, 1)]]
    assert lay.local == [[4, 2], [4, 1]]
    # appends: blocks of 2 tokens, each to the emptiest rank; runs extend within a block
    owners = [lay.place(1) for _ in range(6)]
    assert owners == [1, 1, 0, 0, 1, 1]
    assert lay.runs[1][0][-2:] == [(8, 4, 2), (12, 6, 2)] and lay.seqlens == [14, 9]
    for r in range(2):
        for row in range(2):
            pos = lay.positions(r, row)
            assert pos == sorted(pos) and len(pos) == lay.local[r][row]
    assert sorted(lay.positions(0, 0) + lay.positions(1, 0)) == list(range(14))
    assert sorted(lay.positions(0, 1) + lay.positions(1, 1)) == list(range(9))  # padding never stored
    # several tokens at once go to one rank; a call larger than the block starts one of its size
    assert lay.place(3) == 0 and lay.last_count == 3 and lay.last_owner == 0


def test_longnet_generate_matches_recomputing_forward():
    """Greedy tokens from the cache (dilated, GQA, right-padded batch) equal the
    argmax of forward() on the growing sequence; a dense model (one full
    branch) decodes with the dense path."""
    from longattn.nn import LongNetLM

    for segs, rates in (((4, 8, 16), (1, 2, 4)), ((64,), (1,))):
        torch.manual_seed(5)
        model = LongNetLM(50, dim=32, depth=2, num_heads=4, segment_lengths=segs, dilation_rates=rates,
                          num_kv_heads=2, max_seqlen=64).eval()
        toks = torch.randint(0, 50, (2, 16))
        lens = [16, 11]
        got = model.generate(toks, 6, seqlens=lens)
        for i, n in enumerate(lens):
            seq = toks[i:i + 1, :n]
            for _ in range(6):
                seq = torch.cat([seq, model(seq)[0][:, -1:].argmax(-1)], 1)
            assert got[i].tolist() == seq[0, n:].tolist(), (segs, i)


def test_bad_inputs_raise():
    q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 10, 2, 8)
    ok = torch.tensor([4, 5], dtype=I32)
    call = lambda **kw: longattn.decode_attention(**{**dict(q=q, k_cache=k, v_cache=k, cache_seqlens=ok), **kw})
    with pytest.raises(ValueError, match="int32"):
        call(cache_seqlens=ok.long())
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.Tensor"):
        call(cache_seqlens=[4, 5])
    with pytest.raises(ValueError, match=r"\[0, 10\]"):
        call(cache_seqlens=torch.tensor([4, 11], dtype=I32))
    with pytest.raises(ValueError, match="at least q_len"):
        call(q=torch.randn(2, 5, 4, 8))
    with pytest.raises(ValueError, match="multiple of nheads"):
        call(q=torch.randn(2, 1, 3, 8))
    with pytest.raises(ValueError, match="same shape"):
        call(v_cache=torch.randn(2, 9, 2, 8))
    with pytest.raises(TypeError, match="share a dtype"):
        call(v_cache=k.double())
    with pytest.raises(ValueError, match="segment_lengths"):
        longattn.dilated_decode_attention(q, k, k, cache_seqlens=ok, segment_lengths=[4, 8], dilation_rates=[1])
    with pytest.raises(ValueError, match="backend='cudnn' cannot run this call"):  # on CPU; every branch has one key
        longattn.dilated_decode_attention(q, k, k, cache_seqlens=torch.tensor([1, 1], dtype=I32), segment_lengths=[4],
                                          dilation_rates=[1], backend="cudnn")
    cache = longattn.KVCache.from_prefill(k, k)
    with pytest.raises(ValueError, match="append their keys"):
        cache.attend(q)
    with pytest.raises(ValueError, match="nheads_kv=2"):
        cache.append(torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8))
    cache.append(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8))
    with pytest.raises(ValueError, match="q_len \\(2\\) exceeds"):
        cache.attend(torch.randn(2, 2, 4, 8))
    with pytest.raises(ValueError, match="seqlens must hold"):
        longattn.KVCache.from_prefill(k, k, seqlens=[3, 11])
    assert cache.attend(q).shape == q.shape
    cache.attend(q, return_lse=True)
    with pytest.raises(TypeError):  # a step like the last skips its checks, but 1 is not True
        cache.attend(q, return_lse=1)
    # soft-capping, sinks, chunks and windows
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        call(softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(4,\)"):
        call(sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="does not soft-cap|softcap"):
        call(softcap=1.0, backend="triton")  # the split-KV kernel and triton's dense kernel do not soft-cap
    with pytest.raises(ValueError, match="sinks must hold one logit"):
        cache.attend(q, sinks=torch.zeros(4, 1))
    cache.attend(q, sinks=torch.zeros(4))  # a step like the last but for its sinks is checked again
    with pytest.raises(ValueError, match="softcap must be"):
        cache.attend(q, softcap=float("inf"))
    with pytest.raises(ValueError, match="chunk_size must be None"):
        cache.attend(q, chunk_size=0)
    with pytest.raises(ValueError, match="window_size"):
        cache.attend(q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="dilated decoding .* takes no softcap"):
        cache.attend(q, segment_lengths=[4], dilation_rates=[1], chunk_size=4)


def test_bench_decode_tiny(tmp_path):
    """python -m longattn.bench decode: dense and dilated rows with
    measured prefill, per-token latency and tokens/s, the JSON with its env."""
    import json

    from longattn.bench.__main__ import main

    path = tmp_path / "decode.json"
    main(["decode", "--context", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--warmup", "1",
          "--iters", "2", "--layers", "2", "--segment-lengths", "16", "32", "--dilation-rates", "1", "2",
          "--json", str(path)])
    d = json.loads(path.read_text())
    assert d["kind"] == "decode" and d["world"] == 1 and {"torch", "commit", "command", "device"} <= set(d["env"])
    ours = [r for r in d["results"] if r["impl"] in ("longattn", "longattn-dilated")]
    assert {r["impl"] for r in ours} == {"longattn", "longattn-dilated"}
    if not torch.cuda.is_available():  # on CUDA the backends and SDPA's rows join them
        assert ours == d["results"]
    for r in ours:
        assert r["status"] == "ok" and r["context"] == 64 and r["layers"] == 2
        assert r["prefill_ms"] > 0 and r["decode_ms_per_layer"] > 0 and r["tokens_per_s"] > 0
        assert r["cache_bytes_per_rank"] >= 2 * 2 * 64 * 16 * 4  # two layers' K and V, float32


def _within_sdpa_bar(got, q, k, v, lens, what):
    """Each row's one-query output within twice the error of PyTorch's bf16
    SDPA against float64, over the row's first ``lens[i]`` keys."""
    from reference import rel_err

    for i, n in enumerate(lens):
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        ref, _ = attention_ref(qi.double(), ki.double(), vi.double(), causal=True)
        bar = torch.nn.functional.scaled_dot_product_attention(
            qi.transpose(1, 2), ki.transpose(1, 2), vi.transpose(1, 2), enable_gqa=True).transpose(1, 2)
        assert rel_err(got[i:i + 1], ref) <= 2 * max(rel_err(bar, ref), 1e-3), (what, i)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn", "triton"])
def test_decode_bf16_on_cuda(backend):
    """bf16 decoding over a 4K cache (GQA, rows of different lengths, one
    query; dilated over 512 tokens): error against float64 at most twice
    SDPA's on the same inputs."""
    from reference import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, cap, h, hkv, d = 2, 4096, 8, 2, 128
    q, k, v = mk(b, 1, h, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = [4000, 512]
    out = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), backend=backend)
    same = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor([3000, 3000], dtype=I32), backend=backend)
    ref, _ = attention_ref(q.double(), k[:, :3000].double(), v[:, :3000].double(), causal=True)
    assert rel_err(same, ref) < 2e-2, backend  # equal lengths: one call on a strided view of the cache
    segs, rates = [128, 256, 512], [1, 2, 4]
    dil = longattn.dilated_decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32),
                                            segment_lengths=segs, dilation_rates=rates, backend=backend)
    _within_sdpa_bar(out, q, k, v, lens, backend)
    for i, n in enumerate(lens):
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        if n == 512:
            want, _ = _dilated_ref(qi.double().cpu(), ki.double().cpu(), vi.double().cpu(), n, segs, rates)
            assert rel_err(dil[i:i + 1].cpu(), want) < 2e-2, (backend, i)


@pytest.mark.gpu
def test_split_kv_descriptor_loads_bf16_on_cuda():
    """The split kernel's tensor-descriptor (TMA) loads on the GPU, bf16, its
    H200 and H100 tiles, token- and head-major caches: out within twice
    SDPA's error against float64, rows of different lengths, NaN in the
    unwritten slots, and in a CUDA graph with the lengths on the device,
    replayed after new lengths and new cache contents were written in place."""
    from longattn.kernels import decode as kdec
    from longattn.tuning import DECODE

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, cap, h, hkv, d = 2, 8192, 32, 8, 128
    q = mk(b, 1, h, d)

    def cache(major, lens):
        k, v = mk(b, cap, hkv, d), mk(b, cap, hkv, d)
        if major == "head":
            k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        for i, n in enumerate(lens):  # unwritten slots: NaN
            k[i, n:], v[i, n:] = float("nan"), float("nan")
        return k, v

    for major, name in itertools.product(("token", "head"), ("NVIDIA H200", "NVIDIA H100 80GB HBM3")):
        lens = [8000, 700]
        k, v = cache(major, lens)
        assert kdec.descriptor_refusals(k, v) == []
        kw = dict(DECODE.kernel_args(False, d, name), descriptors=True)
        out, _ = kdec.decode(q, k, v, lens, False, d ** -0.5, **kw)
        _within_sdpa_bar(out, q, k, v, lens, f"{major}-major, {name}, eager")
        lt = torch.tensor(lens, dtype=I32, device="cuda")
        kdec.decode(q, k, v, None, False, d ** -0.5, lens_tensor=lt, **kw)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rep, _ = kdec.decode(q, k, v, None, False, d ** -0.5, lens_tensor=lt, **kw)
        new = [5000, 8192]  # new lengths and contents, written in place before the replay
        k2, v2 = cache(major, new)
        k.copy_(k2)
        v.copy_(v2)
        lt.copy_(torch.tensor(new, dtype=I32))
        graph.replay()
        _within_sdpa_bar(rep, q, k, v, new, f"{major}-major, {name}, replayed")


@pytest.mark.gpu
def test_split_kernel_trace_on_cuda():
    """A traced launch (``trace=``, the timeline diagnostic) gives the same
    output and lse as an untraced one and a record for every program: its
    timers in order, one merging program per (batch row, kv head)."""
    from longattn.kernels import decode as kdec
    from longattn.tuning import DECODE

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, n, h, hkv, d = 2, 20000, 16, 4, 128
    q, k, v = mk(b, 1, h, d), mk(b, n, hkv, d), mk(b, n, hkv, d)
    kw = DECODE.kernel_args(False, d, torch.cuda.get_device_name())
    want, want_lse = kdec.decode(q, k, v, [n, n], True, d ** -0.5, **kw)
    size = kdec.trace_size(n, b, hkv, q.device, kw["programs_per_sm"], kw["block_n"], kw["min_split"])
    tr = torch.zeros(size, dtype=torch.int64, device="cuda")
    out, lse = kdec.decode(q, k, v, [n, n], True, d ** -0.5, **kw, trace=tr)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    t = tr.view(-1, kdec.TRACE_FIELDS).cpu()
    assert len(t) > b * hkv and (t[:, :4] > 0).all()
    assert (t[:, 1] >= t[:, 0]).all() and (t[:, 2] >= t[:, 1]).all() and (t[:, 3] >= t[:, 2]).all()
    assert (t[:, 5] > t[:, 4]).all()  # the SM's cycle counter across the key loop
    nsplit = len(t) // (b * hkv)
    assert t[:, 9].view(b * hkv, nsplit).sum(1).tolist() == [1] * (b * hkv)
    with pytest.raises(ValueError, match="trace must be"):
        kdec.decode(q, k, v, [n, n], True, d ** -0.5, **kw, trace=tr[:-1])


@pytest.mark.gpu
def test_decode_step_captured_in_a_cuda_graph():
    """decode_attention captured in a CUDA graph (lengths on the device, the
    split-KV kernel) replays with new lengths and queries: each replay equals
    an eager call on the same inputs; a backend that cannot run under capture
    raises ValueError naming the fix."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, cap, h, hkv, d = 2, 3000, 8, 2, 128
    q, k, v = mk(b, 1, h, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = torch.tensor([1000, 17], dtype=I32, device="cuda")
    longattn.decode_attention(q, k, v, cache_seqlens=lens)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = longattn.decode_attention(q, k, v, cache_seqlens=lens, return_lse=True)
    for step in range(3):
        q.copy_(mk(b, 1, h, d))
        lens += torch.tensor([500, 1], dtype=I32, device="cuda")
        graph.replay()
        want, want_lse = longattn.decode_attention(q, k, v, cache_seqlens=lens.cpu(), return_lse=True,
                                                   backend="flash")
        assert (out.float() - want.float()).abs().max().item() < 2e-2, step
        assert (lse - want_lse).abs().max().item() < 1e-3, step
    with pytest.raises(ValueError, match="capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            longattn.decode_attention(q, k, v, cache_seqlens=lens, backend="flash")


@pytest.mark.gpu
def test_split_kv_one_launch_on_cuda():
    """The split-KV kernel's in-launch merge on a GPU, bf16: one kv head (the
    device's programs all split one row: hundreds of splits merged over many
    chunks) and one split, calls in a row with changing lengths, each equal to
    the flash kernel and leaving the counters zero; a call captured in a CUDA
    graph with more (batch row, kv head) pairs than the counter workspace has
    (its zero-fill captured with it, the workspace not grown under capture)
    replays with new ragged lengths."""
    from longattn.decode.engine import dense_part, split_kv_args
    from longattn.kernels import decode as kdec
    from longattn.tuning import DECODE

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    d, cap = 128, 65536
    k, v = mk(1, cap, 1, d), mk(1, cap, 1, d)
    scale, args = d ** -0.5, split_kv_args(k, DECODE)
    dev = k.device
    nsplit = kdec.splits(cap, 1, dev, args["programs_per_sm"], args["block_n"], args["min_split"])[1]
    assert nsplit > 4 * kdec.merge_chunk(8, d, args["num_warps"], dev, args["merge_floats"])
    for i, n in enumerate([cap, 1, 40000, 4097, cap - 3] * 4):
        q = mk(1, 1, 8, d)
        out, lse = kdec.decode(q, k, v, [n], False, scale, **args)
        want, want_lse = dense_part(q, k, v, [n], False, scale, "flash")
        assert (out.float() - want.float()).abs().max().item() < 2e-2, (i, n)
        assert (lse - want_lse).abs().max().item() < 1e-3, (i, n)
        assert not any(c.any() for c in kdec._COUNTERS[dev]), (i, n)
    held = kdec._COUNTERS[dev]
    h, hkv, cap = 32, 8, 2048
    b = held[-1].numel() // hkv + 1  # more pairs than the workspace holds
    k, v, q = mk(b, cap, hkv, d), mk(b, cap, hkv, d), mk(b, 1, h, d)
    lens = torch.full((b,), cap, dtype=I32, device="cuda")
    run = lambda x, kk, vv, ll: kdec.decode(x, kk, vv, None, False, scale, lens_tensor=ll, **args)
    run(q[:1], k[:1], v[:1], lens[:1])  # compiles, within the workspace
    count = len(held)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run(q, k, v, lens)
    assert len(held) == count and held[-1].numel() < b * hkv
    for step in range(3):
        q.copy_(mk(b, 1, h, d))
        lens.copy_(torch.randint(1, cap + 1, (b,), device="cuda", generator=g, dtype=I32))
        graph.replay()
        want, want_lse = dense_part(q, k, v, lens.tolist(), False, scale, "flash")
        assert (out.float() - want.float()).abs().max().item() < 2e-2, step
        assert (lse - want_lse).abs().max().item() < 1e-3, step
    run(q, k, v, lens)  # eager: the workspace grows, the outgrown buffer kept
    assert len(held) == count + 1 and held[-1].numel() >= b * hkv and not any(c.any() for c in held)


@pytest.mark.gpu
def test_kv_cache_steps_replayed_from_cuda_graphs():
    """KVCache's dense steps on one GPU replay from CUDA graphs after a shape's
    first call (lengths advanced on the device by each step, graphs
    dropped when the storage grows): every step equals the flash kernel over
    the same cache, with and without its lse, rows of different lengths and
    two queries per step too, the append apart or in the step's call."""
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, n, h, hkv, d = 2, 2000, 8, 2, 128
    cache = longattn.KVCache.from_prefill(mk(b, n, hkv, d), mk(b, n, hkv, d), seqlens=[2000, 1500], reserve=4)
    roomy = longattn.KVCache.from_prefill(mk(b, n, hkv, d), mk(b, n, hkv, d), reserve=60000)  # capacity >> length
    for i in range(9):  # without, then with the lse: a graph each (one copies out only the output)
        kn, vn, q = mk(b, 1, hkv, d), mk(b, 1, hkv, d), mk(b, 1, h, d)
        if i < 6:
            roomy.append(kn, vn)
        if i < 3:
            out = roomy.attend(q)
        elif i < 6:
            out, lse = roomy.attend(q, return_lse=True)
        else:  # the append in the same call: its copies in the launch that loads the replayed graph's query
            out, lse = roomy.attend(q, k_new=kn, v_new=vn, return_lse=True)
        want, want_lse = longattn.decode_attention(q, roomy.k, roomy.v, cache_seqlens=roomy.local_seqlens,
                                                   return_lse=True, backend="flash")
        if i >= 3:
            assert (lse - want_lse).abs().max().item() < 1e-3, i
        assert (out.float() - want.float()).abs().max().item() < 2e-2, i
    assert len(roomy._steps.replays.graphs) == 2
    for step in range(8):  # grows past the reserve at step 4
        lq = 2 if step == 6 else 1
        cache.append(mk(b, lq, hkv, d), mk(b, lq, hkv, d))
        q = mk(b, lq, h, d)
        out, lse = cache.attend(q, return_lse=True)
        lens = cache.local_seqlens
        want, want_lse = longattn.decode_attention(q, cache.k, cache.v, cache_seqlens=lens, return_lse=True,
                                                   backend="flash")
        assert (out.float() - want.float()).abs().max().item() < 2e-2, step
        assert (lse - want_lse).abs().max().item() < 1e-3, step
    assert cache._steps.replays.graphs, "the repeated step shape was captured"
    with torch.inference_mode():  # a step shape of its own; the lengths advance under both modes
        for _ in range(3):
            cache.append(mk(b, 1, hkv, d), mk(b, 1, hkv, d))
            q = mk(b, 1, h, d)
            out = cache.attend(q)
            want = longattn.decode_attention(q, cache.k, cache.v, cache_seqlens=cache.local_seqlens, backend="flash")
            assert (out.float() - want.float()).abs().max().item() < 2e-2
    cache.append(mk(b, 1, hkv, d), mk(b, 1, hkv, d))
    q = mk(b, 1, h, d)
    want = longattn.decode_attention(q, cache.k, cache.v, cache_seqlens=cache.local_seqlens, backend="flash")
    assert (cache.attend(q).float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_kv_cache_softcap_sinks_chunks_on_cuda():
    """On one GPU in bf16: KVCache steps with soft-capping (not the split-KV
    kernel nor its graphs: a backend that soft-caps on views), sinks and chunks
    (rows of different lengths) against float64; decode_attention with
    soft-capping under capture names the split-KV kernel's refusal."""
    from reference import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, n, h, hkv, d = 2, 700, 8, 2, 64
    k, v = mk(b, n, hkv, d), mk(b, n, hkv, d)
    lens = [700, 513]
    cache = longattn.KVCache.from_prefill(k, v, seqlens=lens, reserve=8)
    full = [[k[i:i + 1, :m].cpu(), v[i:i + 1, :m].cpu()] for i, m in enumerate(lens)]
    sinks = torch.linspace(-1.0, 2.0, h, device="cuda")
    for step in range(4):
        kn, vn, q = mk(b, 1, hkv, d), mk(b, 1, hkv, d), mk(b, 1, h, d)
        cache.append(kn, vn)
        full = [[torch.cat([x, kn[i:i + 1].cpu()], 1), torch.cat([y, vn[i:i + 1].cpu()], 1)]
                for i, (x, y) in enumerate(full)]
        for kw in (dict(softcap=30.0, sinks=sinks), dict(chunk_size=128, sinks=sinks), dict(window_size=(99, 0))):
            out = cache.attend(q, **kw)
            chunk, left = kw.get("chunk_size"), kw.get("window_size", (-1, -1))[0]
            for i, (x, y) in enumerate(full):
                ref, _ = bounded_ref(q[i:i + 1].cpu(), x, y, x.shape[1], chunk, left, kw.get("softcap", 0.0),
                                     None if "sinks" not in kw else sinks.cpu())
                assert rel_err(out[i:i + 1].cpu(), ref) < 2e-2, (step, kw, i)
    assert not cache._steps.replays.graphs  # soft-capped steps never ran the split-KV kernel
    lens_dev = torch.tensor(lens, dtype=I32, device="cuda")
    q_cap = mk(b, 1, h, d)  # drawn before the capture: a generator outside capture mode cannot be used in it
    with pytest.raises(ValueError, match="soft-cap"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            longattn.decode_attention(q_cap, k, v, cache_seqlens=lens_dev, softcap=30.0)


# ---------------------------------------------------------- FA4's split-KV forward as a decode engine
def _fa4_usable(monkeypatch, usable=True):
    """FA4's refusals faked: installed on a Blackwell GPU, where its split-KV forward runs (or not installed)."""
    monkeypatch.setattr(bk.BACKENDS["fa4"], "_api", _Api(None if usable else "flash-attn-4 not installed"))
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (10, 0))


def _cuda_like(*shape, dtype=torch.bfloat16):
    """Only what the engine choice reads of a tensor."""
    import types

    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=tuple(shape))


def test_fa4_engine_choice(monkeypatch):
    """backend="fa4" takes FA4's split-KV forward wherever FA4 runs (ragged rows,
    soft-capping, KVCache steps alike), else the backend path, whose choice
    then says why; auto takes it only from ``fa4_min_keys`` keys on (None:
    Hopper has no FA4 split-KV forward, sm_100 is not measured)."""
    from longattn.decode.engine import dense_engine, fa4_refusals
    from longattn.tuning import DECODE, DecodeTuning

    _fa4_usable(monkeypatch)
    q, k = _cuda_like(2, 1, 8, 128), _cuda_like(2, 4096, 2, 128)
    assert fa4_refusals(q, k) == []
    for ragged, softcap, graphed in ((False, 0.0, False), (True, 30.0, False), (True, 0.0, True)):
        assert dense_engine(q, k, k, "fa4", ragged, softcap=softcap, graph_steps=graphed) == "fa4"
    assert DECODE.fa4_min_keys is None and "not measured" in DecodeTuning.__dataclass_fields__[
        "fa4_min_keys"].metadata["reason"]
    assert dense_engine(q, k, k, "auto", False) == "backend"
    assert "fa4" in DECODE.auto_excludes
    soon = DecodeTuning(fa4_min_keys=1024)
    assert dense_engine(q, k, k, "auto", False, soon, keys=4000) == "fa4"
    assert dense_engine(q, k, k, "auto", False, soon, keys=1000) == "backend"
    assert dense_engine(q, k, k, "auto", False, soon) == "fa4"  # keys: the capacity
    assert any("dtype" in r for r in fa4_refusals(q, _cuda_like(2, 64, 2, 128, dtype=torch.float16)))
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (9, 0))
    assert any("sm_100 only" in r for r in fa4_refusals(q, k))  # Hopper: no split-KV in FA4
    assert dense_engine(q, k, k, "fa4", True) == "backend"
    monkeypatch.setattr(bk.base.Backend, "capability", lambda self, device: (10, 0))
    _fa4_usable(monkeypatch, usable=False)
    assert fa4_refusals(q, k) == ["flash-attn-4 not installed"]
    assert dense_engine(q, k, k, "fa4", True) == dense_engine(q, k, k, "auto", False, soon, keys=4000) == "backend"
    cpu = torch.randn(1, 1, 4, 16)
    assert any("CUDA" in r for r in fa4_refusals(cpu, cpu))
    with pytest.raises(ValueError, match="backend='fa4' cannot run this call"):
        longattn.decode_attention(cpu, cpu, cpu, cache_seqlens=torch.tensor([1], dtype=I32), backend="fa4")


def test_fa4_engine_no_key_in_any_row(monkeypatch):
    """The fa4 engine launches nothing when no row has a key (a rank of a sharded cache holding none): out 0,
    lse -inf, as every engine gives."""
    from longattn.backends import _fa4_api
    from longattn.decode import engine

    fake = _MathInterface()
    monkeypatch.setattr(_fa4_api, "_interface", lambda: fake)
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16)
    out, lse = engine.dense_part(q, k, k, [0, 0], True, 0.25, "fa4", engine="fa4")
    assert fake.calls == [] and (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("lq,causal,softcap", [(1, True, 0.0), (3, True, 0.0), (2, False, 5.0)])
def test_fa4_engine_plumbing(monkeypatch, lq, causal, softcap):
    """decode_attention and KVCache steps through the fa4 engine on CPU, FA4
    faked at the _fa4_api boundary by the math backend: one call for the whole
    batch with the lengths as seqused_k (rows of different lengths, an empty
    one), FA4's split heuristic asked for, bottom-right causal rows."""
    from longattn.backends import _fa4_api
    from longattn.decode import engine

    fake = _MathInterface()
    monkeypatch.setattr(_fa4_api, "_interface", lambda: fake)
    monkeypatch.setattr(engine, "fa4_refusals", lambda q, k_cache: [])
    torch.manual_seed(4)
    b, cap, h, hkv, d = 3, 40, 4, 2, 16
    q, k, v = (torch.randn(b, n, hh, d, dtype=torch.float64) for n, hh in ((lq, h), (cap, hkv), (cap, hkv)))
    lens = [37, 0, 20] if not causal else [37, lq, 20]
    out, lse = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), causal=causal,
                                         softcap=softcap, return_lse=True, backend="fa4")
    assert fake.calls == [dict(varlen=False, seqused_k=True, num_splits=0, softcap=softcap, max_seqlen_k=37,
                                pack_gqa=None)]
    from longattn.tuning import DecodeTuning

    again = engine.dense_part(q, k, v, lens, causal, d ** -0.5, "fa4", tuning=DecodeTuning(fa4_num_splits=7),
                              softcap=softcap)
    assert fake.calls[-1]["num_splits"] == 7 and torch.equal(again[0], out)
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all() and (lse[i] == float("-inf")).all()
            continue
        ro, rl = attention_ref(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal and lq > 1,
                               softcap=softcap)
        assert_close(dict(out=out[i:i + 1], lse=lse[i:i + 1]), dict(out=ro, lse=rl), TOL, f"row {i} n={n}")
    cache = longattn.KVCache.from_prefill(k[:, :30], v[:, :30], seqlens=[30, 12, 25], reserve=4)
    kn, vn = torch.randn(b, 1, hkv, d, dtype=torch.float64), torch.randn(b, 1, hkv, d, dtype=torch.float64)
    cache.append(kn, vn)
    q1 = q[:, :1]
    got = cache.attend(q1, softcap=softcap, backend="fa4")
    assert fake.calls[-1]["seqused_k"] and fake.calls[-1]["max_seqlen_k"] == 31
    for i, n in enumerate([30, 12, 25]):
        kk, vv = torch.cat([k[i:i + 1, :n], kn[i:i + 1]], 1), torch.cat([v[i:i + 1, :n], vn[i:i + 1]], 1)
        ro, _ = attention_ref(q1[i:i + 1], kk, vv, softcap=softcap)
        assert_close(dict(out=got[i:i + 1]), dict(out=ro), TOL, f"cache row {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("lq,softcap", [(1, 0.0), (1, 30.0), (4, 0.0)])
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)])
def test_decode_fa4_on_cuda(fa4, lq, softcap, h, hkv):
    """backend="fa4" (FA4's split-KV forward on sm_100; on sm_90, which has none, the fa4
    backend on views of the cache): bf16, rows of different lengths
    over a 64K cache, GQA packed, several queries causal, soft-capping; error
    against float64 at most twice SDPA's (or the flash backend's) on the same
    inputs without soft-capping; a KVCache step through it too."""
    from reference import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    b, cap, d = 3, 65536, 128
    q, k, v = mk(b, lq, h, d), mk(b, cap, hkv, d), mk(b, cap, hkv, d)
    lens = [65536, 1000, 40000]
    out, lse = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(lens, dtype=I32), softcap=softcap,
                                         return_lse=True, backend="fa4")
    for i, n in enumerate(lens):
        qi, ki, vi = q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n]
        ref, ref_lse = attention_ref(qi.double(), ki.double(), vi.double(), causal=lq > 1, softcap=softcap)
        plain, _ = attention_ref(qi.double(), ki.double(), vi.double(), causal=lq > 1)
        bar = longattn.decode_attention(qi, ki, vi, cache_seqlens=torch.tensor([n], dtype=I32), backend="flash")
        assert rel_err(out[i:i + 1], ref) <= 2 * max(rel_err(bar, plain), 1e-3), (i, n)
        assert (lse[i:i + 1].double() - ref_lse).abs().max().item() < 1e-3, (i, n)
    cache = longattn.KVCache.from_prefill(k[:, :5000], v[:, :5000], seqlens=[5000, 300, 4000], reserve=8)
    kn, vn, q1 = mk(b, 1, hkv, d), mk(b, 1, hkv, d), mk(b, 1, h, d)
    cache.append(kn, vn)
    got = cache.attend(q1, softcap=softcap, backend="fa4")
    want = longattn.decode_attention(q1, cache.k, cache.v, cache_seqlens=cache.local_seqlens, softcap=softcap,
                                     backend="math")
    assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_decode_fa4_empty_row(fa4):
    """A row of length 0 in FA4's one launch gives output 0 and lse -inf, as every engine does."""
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    q, k, v = mk(2, 1, 8, 128), mk(2, 512, 2, 128), mk(2, 512, 2, 128)
    # causal=False: a causal query must find its own key in the cache, so an empty row is refused there
    out, lse = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor([0, 300], dtype=I32), causal=False,
                                         return_lse=True, backend="fa4")
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    want, want_lse = longattn.decode_attention(q[1:], k[1:], v[1:], cache_seqlens=torch.tensor([300], dtype=I32),
                                               causal=False, return_lse=True, backend="flash")
    assert (out[1:].float() - want.float()).abs().max().item() < 2e-2
    assert (lse[1:] - want_lse).abs().max().item() < 1e-3


def test_split_kernel_tiles_follow_the_gpu():
    from longattn.decode.engine import split_kv_args
    from longattn.tuning import DECODE

    h200, h100 = DECODE.kernel_args(False, 128, "NVIDIA H200"), DECODE.kernel_args(False, 128, "NVIDIA H100 80GB HBM3")
    assert (h200["num_stages"], h100["num_stages"]) == (DECODE.h200_num_stages, DECODE.num_stages)
    assert (h200["block_n"], h200["heads_fastest"]) == (DECODE.h200_block_n, DECODE.h200_heads_fastest)
    assert (h100["block_n"], h100["heads_fastest"]) == (DECODE.block_n, DECODE.heads_fastest)
    # tensor-descriptor loads: on the H200, in steps replayed from graphs (an eager launch encodes them on the host)
    assert (h200["descriptors"], h100["descriptors"]) == (False, False)
    replayed = [DECODE.kernel_args(False, 128, n, replayed=True)["descriptors"] for n in ("NVIDIA H200", "NVIDIA H100")]
    assert DECODE.descriptor_loads == "replayed" and replayed == [True, False]
    always = dataclasses.replace(DECODE, descriptor_loads="always")
    assert always.kernel_args(False, 128, "NVIDIA H200")["descriptors"]
    assert not dataclasses.replace(DECODE, descriptor_loads="never").kernel_args(False, 128, "NVIDIA H200",
                                                                                  replayed=True)["descriptors"]
    with pytest.raises(ValueError, match="descriptor_loads"):
        dataclasses.replace(DECODE, descriptor_loads=True)
    swept = ("num_stages", "descriptors", "block_n", "heads_fastest")
    assert {k: v for k, v in h200.items() if k not in swept} == {k: v for k, v in h100.items() if k not in swept}
    # only what was swept (D=128, 2-byte caches, the H200 itself) takes the H200's tile and loads
    for d, itemsize, name in ((64, 2, "NVIDIA H200"), (256, 2, "NVIDIA H200"), (128, 4, "NVIDIA H200"),
                              (128, 2, "NVIDIA GH200 480GB")):
        args = DECODE.kernel_args(False, d, name, itemsize, replayed=True)
        assert (args["num_stages"], args["descriptors"], args["block_n"], args["heads_fastest"]) == (
            DECODE.num_stages, False, DECODE.block_n, DECODE.heads_fastest), (d, itemsize, name)
    assert split_kv_args(torch.zeros(1, 1, 2, 16), DECODE) == DECODE.kernel_args(True, 16)


def test_unmasked_decode_picks_its_backend_on_two_key_rows(monkeypatch):
    """The backend of a one-query step is chosen on a probe of the cache's key
    rows; cuDNN refuses seqlen_q = seqlen_k = 1, so the probe holds two rows
    where the cache has them (a forced backend='cudnn' step otherwise raised)."""
    from longattn import backends as bk
    from longattn.decode import engine

    seen = []
    real = bk.select_backend
    monkeypatch.setattr(engine.bk, "select_backend", lambda q, k, *a, **kw: seen.append(k.shape[1]) or real(q, k, *a, **kw))
    q = torch.randn(1, 1, 4, 16)
    for n in (1, 2, 300):
        engine.unmasked_backend(q, torch.randn(1, n, 2, 16), bk.BlockSpec(0.25), "auto")
    assert seen == [1, 2, 2]
    cudnn = bk.BACKENDS["cudnn"]
    assert any("seqlen_q = seqlen_k = 1" in r for r in cudnn._extra_refusals(bk.BlockSpec(0.25), q, q[:, :1]))
    assert not any("seqlen_q = seqlen_k = 1" in r for r in cudnn._extra_refusals(bk.BlockSpec(0.25), q, torch.randn(1, 2, 2, 16)))


def test_split_kernel_trace_needs_a_gpu_buffer():
    """The timeline diagnostic reads the GPU's timers: a trace buffer off the
    GPU (or too small) is refused before any launch, naming the size."""
    from longattn.kernels import decode as kdec
    from longattn.tuning import DECODE

    q, k, v = torch.randn(1, 1, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
    kw = DECODE.kernel_args(True, 16)
    size = kdec.trace_size(64, 1, 2, q.device, kw["programs_per_sm"], kw["block_n"], kw["min_split"])
    assert size % kdec.TRACE_FIELDS == 0 and size >= 2 * kdec.TRACE_FIELDS
    with pytest.raises(ValueError, match=f"trace must be an int64 CUDA tensor on q's device.*{size}"):
        kdec.decode(q, k, v, [64], True, 0.25, **kw, trace=torch.zeros(size, dtype=torch.int64))


def test_step_graphs_keep_the_device_lengths_with_the_host(monkeypatch):
    """StepGraphs advances the device lengths by the tokens appended since the
    last step (one inside the graph, any more before it), whatever the steps
    do between: one-token loops, several tokens, appends with no step, a
    capture that fails, an append's copies made by the step. Simulated on the
    CPU: a "graph" records the step and replays it by running it. Every step
    equals decode_attention over the host's lengths."""
    import contextlib

    from longattn.decode import graph_steps
    from longattn.dilated import graphs
    from longattn.tuning import DECODE

    class Recorded:
        fail = False

        def __init__(self, fn, inputs, pool=None):
            if Recorded.fail:
                Recorded.fail = False
                raise RuntimeError("capture failed")
            self.fn, self.inputs = fn, [x.clone() for x in inputs]

        def __call__(self, inputs, copies=None):
            for dst, src in zip(*(copies or ([], []))):
                dst.copy_(src)
            for dst, src in zip(self.inputs, inputs):
                dst.copy_(src)
            return tuple(o.clone() for o in self.fn(*self.inputs))

    monkeypatch.setattr(graphs, "Graph", Recorded)
    monkeypatch.setattr(graphs, "_pool", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    g = torch.Generator().manual_seed(0)
    b, cap, h, hkv, d = 2, 96, 4, 2, 16
    k, v = torch.randn(b, cap, hkv, d, generator=g), torch.randn(b, cap, hkv, d, generator=g)
    steps = graph_steps.StepGraphs()
    host = [40, 25]

    def step(appended, attend=True, fused=False):
        for _ in range(appended):
            host[:] = [n + 1 for n in host]
            steps.advance(1)
        if not attend:
            return
        q = torch.randn(b, 1, h, d, generator=g)
        copies = None
        if fused:  # the appended token's K/V copied by the step itself, before its kernels read them
            kn, vn = torch.randn(2, b, hkv, d, generator=g)
            copies = ([x[i, host[i] - 1] for x in (k, v) for i in range(b)], [x[i] for x in (kn, vn) for i in range(b)])
        out, _ = steps.attend(q, k, v, list(host), d ** -0.5, DECODE, need_lse=False, copies=copies)
        if fused:
            assert all(torch.equal(dst, src) for dst, src in zip(*copies))
        want = longattn.decode_attention(q, k, v, cache_seqlens=torch.tensor(host, dtype=I32), backend="math")
        assert_close(dict(out=out), dict(out=want), 1e-4, f"step at {host}")
        assert steps.lens.tolist() == host and steps.pending == 0

    step(0)
    for _ in range(4):  # a generation loop: eager, eager, captured, replayed
        step(1)
    assert len(steps.replays.graphs) == 1
    step(2)  # two tokens: one before the replay, one inside it (the same graph)
    step(3, attend=False)  # appends with no step between
    step(1)
    assert len(steps.replays.graphs) == 1
    steps.replays.graphs.clear()  # evicted: the next step of that shape captures again, and the capture fails
    Recorded.fail = True
    with pytest.raises(RuntimeError, match="capture failed"):
        step(1)
    assert steps.lens.tolist() == host and steps.pending == 0  # the host's lengths, not one token behind
    step(1)
    step(1)
    steps.replays.clear()
    for _ in range(3):  # with the append's copies: eager, captured, replayed
        step(1, fused=True)
