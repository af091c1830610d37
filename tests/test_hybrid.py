"""The Ulysses x ring hybrid on a 2-D DeviceMesh (gloo, world 4) against the
float64 single-device reference: 2 x 2 in both ring layouts, dense and packed
documents, GQA; 4 x 1 and 1 x 4 equal the pure forms; the mesh layout
helpers; inputs that differ across ranks raise on every rank. One spawned
world runs every check (process start-up is most of a gloo test's time)."""
import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import (assert_compiled_matches_eager, assert_group_usable, assert_unsharded_close,
                        run_world, varlen_inputs)
from reference import assert_close, attention_ref, grads_of
from test_varlen import varlen_ref

TOL = 1e-4
H = 12
DENSE = [  # (layout, causal, window, nheads_kv): kv heads = u, < u, > u, and straddling two ranks (12q/3kv over 2)
    ("zigzag", True, (-1, -1), 2), ("contiguous", True, (-1, -1), 1), ("zigzag", False, (3, 2), 4),
    ("contiguous", False, (-1, -1), 3), ("zigzag", True, (5, 0), 12),
]
VARLEN = [([3, 20, 1, 9], "zigzag", True, (-1, -1), 2), ([5, 9, 16], "contiguous", False, (4, 0), 1),
          ([7, 2, 13, 11], "contiguous", True, (-1, -1), 3)]


def _mesh(ulysses, ring):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ring, ulysses), mesh_dim_names=("ring", "ulysses"))


def _dense(mesh, layout, causal, window, hkv, seed=3):
    """(inputs, sharded run's out, lse and grads) for one config."""
    torch.manual_seed(seed)
    b, s, d = 2, 24, 8
    full = [torch.randn(b, s, H, d), torch.randn(b, s, hkv, d), torch.randn(b, s, hkv, d),
            torch.randn(b, s, H, d), torch.randn(b, H, s)]
    sh = lambda x, dim=1: longattn.shard_for_mesh(x, mesh, layout=layout, seq_dim=dim)
    ql, kl, vl = (sh(x).requires_grad_() for x in full[:3])
    out, lse = longattn.context_parallel_attention(ql, kl, vl, mesh=mesh, causal=causal, window_size=window,
                                                   layout=layout, return_lse=True, backend="math")
    ((out * sh(full[3])).sum() + (torch.where(torch.isfinite(lse), lse, 0) * sh(full[4], 2)).sum()).backward()
    return full, (ql, kl, vl), out, lse


def _check_dense(mesh):
    for layout, causal, window, hkv in DENSE:
        full, xs, out, lse = _dense(mesh, layout, causal, window, hkv)
        ro, rl, rg = grads_of(lambda *x: attention_ref(*x, causal=causal, window=window),
                              [x.double() for x in full[:3]], *full[3:])
        us = lambda x, dim=1: longattn.unshard_for_mesh(x, mesh, layout=layout, seq_dim=dim)
        assert_unsharded_close(f"hybrid 2x2 {layout} causal={causal} window={window} hkv={hkv}", us, out, lse,
                               [x.grad for x in xs], ro, rl, rg, TOL)


def _check_varlen(mesh):
    for lens, layout, causal, window, hkv in VARLEN:
        cu, q, k, v, do, dl = varlen_inputs(lens, H, hkv, 8, seed=5)
        ro, rl, rg = grads_of(lambda *x: varlen_ref(*x, cu, causal, window), [x.double() for x in (q, k, v)], do, dl)
        sh = lambda x: longattn.shard_varlen_for_mesh(x, cu, mesh, layout=layout)[0]
        ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
        out, lse = longattn.context_parallel_attention_varlen(ql, kl, vl, cu, mesh=mesh, layout=layout,
                                                              causal=causal, window_size=window, return_lse=True,
                                                              backend="math")
        ((out * sh(do)).sum() + (torch.where(torch.isfinite(lse), lse, 0) * sh(dl.t()).t()).sum()).backward()
        us = lambda x: longattn.unshard_varlen_for_mesh(x.detach(), cu, mesh, layout=layout)
        got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(ql.grad), dk=us(kl.grad), dv=us(vl.grad))
        assert_close(got, dict(out=ro, lse=rl, dq=rg[0], dk=rg[1], dv=rg[2]), TOL,
                     f"hybrid varlen 2x2 docs={lens} {layout} causal={causal} window={window} hkv={hkv}")


def _check_layout_helpers(mesh):
    s = 24
    for layout in ("zigzag", "contiguous"):
        pos = longattn.shard_positions_for_mesh(s, mesh, layout=layout)
        x = torch.randn(1, s, 2)
        assert torch.equal(longattn.shard_for_mesh(x, mesh, layout=layout), x[:, pos])
        assert torch.equal(longattn.unshard_for_mesh(x[:, pos], mesh, layout=layout), x)
    cu = torch.tensor([0, 3, 23, 24, 33], dtype=torch.int32)
    x = torch.arange(33)
    for layout in ("zigzag", "contiguous"):
        local, meta = longattn.shard_varlen_for_mesh(x, cu, mesh, layout=layout)
        v = meta.valid
        assert torch.equal(local[v], meta.global_index[v]) and (local[~v] == 0).all()
        assert torch.equal(longattn.unshard_varlen_for_mesh(local, cu, mesh, layout=layout), x)


def _check_pure_forms(rank):
    """A u x 1 mesh is Ulysses (contiguous shards), 1 x r the ring."""
    for (u, r), layout in (((4, 1), "contiguous"), ((1, 4), "zigzag")):
        mesh = _mesh(u, r)
        full, xs, out, lse = _dense(mesh, layout, True, (-1, -1), 2)
        pure = longattn.ulysses_attention if r == 1 else longattn.ring_attention
        ys = [longattn.shard(x, layout=layout).requires_grad_() for x in full[:3]]
        pout, plse = pure(*ys, causal=True, layout=layout, return_lse=True, backend="math")
        sh = lambda x, dim=1: longattn.shard(x, layout=layout, seq_dim=dim)
        ((pout * sh(full[3])).sum() + (plse * sh(full[4], 2)).sum()).backward()
        got = dict(out=out, lse=lse, dq=xs[0].grad, dk=xs[1].grad, dv=xs[2].grad)
        assert_close(got, dict(out=pout, lse=plse, dq=ys[0].grad, dk=ys[1].grad, dv=ys[2].grad), 1e-6,
                     f"{u}x{r} mesh against the pure form")


def _check_errors(rank, world, mesh):
    q = torch.randn(1, 6, 4, 8)
    with pytest.raises(ValueError, match="mesh_dim_names"):
        longattn.context_parallel_attention(q, q, q, mesh=_mesh(4, 1)["ulysses"])
    with pytest.raises(ValueError, match="ulysses dim"):
        longattn.context_parallel_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], mesh=mesh)
    with pytest.raises(ValueError, match="shard_varlen_for_mesh"):
        longattn.context_parallel_attention_varlen(q[0], q[0], q[0], torch.tensor([0, 30], dtype=torch.int32),
                                                   mesh=mesh)
    s = 8 if rank == 3 else 6  # one rank of one ulysses group disagrees: every rank of the mesh raises
    x = torch.randn(1, s, 4, 8)
    with pytest.raises(ValueError, match="differ across ranks"):
        longattn.context_parallel_attention(x, x, x, mesh=mesh)
    with pytest.raises(ValueError, match="differ across ranks"):
        longattn.context_parallel_attention(q, q, q, mesh=mesh, causal=rank < 2)  # the two ulysses groups differ
    assert_group_usable(world)


def _check_compiled(mesh):
    """torch.compile traces the mesh, both exchanges and the ring op, with the eager values and gradients."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    f = lambda q, k, v: longattn.context_parallel_attention(q, k, v, mesh=mesh, causal=True, return_lse=True,
                                                            backend="math")
    assert_compiled_matches_eager(f, (q, k, v))


def _check(rank, world):
    mesh = _mesh(2, 2)
    _check_dense(mesh)
    _check_varlen(mesh)
    _check_layout_helpers(mesh)
    _check_pure_forms(rank)
    _check_compiled(mesh)
    _check_errors(rank, world, mesh)


@pytest.mark.dist
def test_hybrid_2x2_mesh():
    run_world(_check, 4)
