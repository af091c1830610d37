"""Packed documents across ranks (gloo, world 2, 3, 4) against a float64
block-diagonal reference."""
import pytest
import torch

import longattn
from dist_utils import run_world
from reference import rel_err
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
                us = lambda x: longattn.unshard_varlen(x.detach(), cu, layout=layout)
                errs = dict(out=rel_err(us(out), ro), lse=rel_err(us(lse.t()).t(), rl), dq=rel_err(us(ql.grad), qr.grad),
                            dk=rel_err(us(kl.grad), kr.grad), dv=rel_err(us(vl.grad), vr.grad))
                bad = {n: e for n, e in errs.items() if not e < TOL}
                assert not bad, f"world={world} docs={lens} {layout} causal={causal} window={window}: {bad}"
                assert not torch.isnan(out).any()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_varlen(world):
    run_world(_check, world)


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
    from longattn.distributed.varlen import num_steps_varlen, plan_varlen

    cu = (0, 8, 16, 24, 32)  # four documents, each exactly one contiguous shard of 4 ranks
    assert num_steps_varlen(cu, "contiguous", 4, False, (-1, -1)) == 1
    assert all(plan_varlen(cu, "contiguous", 4, r, (r - 1) % 4, False, (-1, -1), 1.0) == () for r in range(4))
