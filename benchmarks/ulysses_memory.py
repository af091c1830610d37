"""What a Ulysses call keeps alive at its peak, in shards, on CPU (gloo,
spawned ranks; no GPU needed): prints the accounting of
:mod:`longattn.bench.ulysses_memory` (how it counts, and what a shard is,
is said there; tests/test_ulysses.py pins its numbers) for rank 0: per case
the peak of one forward and of one forward + backward, and what is live
then, by where it was made. ``--groups N`` forces N head groups instead of
the ones ``UlyssesTuning`` gives the case's GPU shape.

    PYTHONPATH=. python benchmarks/ulysses_memory.py [--cases ...] [--json FILE]

Against a GPU (``longattn.bench dist``'s peak, max_memory_allocated): the
peak here, or what is live at the end of the fullest local backward call
plus that kernel's own workspace W / groups, whichever is larger. W is not
seen here; on 2 x H200 at 128K (bf16, D=128, cuDNN dense, FlashAttention
varlen for short documents) the measured peaks of both exchange designs fit
W ~ 2.05 shards for dense MHA, ~8.1 for dense GQA 32q/8kv, ~0.7 for
per-document calls (varlen_mix_32k), ~8.5 for FlashAttention varlen GQA
(varlen_chat_16k).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import longattn  # noqa: E402
from longattn.bench.ulysses_memory import CASES, measure  # noqa: E402


def _run(rank, world, args, out_dir, report):
    torch.set_num_threads(1)
    dt = getattr(torch, args.dtype)
    rows = {}
    for name in args.cases:
        res, shard, n = measure(CASES[name], world, rank, args.seqlen, args.head_dim, dt, out_dir, args.groups)
        rows[name] = dict(groups=n, shard_bytes=shard, **res)
    if rank == 0:
        print(f"world {world}, S={args.seqlen} D={args.head_dim} {args.dtype}; longattn from "
              f"{os.path.dirname(longattn.__file__)}")
        for name, r in rows.items():
            for ph in ("fwd", "fwd+bwd"):
                x = r[ph]
                unseen = f" ({x['unseen_frees']:.2f} shards freed unseen by the profiler)" \
                    if x["unseen_frees"] >= 0.01 else ""
                print(f"\n{name} ({r['groups']} head group(s)) {ph}: peak {x['peak']:.2f} shards{unseen}; live:")
                for s, where in x["live"]:
                    print(f"  {s:5.2f}  {where}")
                if ph == "fwd+bwd":
                    print(f"  at the end of a local backward: {x['at_local_backward']:.2f} shards live:")
                    for s, where in x["live_at_local_backward"]:
                        print(f"  {s:5.2f}  {where}")
        if report:
            with open(report, "w") as f:
                json.dump(dict(world=world, seqlen=args.seqlen, head_dim=args.head_dim, dtype=args.dtype,
                               longattn=os.path.dirname(longattn.__file__), cases=rows), f, indent=1)


def main():
    from dist_utils import run_world

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=64, help="global tokens")
    p.add_argument("--head-dim", type=int, default=8192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--groups", type=int, default=0, help="force this many head groups (0: as on the GPU)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--json", default="")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_run, args.world, args, out_dir, args.json)


if __name__ == "__main__":
    main()
