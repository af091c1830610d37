"""Logit soft-capping, attention sinks and chunked attention across ranks
(gloo): ring_attention(_varlen), ulysses_attention(_varlen) and the hybrid
against the float64 single-device reference: outputs, lse, the q/k/v
gradients and the sink's (each rank's partial gradient summed over the
group, as context_parallel.all_reduce_grads does for parameters); rows that
see no key; bad inputs raise on every rank."""
import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import (assert_compiled_matches_eager, assert_group_usable, dense_inputs, run_world,
                        varlen_inputs)
from reference import assert_close, attention_ref, grads_of, varlen_ref

TOL = 1e-4
H, D = 6, 8

# (layout, causal, window, nheads_kv, softcap, sinks)
DENSE = [
    ("zigzag", True, (-1, -1), 2, 1.5, True),
    ("contiguous", True, (-1, -1), 6, 0.0, True),
    ("contiguous", False, (3, 2), 1, 2.0, False),
    ("zigzag", True, (5, 0), 3, 1.5, True),
]
# (lens, layout, causal, window, nheads_kv, softcap, sinks, chunk_size)
VARLEN = [
    ([5, 17, 1, 9], "zigzag", True, (-1, -1), 2, 1.5, True, None),
    ([5, 17, 1, 9], "zigzag", True, (-1, -1), 3, 0.0, True, 4),
    ([12, 7, 13], "contiguous", True, (-1, -1), 6, 1.5, False, 5),
    ([6, 9, 16], "contiguous", False, (4, 0), 1, 2.0, True, None),
    ([20, 3], "zigzag", False, (-1, -1), 2, 0.0, True, 3),
    ([5, 3, 4, 7, 5], "zigzag", True, (3, 0), 2, 0.0, True, None),
]


def chunked_cu(cu: torch.Tensor, chunk) -> torch.Tensor:
    """cu_seqlens with every document cut at each multiple of ``chunk`` of its positions."""
    if chunk is None:
        return cu
    out = [0]
    for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
        out += list(range(a + chunk, b, chunk)) + ([b] if b > a else [])
    return torch.tensor(out, dtype=torch.int32)


def _compare(tag, got: dict, sinks, ref: tuple, group=None):
    """got: unsharded out, lse, dq, dk, dv; the sink's gradient of this rank is summed over the group here."""
    if sinks is not None:
        ds = sinks.grad.clone()
        dist.all_reduce(ds, group=group)
        got["dsinks"] = ds
    ro, rl, rg = ref
    assert_close(got, dict(out=ro, lse=rl, **dict(zip(("dq", "dk", "dv", "dsinks"), rg))), TOL, tag)


def _loss(out, lse, do, dl):
    return (out * do).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dl).sum()


def _dense_case(world, hkv, seed):
    torch.manual_seed(seed)
    q, k, v, do, dl = dense_inputs(2, 2 * world * 4, H, hkv, D)
    return q, k, v, do, dl, torch.randn(H) * 2


def _check_dense(op, tag, world, configs, **kw):
    for layout, causal, window, hkv, softcap, with_sinks in configs:
        q, k, v, do, dl, s = _dense_case(world, hkv, 11)
        sinks = s if with_sinks else None
        ref = grads_of(lambda q, k, v, *s: attention_ref(q, k, v, causal=causal, window=window, softcap=softcap,
                                                         sinks=s[0] if s else None),
                       [x.double() for x in (q, k, v)] + ([s.double()] if with_sinks else []), do, dl)
        sh = lambda x, dim=1: longattn.shard(x, layout=layout, seq_dim=dim)
        us = lambda x, dim=1: longattn.unshard(x.detach(), layout=layout, seq_dim=dim)
        xs = [sh(x).requires_grad_() for x in (q, k, v)]
        sl = None if sinks is None else sinks.clone().requires_grad_()
        out, lse = op(*xs, causal=causal, window_size=window, layout=layout, return_lse=True, softcap=softcap,
                      sinks=sl, backend="math", **kw)
        _loss(out, lse, sh(do), sh(dl, 2)).backward()
        got = dict(out=us(out), lse=us(lse, 2), dq=us(xs[0].grad), dk=us(xs[1].grad), dv=us(xs[2].grad))
        _compare(f"{tag} world={world} {layout} causal={causal} window={window} hkv={hkv} softcap={softcap} "
                 f"sinks={with_sinks}", got, sl, ref)


def _check_varlen(op, tag, world, configs, **kw):
    for lens, layout, causal, window, hkv, softcap, with_sinks, chunk in configs:
        cu, q, k, v, do, dl = varlen_inputs(lens, H, hkv, D, seed=5)
        s = torch.randn(H) * 2
        ref = grads_of(lambda q, k, v, *s: varlen_ref(q, k, v, chunked_cu(cu, chunk), causal, window, softcap,
                                                      s[0] if s else None),
                       [x.double() for x in (q, k, v)] + ([s.double()] if with_sinks else []), do, dl)
        sh = lambda x: longattn.shard_varlen(x, cu, layout=layout)[0]
        us = lambda x: longattn.unshard_varlen(x.detach(), cu, layout=layout)
        xs = [sh(x).requires_grad_() for x in (q, k, v)]
        sl = s.clone().requires_grad_() if with_sinks else None
        extra = dict(kw, chunk_size=chunk) if chunk is not None else kw
        out, lse = op(*xs, cu, causal=causal, window_size=window, layout=layout, return_lse=True, softcap=softcap,
                      sinks=sl, backend="math", **extra)
        _loss(out, lse, sh(do), sh(dl.t()).t()).backward()
        got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(xs[0].grad), dk=us(xs[1].grad), dv=us(xs[2].grad))
        _compare(f"{tag} world={world} docs={lens} {layout} causal={causal} window={window} hkv={hkv} "
                 f"softcap={softcap} sinks={with_sinks} chunk={chunk}", got, sl, ref)
        # padding rows see no key: output 0, lse -inf (with sinks: the head's sink), never NaN
        pad = ~longattn.shard_varlen(q, cu, layout=layout)[1].valid
        if bool(pad.any()):
            assert not out[pad].any()
            want = s[:, None].expand(H, int(pad.sum())) if with_sinks else torch.full((H, int(pad.sum())), -torch.inf)
            assert torch.equal(lse[:, pad], want.float())


def _bad_inputs(rank, world):
    q, k, v = (torch.randn(1, 8, H, D) for _ in range(3))
    cu = torch.tensor([0, 5, 8 * world], dtype=torch.int32)
    qv = longattn.shard_varlen(torch.randn(8 * world, H, D), cu)[0]
    calls = [
        ("negative softcap", lambda: longattn.ring_attention(q, k, v, softcap=-1.0), "softcap"),
        ("sinks of the wrong shape on rank 1",
         lambda: longattn.ring_attention(q, k, v, causal=True, sinks=torch.zeros(H - 1 if rank == 1 else H)),
         "sinks" if rank == 1 else "rank"),
        ("varlen sinks of the wrong shape on rank 0",
         lambda: longattn.ring_attention_varlen(qv, qv, qv, cu, sinks=torch.zeros(H + 1 if rank == 0 else H)),
         "sinks" if rank == 0 else "rank"),
        ("ulysses sinks not a tensor", lambda: longattn.ulysses_attention(q, k, v, sinks=[0.0] * H), "sinks"),
        ("a forced backend without soft-capping",
         lambda: longattn.ring_attention(q, k, v, softcap=2.0, backend="flash"), "soft-capping"),
        ("chunk_size 0", lambda: longattn.ring_attention_varlen(qv, qv, qv, cu, chunk_size=0), "chunk_size"),
        ("ring chunk_size 0 on rank 1",
         lambda: longattn.ring_attention_varlen(qv, qv, qv, cu, chunk_size=0 if rank == 1 else 3),
         "chunk_size" if rank == 1 else "rank"),
        ("ulysses chunk_size not an int on rank 0",
         lambda: longattn.ulysses_attention_varlen(qv, qv, qv, cu, chunk_size=2.5 if rank == 0 else 2),
         "chunk_size" if rank == 0 else "rank"),
    ]
    for tag, call, needle in calls:
        with pytest.raises((ValueError, TypeError), match=needle):
            call()
        assert_group_usable(world)


def _compiled(world):
    """torch.compile (fullgraph) of ring_attention with softcap and sinks gives the eager values and gradients."""
    q, k, v, _, _, s = _dense_case(world, 2, 17)
    sh = lambda x: longattn.shard(x, layout="zigzag")
    assert_compiled_matches_eager(lambda q, k, v, s: longattn.ring_attention(
        q, k, v, causal=True, layout="zigzag", return_lse=True, softcap=1.5, sinks=s, backend="math"),
        [sh(q), sh(k), sh(v), s])


def _run(rank, world):
    _check_dense(longattn.ring_attention, "ring", world, DENSE)
    _check_varlen(longattn.ring_attention_varlen, "ring_varlen", world, VARLEN)
    _check_dense(longattn.ulysses_attention, "ulysses", world, DENSE[:3])
    _check_varlen(longattn.ulysses_attention_varlen, "ulysses_varlen", world, VARLEN)
    _bad_inputs(rank, world)
    if world == 2:
        _compiled(world)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_softcap_sinks_across_ranks(world):
    run_world(_run, world)


def _hybrid(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    for layout, causal, window, hkv, softcap, with_sinks in DENSE[:2]:
        q, k, v, do, dl, s = _dense_case(2, hkv, 13)
        sinks = s.clone().requires_grad_() if with_sinks else None
        ref = grads_of(lambda q, k, v, *s: attention_ref(q, k, v, causal=causal, window=window, softcap=softcap,
                                                         sinks=s[0] if s else None),
                       [x.double() for x in (q, k, v)] + ([s.double()] if with_sinks else []), do, dl)
        sh = lambda x, dim=1: longattn.shard_for_mesh(x, mesh, layout=layout, seq_dim=dim)
        us = lambda x, dim=1: longattn.unshard_for_mesh(x.detach(), mesh, layout=layout, seq_dim=dim)
        xs = [sh(x).requires_grad_() for x in (q, k, v)]
        out, lse = longattn.context_parallel_attention(*xs, mesh=mesh, causal=causal, window_size=window,
                                                       layout=layout, return_lse=True, softcap=softcap, sinks=sinks,
                                                       backend="math")
        _loss(out, lse, sh(do), sh(dl, 2)).backward()
        got = dict(out=us(out), lse=us(lse, 2), dq=us(xs[0].grad), dk=us(xs[1].grad), dv=us(xs[2].grad))
        _compare(f"hybrid 2x2 {layout} softcap={softcap} sinks={with_sinks}", got, sinks, ref)
    lens, layout, causal, window, hkv, softcap, _, chunk = VARLEN[1]
    cu, q, k, v, do, dl = varlen_inputs(lens, H, hkv, D, seed=5)
    s = torch.randn(H) * 2
    ref = grads_of(lambda q, k, v, s: varlen_ref(q, k, v, chunked_cu(cu, chunk), causal, window, softcap, s),
                   [x.double() for x in (q, k, v, s)], do, dl)
    sh = lambda x: longattn.shard_varlen_for_mesh(x, cu, mesh, layout=layout)[0]
    us = lambda x: longattn.unshard_varlen_for_mesh(x.detach(), cu, mesh, layout=layout)
    xs = [sh(x).requires_grad_() for x in (q, k, v)]
    sinks = s.clone().requires_grad_()
    out, lse = longattn.context_parallel_attention_varlen(*xs, cu, mesh=mesh, causal=causal, layout=layout,
                                                          return_lse=True, softcap=softcap, sinks=sinks,
                                                          chunk_size=chunk, backend="math")
    _loss(out, lse, sh(do), sh(dl.t()).t()).backward()
    got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(xs[0].grad), dk=us(xs[1].grad), dv=us(xs[2].grad))
    _compare(f"hybrid varlen 2x2 chunk={chunk}", got, sinks, ref)


@pytest.mark.dist
def test_hybrid_softcap_sinks():
    run_world(_hybrid, 4)
