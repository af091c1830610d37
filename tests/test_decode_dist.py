"""Decoding from a KV cache sharded over ranks (gloo, world 2 and 3) against
the float64 reference over the whole context: every step's output and lse,
dense (with chunks, sliding windows, soft-capping and sinks) and dilated,
GQA, right-padded rows of different lengths, caches built
from a contiguous or zigzag prefill shard or from the whole prompt, and the
raw decode_attention over parts; LongNetLM greedy generation from a sharded
cache gives the one-device tokens; a step is one collective; bad inputs
raise on every rank."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import longattn
from longattn.decode.sharded import checks_apart
from longattn.distributed.cache import CacheLayout
from dist_utils import assert_group_usable, generator, run_world
from reference import assert_close, attention_ref, dilated_ref

TOL = 1e-4


def _refs(q, ks, vs, segs, rates):
    """Per row: (dense out, lse), (dilated out, lse) of the last q_len queries
    over the row's whole context ks[b], vs[b] (1, n, Hkv, D)."""
    lq = q.shape[1]
    dense, dil = [], []
    for b, (k, v) in enumerate(zip(ks, vs)):
        n = k.shape[1]
        dense.append(attention_ref(q[b:b + 1], k, v, causal=True))
        full = torch.randn(1, n, q.shape[2], q.shape[3], generator=generator(b))
        full[:, n - lq:] = q[b:b + 1]
        o, l = dilated_ref(full, k, v, segs, rates, causal=True)
        dil.append((o[:, n - lq:], l[:, :, n - lq:]))
    return dense, dil


def _compare(tag, got, refs):
    out, lse = got
    for b, (ro, rl) in enumerate(refs):
        assert_close(dict(out=out[b:b + 1], lse=lse[b:b + 1]), dict(out=ro, lse=rl), TOL, f"{tag} row {b}")


def _check_steps(rank, world):
    g = dist.group.WORLD
    b, h, hkv, d = 2, 4, 2, 8
    segs, rates = [4, 8, 16], [1, 2, 4]
    for layout in ("contiguous", "zigzag"):
        s = 4 * world
        lens = [s, s - 5]  # row 1 right-padded: its padding is never stored
        gen = generator(11)  # the same values on every rank
        k, v = torch.randn(b, s, hkv, d, generator=gen), torch.randn(b, s, hkv, d, generator=gen)
        caches = {
            "from_prefill": longattn.KVCache.from_prefill(longattn.shard(k, layout=layout),
                                                          longattn.shard(v, layout=layout), seqlens=lens,
                                                          layout=layout, group=g, reserve=3, block=2),
            "from_sequence": longattn.KVCache.from_sequence(k, v, seqlens=lens, layout=layout, group=g, block=1),
            "from_sequence, checks apart": _checks(longattn.KVCache.from_sequence(
                k, v, seqlens=lens, layout=layout, group=g, block=1), "apart"),
        }
        ks = [k[i:i + 1, :n] for i, n in enumerate(lens)]
        vs = [v[i:i + 1, :n] for i, n in enumerate(lens)]
        for step, n_new in enumerate((1, 1, 2, 1, 1, 1)):
            kn, vn = torch.randn(b, n_new, hkv, d, generator=gen), torch.randn(b, n_new, hkv, d, generator=gen)
            q = torch.randn(b, n_new, h, d, generator=gen)
            ks = [torch.cat([x, kn[i:i + 1]], 1) for i, x in enumerate(ks)]
            vs = [torch.cat([x, vn[i:i + 1]], 1) for i, x in enumerate(vs)]
            dense, dil = _refs(q, ks, vs, segs, rates)
            for name, c in caches.items():
                tag = f"world={world} {layout} {name} step {step}"
                if step % 2:  # the append in the attend call
                    _compare(tag + " dense, k_new", c.attend(q, k_new=kn, v_new=vn, return_lse=True), dense)
                else:
                    c.append(kn, vn)
                    _compare(tag + " dense", c.attend(q, return_lse=True), dense)
                _compare(tag + " dilated", c.attend(q, segment_lengths=segs, dilation_rates=rates, return_lse=True),
                         dil)
                # the raw op over the same parts: causal on the rank holding the queries' own keys
                raw = longattn.decode_attention(q, c.k, c.v, cache_seqlens=c.local_seqlens,
                                                causal=rank == c.layout.last_owner, return_lse=True, group=g)
                _compare(tag + " decode_attention", raw, dense)
        for c in caches.values():  # the parts stay balanced and hold every token once
            loc = c.layout.local
            assert [sum(r[i] for r in loc) for i in range(b)] == c.layout.seqlens
            assert max(max(r) for r in loc) - min(max(r) for r in loc) <= 3, loc
    _check_empty_part(rank, world)
    _check_generate(rank, world)
    _check_one_collective_per_step(rank, world)


class _Collectives(TorchDispatchMode):
    """Counts the c10d collectives issued under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _checks(cache, mode):
    """``cache`` with its step's checks exchanged as ``mode`` says (DecodeTuning.sharded_checks)."""
    cache.tuning = dataclasses.replace(cache.tuning, sharded_checks=mode)
    return cache


def _check_one_collective_per_step(rank, world):
    # with the checks in the partials' header (auto on CPU tensors), a decode step (append, then attend) meets
    # the other ranks once: the partial results' all-gather; a query of a new shape first exchanges the checks
    # alone (one more). Apart (auto where the partials are on a GPU): the checks' all-gather, then the
    # partials', every step
    one, two = (2, 1, 1, 2, 1), (2,) * 5
    auto = two if checks_apart(torch.empty(0).device, longattn.tuning.DECODE) else one
    for mode, counts in (("auto", auto), ("with_partials", one), ("apart", two)):
        cache = _checks(longattn.KVCache.from_prefill(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8),
                                                      group=dist.group.WORLD, reserve=8), mode)
        for lq, want in zip((1, 1, 1, 2, 2), counts):
            with _Collectives() as seen:
                cache.append(torch.randn(1, lq, 2, 8), torch.randn(1, lq, 2, 8))
                cache.attend(torch.randn(1, lq, 4, 8))
            assert len(seen.names) == want, (mode, lq, seen.names)
    with pytest.raises(ValueError, match="sharded_checks"):  # where the tuning is made, before any collective
        _checks(cache, "late")


def _check_empty_part(rank, world):
    """The last rank holds no key of row 0: its part has weight 0, no NaN."""
    gen = generator(12)
    k, v = torch.randn(2, 4 * world, 2, 8, generator=gen), torch.randn(2, 4 * world, 2, 8, generator=gen)
    q = torch.randn(2, 1, 4, 8, generator=gen)
    part = slice(4 * rank, 4 * rank + 4)
    lens = torch.tensor([0 if rank == world - 1 else 4, 4], dtype=torch.int32)
    got = longattn.decode_attention(q, k[:, part], v[:, part], cache_seqlens=lens, causal=False, return_lse=True,
                                    group=dist.group.WORLD)
    n0 = 4 * (world - 1)
    refs = [attention_ref(q[:1], k[:1, :n0], v[:1, :n0]), attention_ref(q[1:], k[1:], v[1:])]
    _compare(f"world={world} empty part", got, refs)


def _check_generate(rank, world):
    from longattn.nn import LongNetLM

    torch.manual_seed(5)
    model = LongNetLM(50, dim=32, depth=2, num_heads=4, segment_lengths=(4, 8, 48), dilation_rates=(1, 2, 4),
                      num_kv_heads=2, max_seqlen=64).eval()
    toks = torch.randint(0, 50, (2, 48), generator=generator(6))
    lens = [48, 37]
    got = model.generate(toks, 8, seqlens=lens, group=dist.group.WORLD)
    want = model.generate(toks, 8, seqlens=lens)
    assert torch.equal(got, want), (rank, got, want)


def _check_scores(rank, world):
    """Sharded caches with chunks, sliding windows, soft-capping and sinks
    (the sinks merged once after the ranks' parts), step by step with one and
    several queries across chunk edges; decode_attention(group=) with
    soft-capping and sinks, a part with no key included."""
    from test_decode import bounded_ref

    g = dist.group.WORLD
    b, h, hkv, d = 2, 4, 2, 8
    sinks = torch.linspace(-1.0, 2.0, h)
    for layout in ("contiguous", "zigzag"):
        s = 4 * world
        lens = [s, s - 5]
        gen = generator(13)
        k, v = torch.randn(b, s, hkv, d, generator=gen), torch.randn(b, s, hkv, d, generator=gen)
        caches = [longattn.KVCache.from_prefill(longattn.shard(k, layout=layout), longattn.shard(v, layout=layout),
                                                seqlens=lens, layout=layout, group=g, block=2),
                  longattn.KVCache.from_sequence(k, v, seqlens=lens, layout=layout, group=g, block=1)]
        full = [[k[i:i + 1, :n], v[i:i + 1, :n]] for i, n in enumerate(lens)]
        for step, n_new in enumerate((1, 3, 1, 2)):
            kn, vn = torch.randn(b, n_new, hkv, d, generator=gen), torch.randn(b, n_new, hkv, d, generator=gen)
            q = torch.randn(b, n_new, h, d, generator=gen)
            full = [[torch.cat([x, kn[i:i + 1]], 1), torch.cat([y, vn[i:i + 1]], 1)] for i, (x, y) in enumerate(full)]
            for c in caches:
                c.append(kn, vn)
                for kw in (dict(chunk_size=4, softcap=1.0, sinks=sinks), dict(window_size=(3, 0)),
                           dict(softcap=1.5, sinks=sinks)):
                    chunk, left = kw.get("chunk_size"), kw.get("window_size", (-1, -1))[0]
                    refs = [bounded_ref(q[i:i + 1], x, y, x.shape[1], chunk, left, kw.get("softcap", 0.0),
                                        kw.get("sinks")) for i, (x, y) in enumerate(full)]
                    _compare(f"world={world} {layout} step {step} {kw}", c.attend(q, return_lse=True, **kw), refs)
    # the raw op: rank r holds keys [4r, 4r + 4) of row 0, the last rank none of row 1's
    gen = generator(14)
    k, v = torch.randn(2, 4 * world, 2, 8, generator=gen), torch.randn(2, 4 * world, 2, 8, generator=gen)
    q = torch.randn(2, 1, 4, 8, generator=gen)
    part = slice(4 * rank, 4 * rank + 4)
    lens = torch.tensor([4, 0 if rank == world - 1 else 4], dtype=torch.int32)
    got = longattn.decode_attention(q, k[:, part], v[:, part], cache_seqlens=lens, causal=False, return_lse=True,
                                    softcap=1.0, sinks=sinks, group=g)
    n1 = 4 * (world - 1)
    refs = [attention_ref(q[:1], k[:1], v[:1], softcap=1.0, sinks=sinks),
            attention_ref(q[1:], k[1:, :n1], v[1:, :n1], softcap=1.0, sinks=sinks)]
    _compare(f"world={world} decode_attention softcap sinks", got, refs)
    # a row with no key on any rank: 0, and the sink as its lse
    out, lse = longattn.decode_attention(q, k[:, part], v[:, part], cache_seqlens=torch.zeros(2, dtype=torch.int32),
                                         causal=False, return_lse=True, sinks=sinks, group=g)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sinks[None, :, None].expand(2, 4, 1))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_decode_chunks_windows_softcap_sinks(world):
    run_world(_check_scores, world)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_decode_matches_full_context(world):
    run_world(_check_steps, world)


def _raises_everywhere(world, match, fn):
    with pytest.raises(ValueError, match=match):
        fn()
    assert_group_usable(world)


def _check_errors(rank, world):
    g = dist.group.WORLD
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 6, 2, 8)
    lens = torch.tensor([4], dtype=torch.int32)
    call = lambda **kw: longattn.decode_attention(**{**dict(q=q, k_cache=k, v_cache=k, cache_seqlens=lens,
                                                            group=g), **kw})
    call()
    # lengths out of range on one rank (a per-call value): every rank raises at the agreement, before the merge
    bad = torch.tensor([7 if rank == 0 else 4], dtype=torch.int32)
    _raises_everywhere(world, r"\[0, 6\]" if rank == 0 else "rank\\(s\\) \\[0\\]", lambda: call(cache_seqlens=bad))
    # a problem on one rank only, after every rank passed a good call of the same shapes: the check
    # exchanges on every call (a rank that checked alone would wait in a collective the others skip)
    call()
    wrong = lens.long() if rank == 1 else lens
    _raises_everywhere(world, "int32" if rank == 1 else "differ across ranks", lambda: call(cache_seqlens=wrong))
    longattn.KVCache.from_prefill(k, k, seqlens=[3], group=g)
    past_end = [6 * world + 1 if rank == 1 else 3]  # seqlens beyond the prompt on rank 1 only
    _raises_everywhere(world, "seqlens must hold" if rank == 1 else "differ across ranks",
                       lambda: longattn.KVCache.from_prefill(k, k, seqlens=past_end, group=g))
    # shapes that differ across ranks
    _raises_everywhere(world, "differ across ranks", lambda: call(q=torch.randn(1, 2 + rank, 4, 8)))
    # a problem on one rank only: that rank names it, the others name the mismatch
    odd = torch.randn(1, 3, 3 if rank == 1 else 4, 8)
    _raises_everywhere(world, "multiple of nheads" if rank == 1 else "differ across ranks", lambda: call(q=odd))
    # the cache: a prefill whose shard differs, an append of the wrong shape on one rank
    kl = torch.randn(1, 4 + 2 * rank, 2, 8)
    _raises_everywhere(world, "differ across ranks", lambda: longattn.KVCache.from_prefill(kl, kl, group=g))
    for mode in ("with_partials", "apart"):
        _check_cache_errors(rank, world, mode, q, call)


def _check_cache_errors(rank, world, mode, q, call):
    g = dist.group.WORLD
    # appends run no collective: one of the wrong shape on one rank is raised by the next attend on every rank,
    # and the appends since the previous attend are undone (the cache stays usable)
    cache = _checks(longattn.KVCache.from_prefill(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), group=g), mode)
    kn = torch.randn(1, 1, 2 if rank != 1 else 3, 8)
    assert (cache.append(kn, kn) is None) == (rank == 1)
    _raises_everywhere(world, "nheads_kv=2" if rank == 1 else r"rank\(s\) \[1\]", lambda: cache.attend(q))
    assert cache.seqlens.tolist() == [4 * world]
    _raises_everywhere(world, "append their keys", lambda: cache.attend(q))
    # appends of different lengths, each valid alone: the placements differ and the next attend says so
    cache.append(torch.randn(1, 1 + rank, 2, 8), torch.randn(1, 1 + rank, 2, 8))
    _raises_everywhere(world, "placed the appends", lambda: cache.attend(q))
    assert cache.seqlens.tolist() == [4 * world]
    cache.append(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
    assert cache.attend(q).shape == q.shape
    # the append in the attend call: k_new without v_new on one rank is raised on every rank, the others' appends
    # undone; then the call with both on every rank
    kn = torch.randn(1, 1, 2, 8)
    _raises_everywhere(world, "go together" if rank == 1 else r"rank\(s\) \[1\]",
                       lambda: cache.attend(q, k_new=kn, v_new=None if rank == 1 else kn))
    assert cache.seqlens.tolist() == [4 * world + 1]
    assert cache.attend(q, k_new=kn, v_new=kn).shape == q.shape and cache.seqlens.tolist() == [4 * world + 2]
    # after an agreed call, a query whose shape differs on one rank (each valid alone)
    cache.append(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
    other = torch.randn(1, 1, 2 if rank == 1 else 4, 8)
    _raises_everywhere(world, "differ across ranks", lambda: cache.attend(other))
    assert cache.attend(q).shape == q.shape
    # soft-capping, sinks, chunks: bad on one rank, or differing across ranks
    sinks = torch.zeros(4 if rank != 1 else 3)
    _raises_everywhere(world, "sinks must hold" if rank == 1 else "differ across ranks",
                       lambda: cache.attend(q, sinks=sinks))
    _raises_everywhere(world, "softcap must be" if rank == 1 else "differ across ranks",
                       lambda: cache.attend(q, softcap=-1.0 if rank == 1 else 1.0))
    _raises_everywhere(world, "differ across ranks", lambda: cache.attend(q, chunk_size=4 + rank))
    _raises_everywhere(world, "differ across ranks", lambda: cache.attend(q, softcap=1.0 + rank))
    _raises_everywhere(world, "sinks must hold" if rank == 1 else "differ across ranks",
                       lambda: call(sinks=sinks))
    assert cache.attend(q, chunk_size=4, softcap=1.0, sinks=torch.zeros(4)).shape == q.shape
    # a forced backend that refuses the call where a rank has keys in range (flash: no soft-capping); a window of
    # one key leaves the other ranks with none: every rank raises, on a new call and on one agreed before
    for _ in range(2):
        _raises_everywhere(world, r"flash|rank\(s\)",
                           lambda: cache.attend(q, window_size=(0, -1), softcap=5.0, backend="flash"))
    if mode == "apart":
        # a failure after the checks went out (not a refusal: a kernel's error) on rank 1: it joins the partials'
        # all-gather with NaN partials and raises; the other ranks get a visibly invalid (NaN) result, none hangs
        cache.append(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
        if rank == 1:
            def broken(*args):
                def run():
                    raise RuntimeError("the kernel failed")
                return run
            cache._launch = broken
            with pytest.raises(RuntimeError, match="kernel failed"):
                cache.attend(q)
            del cache._launch
        else:
            assert torch.isnan(cache.attend(q)).all()
        assert_group_usable(world)
        cache.append(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8))
        assert torch.isfinite(cache.attend(q)).all()


def _check_errors_and_bench(rank, world):
    _check_errors(rank, world)
    from longattn.bench.decode import parse, run  # the bench under torchrun: the cache sharded

    res = run(parse(["--context", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--warmup", "1",
                     "--iters", "2", "--segment-lengths", "16", "32", "--dilation-rates", "1", "2"]))
    rows = res["results"]  # on CPU `auto` per impl; on a GPU also each backend, refused ones with their reason
    assert res["world"] == world and [r["status"] for r in rows if r["backend"] == "auto"] == ["ok", "ok"], rows
    assert all(r["status"] == "ok" or (r["status"] == "unsupported" and r["reason"]) for r in rows), rows
    assert all(r["decode_ms_per_layer"] > 0 and r["prefill_ms"] > 0 for r in rows if r["status"] == "ok")


def test_placements_of_different_appends_differ():
    # the same total, owner and block left after different counts: the placements differ, and so must the digests
    # the ranks compare at each attend
    a, b = CacheLayout(2, 1, 256), CacheLayout(2, 1, 256)
    for n in (128, 384, 128):
        a.place(n)
    for n in (256, 256, 128):
        b.place(n)
    assert a.seqlens == b.seqlens and a.local != b.local
    assert a.digest() != b.digest()
    # an undo restores the digest with the placement
    c = CacheLayout(2, 1, 256)
    for n in (128, 384, 128):
        c.place(n)
    state = a.state()
    a.place(7)
    assert a.digest() != c.digest()
    a.restore(state)
    assert a.digest() == c.digest() and a.local == c.local and a.runs == c.runs


@pytest.mark.dist
def test_bad_inputs_raise_on_every_rank():
    run_world(_check_errors_and_bench, 2)
