"""Host time of loading a replayed pass's inputs: one ``copy_`` per input
against one ``torch._foreach_copy_`` (LongNet 8K, 16 heads, D=128, bf16: a
forward's q/k/v, a backward's dout/q/k/v/out and float32 lse), each call
issued with the GPU idle, median of 200, the two alternated twice.

    python benchmarks/graph_copy_ab.py

Writes $OUT/graph_copy_ab.json (or --json).
"""
import argparse
import os
import statistics
import sys
import time

import torch

from longattn.bench.measure import environment, write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "graph_copy_ab.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    big, lse = ((1, 8192, 16, 128), torch.bfloat16), ((1, 16, 8192), torch.float32)
    res = {}
    for name, shapes in (("fwd_3_inputs", [big] * 3), ("bwd_6_inputs", [big] * 5 + [lse])):
        dst, src = ([torch.randn(*s, device=dev, dtype=dt) for s, dt in shapes] for _ in range(2))

        def loop():
            for d, s in zip(dst, src):
                d.copy_(s)

        for i, (variant, fn) in enumerate([("copy_", loop), ("foreach", lambda: torch._foreach_copy_(dst, src))] * 2):
            ts = []
            for _ in range(200):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e6)
            res.setdefault(f"{name}_{variant}_us", []).append(statistics.median(ts))
    cmd = " ".join(["python", "benchmarks/graph_copy_ab.py", *sys.argv[1:]])
    write_json(a.json, dict(env=environment(dev, command=cmd), command=cmd, host_us=res))
    for k, v in res.items():
        print(f"{k:>26}: " + " / ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
