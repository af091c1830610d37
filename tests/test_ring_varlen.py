"""Packed documents across ranks (gloo, world 2, 3, 4) against a float64
block-diagonal reference."""

import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import run_world
from longattn import backends as bk
from longattn.distributed.fused_varlen import fused_call
from longattn.distributed.plan import num_steps_varlen, plan_varlen
from longattn.distributed.ring import BackendOp, RingSchedule, ring_backward, ring_forward
from longattn.distributed.transport import ring_transport
from reference import assert_close
from test_varlen import varlen_ref

TOL = 1e-4
DOCS = [
    [3, 40, 1, 17, 2],          # documents shorter than the world size, one long one
    [64],                        # one document
    [5, 9, 30, 12],
]


def _check(rank, world):
    for lens in DOCS:
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        total = int(cu[-1])
        for layout in ("zigzag", "contiguous"):
            for causal, window, hkv in ((True, (-1, -1), 2), (False, (-1, -1), 4), (True, (6, 0), 1)):
                torch.manual_seed(7)
                q, k, v = torch.randn(total, 4, 16), torch.randn(total, hkv, 16), torch.randn(total, hkv, 16)
                do, dl = torch.randn(total, 4, 16), torch.randn(4, total)
                qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
                ro, rl = varlen_ref(qr, kr, vr, cu, causal, window)
                ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
                sh = lambda x: longattn.shard_varlen(x, cu, layout=layout)[0]
                ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
                out, lse = longattn.ring_attention_varlen(ql, kl, vl, cu, layout=layout, causal=causal,
                                                          window_size=window, return_lse=True, backend="math")
                lse_ok = torch.where(torch.isfinite(lse), lse, 0)
                ((out * sh(do)).sum() + (lse_ok * sh(dl.t()).t()).sum()).backward()
                _assert_unsharded(cu, layout, out, lse, (ql, kl, vl), ro, rl, (qr, kr, vr),
                                  f"world={world} docs={lens} {layout} causal={causal} window={window}")


def _assert_unsharded(cu, layout, out, lse, xs, ro, rl, refs, tag):
    us = lambda x: longattn.unshard_varlen(x.detach(), cu, layout=layout)
    got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(xs[0].grad), dk=us(xs[1].grad), dv=us(xs[2].grad))
    assert_close(got, dict(out=ro, lse=rl, dq=refs[0].grad, dk=refs[1].grad, dv=refs[2].grad), TOL, tag)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_varlen(world):
    run_world(_check, world)


class _EmulatedFlashVarlen:
    """Stand-in for the FlashAttention-2 varlen kernel of the fused ring step
    (CUDA only): the same segments (query and key documents, causal part
    bottom-right aligned), one math-backend call each, so the fused path's
    planning, gathers and scatters run in the gloo tests."""

    @staticmethod
    def _segs(cu_q, cu_k):
        return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())

    def forward(self, q, k, v, cu_q, cu_k, mq, mk, causal, scale):
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        for a, b, c, d in self._segs(cu_q, cu_k):
            spec = bk.BlockSpec(scale, causal, (-1, -1), (d - c) - (b - a))
            o, l = bk.block_forward(q[None, a:b], k[None, c:d], v[None, c:d], spec, "math")
            out[a:b], lse[:, a:b] = o[0], l[0]
        return out, lse

    def backward(self, do, q, k, v, o, lse, cu_q, cu_k, mq, mk, causal, scale):
        dq, dk, dvv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in self._segs(cu_q, cu_k):
            spec = bk.BlockSpec(scale, causal, (-1, -1), (d - c) - (b - a))
            g = bk.block_backward(do[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], o[None, a:b],
                                  lse[None, :, a:b].contiguous(), spec, "math")
            dq[a:b], dk[c:d], dvv[c:d] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dvv


EMULATED = _EmulatedFlashVarlen()


def _fused_ring(cu, layout, causal, used):
    """The packed-document ring with every step that can fuse run as one
    (emulated) varlen launch: the algorithm's own entry points, with the
    schedule the op builds on CUDA."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cut = tuple(cu.tolist())
    transport = ring_transport(dist.group.WORLD)

    def schedule(q):
        scale = q.shape[-1] ** -0.5

        def calls(src):
            one = fused_call(cut, layout, world, rank, src, causal, (-1, -1), scale, q.device, q.shape[1] * q.shape[2],
                             EMULATED)
            used.append(bool(one))
            return one or plan_varlen(cut, layout, world, rank, src, causal, (-1, -1), scale)
        return RingSchedule(num_steps_varlen(cut, layout, world, causal, (-1, -1)), calls)

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, _ = ring_forward(q[None], k[None], v[None], schedule(q), BackendOp("math"), transport)
            ctx.save_for_backward(q, k, v, out[0], lse[0])
            return out[0], lse[0]

        @staticmethod
        def backward(ctx, do, dl):
            q, k, v, out, lse = ctx.saved_tensors
            g = ring_backward(do[None], q[None], k[None], v[None], out[None], lse[None],
                              None if dl is None else dl[None], schedule(q), BackendOp("math"), transport)
            return tuple(x[0] for x in g)

    return Ring.apply


def _check_fused(rank, world):
    used = []
    for lens in DOCS:
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        total = int(cu[-1])
        for layout in ("zigzag", "contiguous"):
            for causal, hkv, with_lse in ((True, 2, False), (False, 4, False), (True, 4, True)):
                torch.manual_seed(3)
                q, k, v = torch.randn(total, 4, 16), torch.randn(total, hkv, 16), torch.randn(total, hkv, 16)
                do, dl = torch.randn(total, 4, 16), torch.randn(4, total) * with_lse
                qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
                ro, rl = varlen_ref(qr, kr, vr, cu, causal, (-1, -1))
                ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
                sh = lambda x: longattn.shard_varlen(x, cu, layout=layout)[0]
                ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
                out, lse = _fused_ring(cu, layout, causal, used)(ql, kl, vl)
                loss = (out * sh(do)).sum()
                if with_lse:  # the lse gradient takes the block-by-block backward
                    loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * sh(dl.t()).t()).sum()
                loss.backward()
                _assert_unsharded(cu, layout, out, lse, (ql, kl, vl), ro, rl, (qr, kr, vr),
                                  f"fused: world={world} docs={lens} {layout} causal={causal}")
    assert any(used), "no step was fused"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_ring_varlen_fused_steps(world):
    """The one-launch-per-step path (flash varlen on CUDA) with emulated kernels."""
    run_world(_check_fused, world)


def _check_shard_metadata(rank, world):
    cu = torch.tensor([0, 3, 40, 41], dtype=torch.int32)
    x = torch.arange(41)
    for layout in ("zigzag", "contiguous"):
        local, meta = longattn.shard_varlen(x, cu, layout=layout)
        v = meta.valid
        assert torch.equal(local[v], meta.global_index[v]) and (local[~v] == 0).all()
        starts = cu[:-1].long()[torch.searchsorted(cu.long(), meta.global_index[v], right=True) - 1]
        assert torch.equal(meta.position_ids[v], meta.global_index[v] - starts)
        assert torch.equal(longattn.unshard_varlen(local, cu, layout=layout), x)


@pytest.mark.dist
def test_shard_varlen_metadata():
    run_world(_check_shard_metadata, 3)


def test_plan_skips_cross_document_steps():
    cu = (0, 8, 16, 24, 32)  # four documents, each exactly one contiguous shard of 4 ranks
    assert num_steps_varlen(cu, "contiguous", 4, False, (-1, -1)) == 1
    assert all(plan_varlen(cu, "contiguous", 4, r, (r - 1) % 4, False, (-1, -1), 1.0) == () for r in range(4))
