"""The flex exchange's attention work per rank, from its plans, on CPU: the
tiles (FA4's 128 x 128 blocks, partial and full) each rank's pieces compute,
their calls and the rows their backward's per-call passes read, against one
GPU's tiles divided by the ranks. What a rank computes beyond its share is
work the ranks do not split; the rest of the gap between a rank's GPU time
and one GPU's time / world is per-call and per-merge cost (measured in
``flex_exchange_profile.py``).

Plans are built as on sm_90 (FA4's blocks), zigzag, H=16, D=128, batch 1:

    python benchmarks/flex_exchange_work.py --config flex_swg_128k flex_doc_128k --world 2 4 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from longattn import tuning as tn
from longattn.bench.configs import CONFIGS
from longattn.bench.measure import environment
from longattn.bench.patterns import flex_mask
from longattn.flex import blocks, exchange, fa4, pieces
from longattn.flex import plan as fp

SM90 = 9


def _tiles(run) -> tuple[int, int]:
    """(partial, full) tiles per head of an executor's calls (its whole table where it runs on views)."""
    step = run.whole if isinstance(run, fa4.SplitStep) else run.step
    t = step.table
    hm = t.partial.shape[1]  # 1: one table broadcast over the heads
    return int(t.partial.sum()) / hm, int(t.full.sum()) / hm


def _doc_tiles(run: pieces.DocumentsStep, bq: int) -> tuple[int, int]:
    """Tiles of FA4's causal varlen kernel over the documents (diagonal tiles partial)."""
    lens = (run.cu[1:] - run.cu[:-1]).tolist()
    part = full = 0
    for n in lens:
        nb = -(-n // bq)
        part += nb
        full += nb * (nb - 1) // 2
    return part, full


def rank_work(cfg, world: int, rank: int) -> dict:
    s, h, d = cfg.seqlen, cfg.heads, cfg.head_dim
    q = torch.empty(1, s // world, h, d, dtype=torch.bfloat16)
    mask = flex_mask(cfg, q.device)
    plan, (sent, _, nship, nhalo) = exchange._build(q, q, mask, "zigzag", d ** -0.5, rank, world, SM90,
                                                    tn.FLEX_EXCHANGE)
    bq = blocks.sparse_block(SM90, s // world)[0]
    rows = s // world
    out = {"rank": rank, "pieces": []}
    named = ([("own", plan.own, 0, rows)] if plan.own is not None else []) + \
        [("halo", x.run, x.r0, x.r1) for x in plan.halo] + \
        ([("serve", plan.serve, 0, sum(len(x) for x in plan.q_in))] if plan.serve is not None else [])
    for name, run, r0, r1 in named:
        part, full = _doc_tiles(run, bq) if isinstance(run, pieces.DocumentsStep) else _tiles(run)
        out["pieces"].append({"piece": name, "kind": type(run).__name__, "rows": r1 - r0, "partial": part,
                              "full": full})
    out["tiles"] = sum(p["partial"] + p["full"] for p in out["pieces"])
    out["calls"] = len(out["pieces"])
    out["rows_read_by_calls"] = sum(p["rows"] for p in out["pieces"])
    out["bytes_sent"] = sent
    out["rows_shipped"], out["halo_keys"] = nship, nhalo
    return out


def one_gpu_tiles(cfg) -> int:
    pos = torch.arange(cfg.seqlen, dtype=torch.int32)
    t = fp.block_table(flex_mask(cfg, pos.device), 1, cfg.heads, pos, pos, (128, 128))
    return (int(t.partial.sum()) + int(t.full.sum())) / t.partial.shape[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["flex_swg_128k", "flex_doc_128k"])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = []
    print("| config | ranks | rank | pieces (kind: rows, tiles) | tiles / one GPU's share | rows read by calls / rank's rows |")
    print("|---|---|---|---|---|---|")
    for name in a.config:
        cfg = CONFIGS[name]
        one = one_gpu_tiles(cfg)
        for world in a.world:
            for rank in range(world):
                r = rank_work(cfg, world, rank)
                r.update(config=name, world=world, one_gpu_tiles=one, share=r["tiles"] / (one / world))
                res.append(r)
                desc = ", ".join(f"{x['piece']} {x['kind']}: {x['rows']}, {x['partial'] + x['full']:.0f}"
                                 for x in r["pieces"])
                print(f"| {name} | {world} | {rank} | {desc} | {r['share']:.3f} | "
                      f"{r['rows_read_by_calls'] / (cfg.seqlen // world):.2f} |", flush=True)
    if a.json:
        env = environment(torch.device("cpu"), command=" ".join(["python", "benchmarks/flex_exchange_work.py",
                                                                 *(argv if argv is not None else sys.argv[1:])]))
        with open(a.json, "w") as f:
            json.dump({"kind": "flex_exchange_work", "env": env, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
