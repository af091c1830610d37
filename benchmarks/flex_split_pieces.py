"""The flex exchange's pieces with one long side on FA4, as one call and as
views of that side in batch rows (``longattn.flex.fa4.SplitStep``): forward
and backward ms (CUDA events, median after warm-up) and the bf16 difference
between the two (outputs, lse, gradients), for the measurement behind
``FlexExchangeTuning.split_chain`` / ``split_programs`` / ``split_min_blocks``.

Shapes (window ±1024 + 128 global tokens, H=16, D=128, bf16, batch 1; a 2-rank
contiguous shard of 64K tokens):

* ``serve``: the 128 global rows against a shard's 64K keys (one query tile
  per head: the keys are split);
* ``halo``: a shard's 64K rows against the global keys and the window's
  edge (1152 keys, 9 key tiles per kv head: the rows are split).

    python benchmarks/flex_split_pieces.py --json OUT.json [--c 2 4 8 16 32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from longattn import masks, tuning
from longattn.bench import measure
from longattn.flex import blocks, fa4, pieces
from longattn.flex import plan as fp


def _time(fn) -> float:
    return measure.time_ms(fn, torch.device("cuda"), warmup=3, iters=15)["median_ms"]


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(a) & torch.isfinite(b)
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))


def run(name, qpos, kpos, cs, heads=16, kv_heads=16, d=128):
    dev = qpos.device
    mask = masks.local_global(1024, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, len(qpos), heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, len(kpos), kv_heads, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
    do = torch.randn_like(q)
    cap = fa4.KERNEL.capability(dev)[0]
    scale = d ** -0.5
    table = fp.block_table(mask, 1, heads, qpos, kpos, blocks.sparse_block(cap, len(qpos)))
    auto = pieces.split_for(table, len(qpos), len(kpos), 1, heads, kv_heads, cap, tuning.FLEX_EXCHANGE)
    rows, base = [], None
    for c in [None] + cs:
        split = None if c is None else (c, auto[1] if auto else ("keys" if len(qpos) < len(kpos) else "rows"))
        run_ = pieces.executor(mask, qpos, kpos, 1, heads, scale, cap, split=lambda *_, s=split: s)
        out, lse = run_.forward(q, k, v)
        grads = run_.backward(do, q, k, v, out, lse, None)
        fwd = _time(lambda: run_.forward(q, k, v))
        bwd = _time(lambda: run_.backward(do, q, k, v, out, lse, None))
        row = {"piece": name, "rows": len(qpos), "keys": len(kpos), "split": split, "auto": split == auto,
               "fwd_ms": fwd, "bwd_ms": bwd}
        if base is None:
            base = (out, lse, grads)
        else:
            row["rel_diff"] = {"out": _rel(out, base[0]), "lse": _rel(lse, base[1]),
                               **{n: _rel(x, y) for n, x, y in zip(("dq", "dk", "dv"), grads, base[2])}}
        rows.append(row)
        print(f"{name:6s} split={str(split):16s} fwd {fwd:7.3f} bwd {bwd:7.3f} ms"
              + (f"  max rel diff {max(row['rel_diff'].values()):.2e}" if 'rel_diff' in row else ""), flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--c", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    shard = torch.arange(65536, 131072, dtype=torch.int32, device=dev)
    rows = run("serve", torch.arange(128, dtype=torch.int32, device=dev), shard, a.c)
    halo = torch.cat([torch.arange(128, dtype=torch.int32, device=dev),
                      torch.arange(65536 - 1024, 65536, dtype=torch.int32, device=dev)])
    rows += run("halo", shard, halo, [c for c in a.c if c <= 32])
    if a.json:
        env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "commit": os.environ.get("LONGATTN_COMMIT", ""), "command": " ".join(["python"] + sys.argv)}
        json.dump({"kind": "flex_split_pieces", "env": env, "results": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
