"""What ``ring_flex_attention`` keeps alive at its peak, in shards, on CPU
(gloo, spawned ranks; no GPU needed): prints the accounting of
:mod:`longattn.bench.flex_ring_memory` (how it counts, how it models the
copy and NCCL transports, and what a shard is, is said there;
tests/test_flex_ring.py pins its numbers) for rank 0: per transport and
pattern the peak of one forward and of one forward + backward, and what is
live then, by where it was made.

    PYTHONPATH=. python benchmarks/flex_ring_memory.py --world 2 [--json FILE]

Against a GPU (``longattn.bench dist``'s ``peak_mem_fwd_bwd_bytes``, the
slots included): shards x the bench's shard (batch x seqlen/p x heads x
headdim x 2 bytes in bf16; 256 MiB for the 128K flex configs at 2 ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from longattn.bench.flex_ring_memory import measure  # noqa: E402


def _run(rank, world, args, out_dir):
    torch.set_num_threads(1)
    report = {}
    for tname in args.transports:
        for name in args.patterns:
            res, shard = measure(name, world, rank, args.seqlen, args.heads, args.head_dim,
                                 getattr(torch, args.dtype), args.layout, tname, out_dir)
            report[f"{tname} {name}"] = res
    if rank == 0:
        print(f"world {world}, {args.layout}, B=1 S={args.seqlen} H={args.heads} D={args.head_dim} {args.dtype}; "
              f"1 shard = {shard / 2**20:.2f} MiB")
        for name, res in report.items():
            for phase, r in res.items():
                print(f"\n{name} {phase}: peak {r['peak']:.2f} shards; live at the peak:")
                for s, site in r["live"]:
                    print(f"  {s:6.2f}  {site}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(world=world, shard_bytes=shard, report=report), f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=512, help="global sequence length")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--patterns", nargs="+", default=["local_global", "causal_documents"])
    p.add_argument("--transports", nargs="+", default=["copy", "nccl"], choices=["copy", "nccl"],
                   help="the exchange whose memory is modelled (longattn.bench.flex_ring_memory)")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args()
    from dist_utils import run_world

    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_run, args.world, args, out_dir)


if __name__ == "__main__":
    main()
