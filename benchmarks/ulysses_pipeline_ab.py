"""Ulysses on N GPUs: one group of heads against the exchanges pipelined over
2 and 4 groups (``UlyssesTuning``), and the tuning's own choice, beside the
local attention alone (what each rank computes, no exchange): the gap to
``local`` is what the exchanges, copies and host time still cost.

    torchrun --nproc_per_node=2 benchmarks/ulysses_pipeline_ab.py [--configs dense_128k_causal ...]
        [--seqlen 131072] [--rounds 2] [--json out.json]

bf16, B=1, D=128; configs from ``longattn.bench`` (dense, GQA and packed
documents, these at 128K tokens as ``benchmarks/results/dist_ulysses_varlen_*``;
``--seqlen`` overrides the dense lengths). Cold timing (one call per
sample, host time to the first kernel counted, as ``longattn.bench dist``),
median over ``--iters`` samples, variants alternating over ``--rounds``
rounds. Rank 0 prints a table and writes JSON.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import longattn
from longattn.bench import configs as C
from longattn.bench.impls import varlen_cu_seqlens
from longattn.bench.measure import environment, time_ms
from longattn.distributed.ulysses import HeadPlan
from longattn.tuning import UlyssesTuning

p = argparse.ArgumentParser()
p.add_argument("--configs", nargs="+", default=["dense_32k_causal", "dense_128k", "dense_128k_causal",
                                                "gqa_32q8kv_128k_causal", "varlen_mix_32k", "varlen_chat_16k"])
p.add_argument("--seqlen", type=int, default=0, help="override the dense configs' seqlen")
p.add_argument("--varlen-tokens", type=int, default=131072, help="packed configs: total tokens")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--iters", type=int, default=5)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--json")
a = p.parse_args()

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
torch.cuda.set_device(dev)
VARIANTS = {"groups=1": UlyssesTuning(max_chunks=1), "groups=2": UlyssesTuning(max_chunks=2, min_chunk_rows=0),
            "groups=4": UlyssesTuning(max_chunks=4, min_chunk_rows=0), "default": UlyssesTuning()}


def _case(cfg):
    """(call(tuning) -> out, local() -> out, grads to zero, a description)."""
    g = torch.Generator(dev).manual_seed(0)
    hkv = cfg.kv_heads or cfg.heads
    shape = lambda h: (cfg.batch * cfg.seqlen, h, cfg.head_dim) if cfg.kind == "varlen" else \
        (cfg.batch, cfg.seqlen, h, cfg.head_dim)
    full = [torch.randn(shape(h), generator=g, device=dev, dtype=torch.bfloat16) for h in (cfg.heads, hkv, hkv)]
    heads = HeadPlan(cfg.heads, hkv, world)
    (qa, qe), (ka, ke) = heads.q_heads(rank), heads.kv_heads(rank)
    if cfg.kind == "varlen":
        cu = varlen_cu_seqlens(cfg, dev)
        shards = [longattn.shard_varlen(x, cu, layout="contiguous")[0].requires_grad_() for x in full]
        loc = [x[:, a:e].contiguous().requires_grad_() for x, (a, e) in zip(full, [(qa, qe), (ka, ke), (ka, ke)])]
        call = lambda t: longattn.ulysses_attention_varlen(*shards, cu, causal=cfg.causal, tuning=t)
        local = lambda: longattn.attention_varlen(*loc, cu, causal=cfg.causal)
    else:
        shards = [longattn.shard(x).requires_grad_() for x in full]
        loc = [x[:, :, a:e].contiguous().requires_grad_() for x, (a, e) in zip(full, [(qa, qe), (ka, ke), (ka, ke)])]
        call = lambda t: longattn.ulysses_attention(*shards, causal=cfg.causal, window_size=cfg.window, tuning=t)
        local = lambda: longattn.attention(*loc, causal=cfg.causal, window_size=cfg.window)
    return call, local, shards + loc


def _timed(fn, leaves):
    def step():
        out = fn()
        out.backward(torch.ones_like(out))
    fwd = time_ms(fn, dev, warmup=a.warmup, iters=a.iters)
    both = time_ms(step, dev, warmup=a.warmup, iters=a.iters)
    for x in leaves:
        x.grad = None
    return fwd["median_ms"], both["median_ms"]


rows = []
for name in a.configs:
    cfg = C.get(name)
    if cfg.kind == "varlen":
        cfg = cfg.with_overrides(seqlen=a.varlen_tokens // cfg.batch)
    elif a.seqlen:
        cfg = cfg.with_overrides(seqlen=a.seqlen)
    call, local, leaves = _case(cfg)
    times = {v: [] for v in ["local", *VARIANTS]}
    for _ in range(a.rounds):
        times["local"].append(_timed(local, leaves))
        for v, t in VARIANTS.items():
            times[v].append(_timed(lambda: call(t), leaves))
    for v, ts in times.items():
        fwd = sorted(x[0] for x in ts)[len(ts) // 2]
        both = sorted(x[1] for x in ts)[len(ts) // 2]
        rows.append(dict(config=name, seqlen=cfg.seqlen, variant=v, fwd_ms=fwd, fwd_bwd_ms=both))
        if rank == 0:
            print(f"{name:24s} {v:9s} fwd {fwd:9.3f} ms  fwd+bwd {both:9.3f} ms", flush=True)
    call = local = leaves = None  # free this case before the next is made
    torch.cuda.empty_cache()

if rank == 0 and a.json:
    with open(a.json, "w") as f:
        json.dump(dict(kind="ulysses_pipeline_ab", env=environment(dev), world_size=world, results=rows), f,
                  indent=1)
dist.barrier()
dist.destroy_process_group()
