"""Which plans the exchange's shipping and engine fields give on the flex
configs, on CPU: for each config and world size, every ordered pair's block
table (FA4's blocks, as on sm_90, zigzag, H=16, D=128, batch 1) split into
heavy query blocks and needed key blocks under each value of
``FlexExchangeTuning.heavy_fraction``, ``heavy_min_blocks``, ``ship_ratio``
and ``ship_max_work`` (one field varied at a time from the library's
tuning); the tiles each pair's heavy blocks would move to the peer against
the peer's own (``ship_max_work``'s test); the most bytes a rank sends
against the ring's, and the ring's steps (``max_traffic``'s test: the
exchange runs where that ratio stays under max_traffic x the steps); and
the few-keys runs' shares of a rank's rows (``few_keys_share``'s test).
What it shows: the ranges of each field over which a config's plan stays
the library's, and which other plans exist (the variants worth timing on
GPUs: ``python -m longattn.bench dist ... --impl
flex-exchange:FIELD=VALUE``).

    python benchmarks/flex_exchange_sweep.py --config flex_swg_128k flex_doc_128k flex_prefix_128k \\
        flex_bsparse_128k --world 2 3 4 --json OUT.json
    python benchmarks/flex_exchange_sweep.py --config flex_swg_128k --pattern-args 8192,128 --world 2 4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch

from longattn import tuning as tn
from longattn.bench.__main__ import _numbers
from longattn.bench.configs import CONFIGS
from longattn.bench.measure import environment
from longattn.bench.patterns import flex_mask
from longattn.flex import blocks, exchange, pieces
from longattn.flex import plan as fp

SM90 = 9
VALUES = {
    "heavy_fraction": [0.0, 0.01, 0.02, 0.05, 0.1, 0.125, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99],
    "heavy_min_blocks": [1, 2, 4, 8, 16, 32, 64, 128, 256],
    "ship_ratio": [0.0, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 4.0, math.inf],
    "ship_max_work": [0.0, 0.01, 0.02, 0.05, 0.1, 0.125, 0.25, 0.5, 1.0, 2.0, math.inf],
}


def pair_tables(cfg, world: int) -> tuple:
    """{(r, s): block table of r's rows against s's keys}, rows per rank, query block, positions, mask, and
    the bytes per row (bf16)."""
    length, h, d = cfg.seqlen // world, cfg.heads, cfg.head_dim
    mask = flex_mask(cfg, torch.device("cpu"))
    pos = [fp.global_positions("zigzag", r, world, length) for r in range(world)]
    bq = blocks.sparse_block(SM90, length)[0]
    tables = {(r, s): fp.block_table(mask, 1, h, pos[r], pos[s], (bq, fp.BLOCK_SIZE))
              for r in range(world) for s in range(world)}
    q = torch.empty(1, 1, h, d, dtype=torch.bfloat16, device="meta")
    return tables, length, bq, pos, mask, exchange.RowBytes.of(q, q)


def plan_of(tables, world: int, length: int, bq: int, rb, tuning) -> dict:
    """Each pair's (heavy query blocks, needed key blocks) as the exchange splits them, every rank's bytes
    sent, the ring's per rank and its steps, the tiles each pair's candidate blocks would move to the peer
    against the peer's own (ship_max_work's test), and a signature of the whole plan."""
    own = [exchange.visible_tiles(tables[(r, r)]) for r in range(world)]
    split = {(r, s): exchange.split_pair(t, tuning, bq, rb, own[s]) for (r, s), t in tables.items() if r != s}
    moved = {}
    for (r, s), t in tables.items():
        if r != s:
            _, cnt, heavy = exchange.candidates(t, tuning)
            moved[f"{r}->{s}"] = int(cnt[heavy].sum()) / own[s]
    rows = {rs: (len(pieces.rows_of(hv, bq, length)), len(pieces.rows_of(kb, fp.BLOCK_SIZE, length)))
            for rs, (hv, kb) in split.items()}
    sent, need = [], 1
    peers = lambda r: (p for p in range(world) if p != r)
    for r in range(world):
        sent.append(rb.sent(sum(rows[(r, p)][0] for p in peers(r)), sum(rows[(p, r)][1] for p in peers(r)),
                            sum(rows[(p, r)][0] for p in peers(r)), sum(rows[(r, p)][1] for p in peers(r))))
        for p in peers(r):
            if rows[(r, p)][0] or rows[(r, p)][1]:
                need = max(need, (r - p) % world + 1)
    ring = rb.ring(need - 1, length)
    sig = tuple((rs, tuple(hv.tolist()), tuple(kb.tolist())) for rs, (hv, kb) in sorted(split.items()))
    return {"shipped_rows": sum(x[0] for x in rows.values()), "halo_keys": sum(x[1] for x in rows.values()),
            "max_sent": max(sent), "ring": ring, "ring_steps": need - 1, "ratio": max(sent) / ring if ring else None,
            "heavy_work_share": moved, "split": split, "sig": sig}


def few_shares(cfg, world: int, split: dict, length: int, bq: int, pos, mask) -> list:
    """Per rank, the few-keys runs' shares of its query blocks under the library's split of each pair (any
    share: the runs found with few_keys_share -> 0), or None where the rank has no few-keys keys or ships rows."""
    h = cfg.heads
    out = []
    for r in range(world):
        if any(len(split[(r, p)][0]) for p in range(world) if p != r):
            out.append(None)
            continue
        halo_pos = [pos[p][pieces.rows_of(split[(r, p)][1], fp.BLOCK_SIZE, length)] if p != r
                    else pos[r][:0] for p in range(world)]
        lens = [len(x) for x in halo_pos]
        offs = [sum(lens[:p]) for p in range(world + 1)]
        tabs = [fp.block_table(mask, 1, h, pos[r], halo_pos[p], (bq, fp.BLOCK_SIZE)) if n else None
                for p, n in enumerate(lens)]
        nqb = -(-length // bq)
        found = pieces._few_keys(tabs, lens, offs, nqb, tn.FLEX_EXCHANGE.few_keys, 1e-9)
        out.append(None if found is None else [(b1 - b0) / nqb for b0, b1 in found[3]])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", default=["flex_swg_128k", "flex_doc_128k", "flex_prefix_128k",
                                                   "flex_bsparse_128k"])
    p.add_argument("--world", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--pattern-args", type=_numbers, help="the configs' pattern parameters (as python -m "
                   "longattn.bench's --pattern-args)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = []
    lib = tn.FLEX_EXCHANGE
    print("| config | ranks | traffic / ring's | shipped rows | halo keys | heavy blocks' tiles / peer's own | "
          "heavy_fraction kept in | heavy_min_blocks kept in | ship_ratio kept in | ship_max_work kept in | "
          "other plans (field=value: traffic ratio) | few-keys run shares |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.config:
        cfg = CONFIGS[name].with_overrides(pattern_args=a.pattern_args)
        for world in a.world:
            t0 = time.time()
            tables, length, bq, pos, mask, rb = pair_tables(cfg, world)
            base = plan_of(tables, world, length, bq, rb, lib)
            keep = lambda res: {k: v for k, v in res.items() if k not in ("sig", "split")}
            row = {"config": name, "shape": cfg.describe(), "world": world, "library": keep(base),
                   "fields": {}}
            others = []
            for field, values in VALUES.items():
                per = []
                for val in values:
                    got = plan_of(tables, world, length, bq, rb,
                                  dataclasses.replace(lib, **{field: val}))
                    eq = got["sig"] == base["sig"]
                    per.append({"value": val, "same_plan": eq, **keep(got)})
                    if not eq and not any(o[2] == got["sig"] for o in others):
                        others.append((field, val, got["sig"], got["ratio"]))
                row["fields"][field] = per
            shares = few_shares(cfg, world, base["split"], length, bq, pos, mask)
            row["few_keys_run_shares"] = shares
            res.append(row)

            def kept(field):
                """The contiguous runs of the field's values that keep the library's plan."""
                runs, cur = [], []
                for x in row["fields"][field]:
                    if x["same_plan"]:
                        cur.append(x["value"])
                    elif cur:
                        runs.append(cur)
                        cur = []
                runs += [cur] if cur else []
                return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs) or "none"
            ratio = base["ratio"]
            oth = "; ".join(f"{f}={v}: {r:.3f}" if r is not None else f"{f}={v}: -" for f, v, _, r in others) or "-"
            sh = ", ".join("-" if s is None else "/".join(f"{x:.2f}" for x in s) for s in shares)
            mv = ", ".join(f"{k} {v:.3f}" for k, v in base["heavy_work_share"].items() if v) or "-"
            print(f"| {name} | {world} | {'-' if ratio is None else f'{ratio:.3f}'} | {base['shipped_rows']} | "
                  f"{base['halo_keys']} | {mv} | {kept('heavy_fraction')} | {kept('heavy_min_blocks')} | "
                  f"{kept('ship_ratio')} | {kept('ship_max_work')} | {oth} | {sh} |", flush=True)
            print(f"  ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    if a.json:
        env = environment(torch.device("cpu"), command=" ".join(["python", "benchmarks/flex_exchange_sweep.py",
                                                                 *(argv if argv is not None else sys.argv[1:])]))
        with open(a.json, "w") as f:
            json.dump({"kind": "flex_exchange_sweep", "env": env, "values": VALUES, "results": res}, f, indent=1,
                      default=lambda x: None if isinstance(x, float) and math.isinf(x) else x)


if __name__ == "__main__":
    main()
