"""Dilated attention over ranks (gloo, world 2, 3, 4) against the float64
single-device definition, and its communication volume against the count."""
import itertools

import pytest
import torch

import longattn
from dist_utils import assert_unsharded_close, run_world
from longattn.distributed import transport
from longattn.distributed.dilated import comm_bytes, split_branches
from reference import dilated_ref

TOL = 1e-4
CASES = {
    # world: (shard length, segments (smaller than, equal to, larger than the shard), rates)
    2: (24, [8, 24, 48], [1, 2, 4]),
    3: (24, [8, 24, 72, 144], [1, 2, 4, 8]),
    4: (16, [8, 16, 32, 64], [1, 2, 4, 8]),
}


def _check(rank, world):
    l, all_segs, all_rates = CASES[world]
    s = l * world
    # every branch as given, then only the branches inside a shard (no exchange,
    # results kept in the input dtype: a different code path)
    inside = [(w, r) for w, r in zip(all_segs, all_rates) if l % w == 0]
    for (segs, rates), (causal, h, hkv) in itertools.product(
            ((all_segs, all_rates), tuple(map(list, zip(*inside)))), ((False, 4, 4), (True, 4, 2), (True, 8, 1))):
        torch.manual_seed(3)
        q, k, v = torch.randn(1, s, h, 16), torch.randn(1, s, hkv, 16), torch.randn(1, s, hkv, 16)
        do, dl = torch.randn(1, s, h, 16), torch.randn(1, h, s)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = dilated_ref(qr, kr, vr, segs, rates, causal=causal)
        ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
        ql, kl, vl = (longattn.shard(x).requires_grad_() for x in (q, k, v))
        transport.traffic["bytes_sent"] = 0
        out, lse = longattn.dilated_attention(ql, kl, vl, segment_lengths=segs, dilation_rates=rates, causal=causal,
                                              return_lse=True, backend="math", group=torch.distributed.group.WORLD)
        sent_fwd = transport.traffic["bytes_sent"]
        ((out * longattn.shard(do)).sum() + (torch.where(torch.isfinite(lse), lse, 0) *
                                             longattn.shard(dl, seq_dim=2)).sum()).backward()
        sent_all = transport.traffic["bytes_sent"]
        kw = dict(batch=1, nheads=h, nheads_kv=hkv, headdim=16, itemsize=4, causal=causal)
        assert sent_fwd == comm_bytes(s, world, segs, rates, **kw)
        assert sent_all == comm_bytes(s, world, segs, rates, backward=True, **kw)
        us = lambda x, dim=1: longattn.unshard(x, seq_dim=dim)
        assert_unsharded_close(f"world={world} causal={causal} h={h}/{hkv}", us, out, lse, (ql.grad, kl.grad, vl.grad),
                               ro, rl, (qr.grad, kr.grad, vr.grad), TOL)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_dilated_over_ranks(world):
    run_world(_check, world)


def test_branch_split_and_volume():
    local, span = split_branches(1024, 4, [512, 1024, 2048, 8192], [1, 2, 4, 8])
    assert local == [(512, 1), (1024, 2)] and span == [(2048, 4), (8192, 8)]
    with pytest.raises(ValueError, match="divide the shard length"):
        split_branches(1024, 4, [768], [1])
    with pytest.raises(ValueError, match="dilation rate"):
        split_branches(1000, 4, [2000], [3])
    # only spanning branches communicate, 1/r of the shard per hop
    kw = dict(batch=1, nheads=16, nheads_kv=16, headdim=128, itemsize=2, causal=False)
    assert comm_bytes(4096, 4, [512, 1024], [1, 2], **kw) == 0
    one = comm_bytes(4096, 4, [4096], [4], **kw)
    assert one == 3 * 2 * (1024 // 4) * 16 * 128 * 2
