"""Document-aware sharding: the plan (coverage, balance) as unit tests, and
``packed_attention`` over gloo ranks (world 2, 3, 4) against the float64
packed-document reference: outputs, lse and every gradient."""

import pytest
import torch
import torch.distributed as dist

import longattn
from dist_utils import assert_group_usable, generator, run_world, varlen_inputs
from longattn.distributed.doc_shard import IMBALANCE, plan_documents
from reference import assert_close, varlen_ref

TOL = 1e-4
DOCS = [
    [3, 40, 1, 17, 2],   # documents shorter than a rank's share, one longer than the whole shard
    [64],                # one document
    [5, 0, 9, 30, 12],   # an empty document
    [6, 7, 5, 8, 6, 7],  # all shorter than a rank's share: nothing split at world 2
    [8] * 12,            # nothing split, no padding: one launch per rank
]
CASES = [  # (causal, window, kv heads)
    (True, (-1, -1), 2),
    (False, (-1, -1), 4),
    (True, (6, 0), 1),
    (False, (3, 5), 2),
]


def _cu(lens):
    return tuple(int(x) for x in torch.tensor([0] + list(lens)).cumsum(0).tolist())


def _causal_pairs(p0, n):
    """(query, key) pairs a causal run of rows [p0, p0 + n) of a document sees."""
    return n * p0 + n * (n + 1) // 2


# ------------------------------------------------------------------ the plan
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lens", DOCS + [[100, 1, 1, 1], [2] * 33, list(range(1, 40))])
def test_plan_covers_every_token_once(lens, world):
    cu = _cu(lens)
    plans = [plan_documents(cu, world, r) for r in range(world)]
    idx = torch.cat([p.global_index[p.valid] for p in plans])
    assert sorted(idx.tolist()) == list(range(cu[-1]))
    for p in plans:
        assert p.global_index.numel() == p.local_tokens == plans[0].local_tokens
        doc = torch.searchsorted(torch.tensor(cu), p.global_index[p.valid], right=True) - 1
        assert torch.equal(p.position_ids[p.valid], p.global_index[p.valid] - torch.tensor(cu)[doc])
        assert p.cu_seqlens_local.dtype == torch.int32 and int(p.cu_seqlens_local[-1]) == p.whole_tokens
        whole = [d for d, _, n in p.runs[p.rank] if d not in p.split]
        assert [cu[d + 1] - cu[d] for d in whole] == (p.cu_seqlens_local[1:] - p.cu_seqlens_local[:-1]).tolist()
    assert plans[0].split == tuple(sorted(set(plans[0].split)))
    if world == 1:
        assert not plans[0].split


def _work(plan, rank):
    return sum(_causal_pairs(p0, n) for _, p0, n in plan.runs[rank])


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("lens", [
    [8192, 512, 2048, 128, 4096, 1024, 256, 16384 - 128] * 4,   # varlen_mix_32k at 128K
    [300, 900, 1500, 2400, 700] * 26,                           # varlen_chat_16k at ~128K
    [131072],                                                   # one document
    [60000, 3000, 2000, 50000, 16072],
])
def test_plan_balances_causal_work(lens, world):
    """Every rank's causal work and tokens within the imbalance bound of the mean."""
    cu = _cu(lens)
    plan = plan_documents(cu, world, 0)
    work = [_work(plan, r) for r in range(world)]
    tokens = [sum(n for _, _, n in rr) for rr in plan.runs]
    mean_w, mean_t = sum(work) / world, cu[-1] / world
    assert max(work) <= (1 + IMBALANCE) * mean_w * 1.01, (work, plan.split)
    assert max(tokens) <= (1 + IMBALANCE) * mean_t + 2 * len(plan.split), (tokens, plan.split)


def test_plan_splits_only_what_does_not_fit():
    mix = _cu([8192, 512, 2048, 128, 4096, 1024, 256, 16384 - 128] * 4)
    assert not plan_documents(mix, 2, 0).split and not plan_documents(mix, 4, 0).split
    one = plan_documents(_cu([1000]), 4, 1)
    assert one.split == (0,) and [(p0, n) for _, p0, n in one.runs[1]] == [(125, 125), (750, 125)]


def test_shard_documents_checks_its_input():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        longattn.shard_documents(cu.long(), 2, 0)
    with pytest.raises(ValueError, match="non-decreasing"):
        longattn.shard_documents(torch.tensor([0, 5, 3], dtype=torch.int32), 2, 0)
    with pytest.raises(ValueError, match="rank"):
        longattn.shard_documents(cu, 2, 2)
    assert longattn.shard_documents(cu, 2, 1) is plan_documents((0, 3, 8), 2, 1, IMBALANCE)


# ------------------------------------------------------------------ packed_attention over ranks
def _compare(world, lens, causal, window, hkv, seed, chunk=None, softcap=0.0, sinks=False):
    """packed_attention on shards of packed documents against the float64 reference (on the documents cut at the
    chunk edges with ``chunk``): out, lse and every gradient, the sinks' summed over the group."""
    from longattn.distributed.plan import chunk_cu

    cu, q, k, v, do, dl = varlen_inputs(lens, 4, hkv, 16, seed=seed)
    s = torch.randn(4) if sinks else None
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    sr = s.double().requires_grad_() if sinks else None
    cut = torch.tensor(chunk_cu(tuple(cu.tolist()), chunk or 0), dtype=torch.int32)
    ro, rl = varlen_ref(qr, kr, vr, cut, causal, window, softcap=softcap, sinks=sr)
    ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
    plan = longattn.shard_documents(cu)
    ql, kl, vl = (plan.shard(x).requires_grad_() for x in (q, k, v))
    sl = s.clone().requires_grad_() if sinks else None
    out, lse = longattn.packed_attention(ql, kl, vl, plan, causal=causal, window_size=window, return_lse=True,
                                         chunk_size=chunk, softcap=softcap, sinks=sl)
    pad = ~plan.valid.to(out.device)
    assert not out[pad].any()  # padding rows: 0, lse -inf (with sinks: the sink's logit)
    assert torch.isfinite(lse[:, pad]).all() if sinks else torch.isneginf(lse[:, pad]).all()
    lse_ok = torch.where(torch.isfinite(lse) & ~pad, lse, 0)
    ((out * plan.shard(do)).sum() + (lse_ok * plan.shard(dl.t()).t()).sum()).backward()
    us = lambda x: plan.unshard(x.detach())
    got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(ql.grad), dk=us(kl.grad), dv=us(vl.grad))
    want = dict(out=ro, lse=rl, dq=qr.grad, dk=kr.grad, dv=vr.grad)
    if sinks:
        got["dsinks"] = sl.grad.clone()
        dist.all_reduce(got["dsinks"])
        want["dsinks"] = sr.grad
    assert_close(got, want, TOL, f"world={world} docs={lens} causal={causal} window={window} hkv={hkv} chunk={chunk} "
                                 f"softcap={softcap} sinks={sinks} split={plan.split}")


def _check(rank, world):
    for lens in DOCS:
        for causal, window, hkv in CASES:
            _compare(world, lens, causal, window, hkv, seed=3)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_attention(world):
    run_world(_check, world)


def _check_scores(rank, world):
    """Soft-capping and attention sinks, a document split over the ranks among them."""
    for causal, window, hkv in CASES[:3]:
        _compare(world, [3, 40, 1, 17, 2], causal, window, hkv, seed=5, softcap=5.0, sinks=True)


def _check_chunks(rank, world):
    """chunk_size (documents cut at the chunk edges for attention, the plan unchanged), a split document's pieces
    crossing chunk edges among them."""
    for lens, chunk in (([3, 40, 1, 17, 2], 6), ([64], 5), ([5, 0, 9, 30, 12], 7)):
        for causal, window, hkv in CASES:
            _compare(world, lens, causal, window, hkv, seed=7, chunk=chunk)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_packed_attention_chunks(world):
    run_world(_check_chunks, world)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_packed_attention_softcap_sinks(world):
    run_world(_check_scores, world)


def _bad_inputs(rank, world):
    cu = torch.tensor([0, 4, 20, 23], dtype=torch.int32)
    cases = [  # (what this rank passes, the message every rank must see)
        (cu if rank else torch.tensor([0, 5, 20, 23], dtype=torch.int32), "differ"),
        (cu if rank else cu.long(), "int32"),
        (cu if rank else torch.tensor([0, 4, 20, 22], dtype=torch.int32), "differ"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg if rank == 0 else "rank|differ"):
            longattn.shard_documents(bad)
        assert_group_usable(world)
    plan = longattn.shard_documents(cu)
    q = torch.randn(plan.local_tokens + (rank == 0), 2, 8)
    with pytest.raises(ValueError, match="local tokens" if rank == 0 else "rank|differ"):
        longattn.packed_attention(q, q, q, plan, causal=True)
    assert_group_usable(world)
    q = torch.randn(plan.local_tokens, 2, 8)
    with pytest.raises((ValueError, TypeError), match="softcap" if rank == 0 else "rank|differ"):
        longattn.packed_attention(q, q, q, plan, softcap=-1.0 if rank == 0 else 0.0)
    assert_group_usable(world)
    with pytest.raises((ValueError, TypeError), match="sinks" if rank == 0 else "rank|differ"):
        longattn.packed_attention(q, q, q, plan, sinks=torch.zeros(3) if rank == 0 else None)
    assert_group_usable(world)
    other = longattn.shard_documents(cu, world, (rank + 1) % world)
    q = torch.randn(other.local_tokens, 2, 8)
    with pytest.raises(ValueError, match="rank"):
        longattn.packed_attention(q, q, q, other)
    assert_group_usable(world)


@pytest.mark.dist
def test_bad_input_raises_on_every_rank():
    run_world(_bad_inputs, 2)


def _shard_batch(rank, world):
    from longattn import context_parallel as cp

    lens = [3, 40, 1, 17, 2]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    ids = torch.arange(int(cu[-1]))[None] + 100
    batch = cp.shard_batch(ids, cu_seqlens=cu, layout="documents")
    ctx, plan = batch["longattn_cp"], batch["longattn_cp"].documents
    assert plan is not None and plan.split and batch["input_ids"].shape == (1, plan.local_tokens)
    # the plan lives on the host; the batch on the ids' device (CUDA under NCCL runs)
    valid, gidx = plan.valid.to(ids.device), plan.global_index.to(ids.device)
    assert torch.equal(batch["input_ids"][0][valid], gidx[valid] + 100)
    assert torch.equal(batch["position_ids"][0], plan.position_ids.to(ids.device))
    labels = batch["shift_labels"][0]
    last = gidx == int(cu[-1]) - 1  # without labels, only the stream's last token has no target
    assert (labels[~valid | last] == -100).all()
    assert torch.equal(labels[valid & ~last], gidx[valid & ~last] + 101)
    assert torch.equal(ctx.gather(batch["input_ids"][..., None])[..., 0], ids)
    x = plan.shard(torch.randn(int(cu[-1]), 2, 8, generator=generator(0)))
    out = ctx.attention_varlen(x, x, x, causal=True)
    ref = plan.shard(longattn.attention_varlen(*(plan.unshard(x),) * 3, cu, causal=True))
    torch.testing.assert_close(out, ref)


@pytest.mark.dist
def test_shard_batch_documents():
    run_world(_shard_batch, 2)


def _compiled(rank, world):
    from dist_utils import assert_compiled_matches_eager

    cu, q, k, v, _, _ = varlen_inputs([3, 40, 1, 17, 2], 4, 2, 8, seed=5)
    plan = longattn.shard_documents(cu)
    assert plan.split
    f = lambda q_, k_, v_: longattn.packed_attention(q_, k_, v_, plan, causal=True, return_lse=True)
    assert_compiled_matches_eager(f, [plan.shard(x) for x in (q, k, v)])


@pytest.mark.dist
def test_packed_attention_compiles():
    run_world(_compiled, 2)


@pytest.mark.dist
def test_bench_dist_row(tmp_path):
    """`bench dist --impl packed-balanced` on 2 gloo ranks: a varlen config runs, a dense one is unsupported."""
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "d.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "longattn.bench", "dist",
           "--config", "varlen_tiny", "tiny", "--impl", "ring-zigzag", "packed-balanced", "--seqlen", "256",
           "--heads", "4", "--batch", "1", "--iters", "1", "--warmup", "1", "--json", str(path)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {(r["config"], r["impl"]): r for r in json.loads(path.read_text())["results"]}
    assert rows["varlen_tiny", "packed-balanced"]["status"] == "ok"
    assert rows["varlen_tiny", "packed-balanced"]["efficiency_fwd_bwd"] > 0
    assert 0 < rows["varlen_tiny", "packed-balanced"]["model"]["predicted_efficiency"] <= 1
    assert rows["tiny", "packed-balanced"]["status"] == "unsupported"
    assert "varlen" in rows["tiny", "packed-balanced"]["reason"]


@pytest.mark.parametrize("causal", [True, False])
def test_bench_packed_model_counts(causal):
    """The bench's cost model of a plan: every pair and token counted once over the ranks, and the bytes of the
    split documents' K/V (one document too long for a rank here) as the all-gather and reduce-scatter move them."""
    from longattn.bench.configs import Config
    from longattn.bench.cp_rows import packed_model

    lens = (700, 100, 60, 40, 100)
    cfg = Config("t", 1, 1000, 4, 8, kv_heads=2, causal=causal, doc_lengths=lens)
    m = packed_model(cfg, 1000, 2, 2)
    assert m["split_documents"] == 1
    assert sum(m["tokens"]) == 1000 and max(m["tokens"]) <= m["local_tokens"]
    assert sum(m["work_pairs"]) == sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    assert m["predicted_efficiency"] == pytest.approx(sum(m["work_pairs"]) / 2 / max(m["work_pairs"]))
    s = 350  # the split document's tokens per rank: two of its four chunks
    assert m["recv_bytes_fwd"] == s * 2 * 2 * 8 * 2
    assert m["recv_bytes_bwd"] == m["recv_bytes_fwd"] + s * 2 * 2 * 8 * 4


def _model_matches(rank, world):
    """A Llama and a Mistral (sliding window) step on packed documents sharded with
    layout="documents" against the unsharded float64 model: loss, logits, every gradient."""
    import test_hf_dist as hf
    from longattn import context_parallel as cp
    from reference import rel_err

    torch.manual_seed(1)
    ids = torch.randint(1, 40, (1, 30))
    cu = torch.tensor([0, 3, 20, 21, 27, 30], dtype=torch.int32)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])[None]
    for kind in ("llama", "mistral"):
        model, ref = hf._models(kind)
        want_loss, want_logits, want_grads = hf._reference(ref, dict(input_ids=ids, labels=ids, position_ids=pos))
        batch = cp.shard_batch(ids, labels=ids, cu_seqlens=cu, layout="documents")
        assert batch["longattn_cp"].documents.split  # the 17-token document is split, the others whole
        out = model(**batch)
        out.loss.backward()
        cp.all_reduce_grads(model)
        errs = {"loss": rel_err(cp.reduce_loss(out.loss), want_loss),
                "logits": rel_err(batch["longattn_cp"].gather(out.logits.detach()), want_logits)}
        errs.update({n: rel_err(p.grad, want_grads[n]) for n, p in model.named_parameters()})
        bad = {n: e for n, e in errs.items() if not e < TOL}
        assert not bad, f"rank {rank}/{world} {kind}: {bad}"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_transformers_model_on_documents(world):
    pytest.importorskip("transformers")
    run_world(_model_matches, world)


def _gpu_bf16(rank, world):
    """bf16 on GPUs through the one-launch varlen kernel and the dense backends' pieces."""
    lens = [700, 90, 300, 1200, 5, 400]  # at world 2 the two longest documents are split, the others whole
    for causal, window, hkv in ((True, (-1, -1), 2), (True, (128, 0), 2), (False, (-1, -1), 8)):
        cu, q, k, v, do, dl = varlen_inputs(lens, 8, hkv, 128, seed=11)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = varlen_ref(qr, kr, vr, cu, causal, window)
        ((ro * do.double()).sum() + (rl * dl.double()).sum()).backward()
        plan = longattn.shard_documents(cu)
        ql, kl, vl = (plan.shard(x.bfloat16()).requires_grad_() for x in (q, k, v))
        out, lse = longattn.packed_attention(ql, kl, vl, plan, causal=causal, window_size=window, return_lse=True)
        lse_ok = torch.where(torch.isfinite(lse), lse, 0)
        ((out.float() * plan.shard(do)).sum() + (lse_ok * plan.shard(dl.t()).t()).sum()).backward()
        us = lambda x: plan.unshard(x.detach().float())
        got = dict(out=us(out), lse=us(lse.t()).t(), dq=us(ql.grad), dk=us(kl.grad), dv=us(vl.grad))
        assert_close(got, dict(out=ro, lse=rl, dq=qr.grad, dk=kr.grad, dv=vr.grad), 2e-2,
                     f"gpu world={world} causal={causal} window={window} split={plan.split}")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_packed_attention_on_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run_world(_gpu_bf16, 2, backend="nccl")
