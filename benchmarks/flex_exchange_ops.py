"""The flex exchange's own host work: the PyTorch ops ring_flex_attention's
exchange engine dispatches per forward + backward outside its executors (the
attention pieces replaced by stand-ins that return zeros), counted on CPU
with gloo in spawned processes. On a GPU each op is host time (a launch, or
at least a dispatch) that the exchange adds to its pieces' FA4 calls; the
4-GPU exchange is host-bound (docs/performance.md, section 8).

Window ±(rows/16) + 128 global tokens, zigzag, one batch row, bf16:

    python benchmarks/flex_exchange_ops.py --world 2 4 --rows 4096 --heads 2 --json OUT.json
    python benchmarks/flex_exchange_ops.py --tune join_halo=1   # under another FlexExchangeTuning

Prints, per world size, the ops dispatched, those that copy or launch a
kernel of their own, and the source lines that dispatch the most.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KERNELS = ("copy", "clone", "cat", "index", "zeros", "full", "_to_copy", "add", "sub", "mul", "where", "exp",
           "sigmoid", "maximum", "minimum", "lerp", "nan_to_num", "logsumexp", "sum", "stack")


class _Zeros:
    """An executor that returns zeros of the right shapes (its attention is not what is counted)."""

    def forward(self, q, k, v):
        b, n, h, _ = q.shape
        return torch.zeros(b, n, h, v.shape[-1], dtype=q.dtype), torch.zeros(b, h, n)

    def backward(self, dout, q, k, v, out, lse, dlse):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _count(rank, world, rows, heads, port, out_dir, tune=()):
    from torch.utils._python_dispatch import TorchDispatchMode

    from longattn import masks, tuning
    from longattn.flex import exchange, pieces
    from longattn.flex.exchange_run import ExchangeFlex

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    q = torch.randn(1, rows, heads, 16, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    plan = exchange.plan_for(q, k, masks.local_global(rows // 16, 128), None, "zigzag", 0.25, dist.group.WORLD,
                             "auto", "exchange", tuning.FlexExchangeTuning(**dict(tune)))
    if isinstance(plan.own, pieces.JoinedKeys):  # its concatenations are the exchange's work: kept
        plan.own.run = _Zeros()
    else:
        plan.own = _Zeros() if plan.own is not None else None
    plan.serve = _Zeros() if plan.serve is not None else None
    for x in plan.halo:
        x.run = _Zeros()
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))

    def step():
        o, _ = ExchangeFlex.apply(qs, ks, vs, plan, dist.group.WORLD)
        o.backward(torch.ones_like(o))
    step()
    lines, kinds = collections.Counter(), collections.Counter()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            frames = [f for f in traceback.extract_stack() if "longattn" in f.filename
                      and "_python_dispatch" not in f.filename]
            f = frames[-1] if frames else None
            lines[f"{os.path.relpath(f.filename, here)}:{f.lineno} ({f.name})" if f else "other"] += 1
            kinds[str(func)] += 1
            return func(*args, **(kwargs or {}))
    with Count():
        step()
    res = {"world": world, "rank": rank, "rows": rows, "heads": heads, "tune": dict(tune), "ops": sum(kinds.values()),
           "kernel_ops": sum(n for k_, n in kinds.items() if any(x in k_ for x in KERNELS)),
           "halo_pieces": len(plan.halo), "serve": plan.serve is not None,
           "top_lines": lines.most_common(12), "kinds": dict(kinds.most_common())}
    json.dump(res, open(os.path.join(out_dir, f"{world}_{rank}.json"), "w"))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rows", type=int, default=4096, help="tokens per rank")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--tune", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="FlexExchangeTuning fields, e.g. join_halo=1 (bool fields 0/1)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    from longattn import tuning
    types = {f.name: f.type for f in dataclasses.fields(tuning.FlexExchangeTuning)}
    conv = {"bool": lambda x: bool(int(x)), "int": int, "float": float}
    tune = tuple((f, conv[types[f]](x)) for f, x in (kv.split("=", 1) for kv in a.tune))
    results = []
    with tempfile.TemporaryDirectory() as d:
        for world in a.world:
            mp.spawn(_count, args=(world, a.rows, a.heads, _port(), d, tune), nprocs=world)
            per_rank = [json.load(open(os.path.join(d, f"{world}_{r}.json"))) for r in range(world)]
            results += per_rank
            worst = max(per_rank, key=lambda r: r["ops"])
            print(f"world {world}: ops per fwd+bwd {min(r['ops'] for r in per_rank)}-{worst['ops']}, "
                  f"of which copy / launch {min(r['kernel_ops'] for r in per_rank)}-{worst['kernel_ops']}; "
                  f"rank {worst['rank']}'s top lines:")
            for line, n in worst["top_lines"][:6]:
                print(f"  {n:4d} {line}")
    if a.json:
        import subprocess
        commit = os.environ.get("LONGATTN_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        env = {"device": "cpu (gloo)", "torch": torch.__version__, "commit": commit,
               "command": " ".join(["python"] + sys.argv)}
        json.dump({"kind": "flex_exchange_ops", "env": env, "results": results}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
