"""Why ``backend="auto"`` passes over our Triton kernel on CPU: one block
forward (causal, window (32, 0), 4 query / 2 kv heads, D=16, float32) on
the math backend against the Triton kernel under ``TRITON_INTERPRET=1``,
the only way it runs on a CPU. Median of 3 calls after one warm-up.

    TRITON_INTERPRET=1 OMP_NUM_THREADS=2 python benchmarks/cpu_interpreter_cost.py [--json OUT.json]
"""
import argparse
import json
import statistics
import sys
import time

import torch

import longattn
from longattn import backends as bk
from longattn.bench import measure


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not longattn.kernels_available("cpu"):
        sys.exit("set TRITON_INTERPRET=1: without it the Triton kernel does not run on a CPU")
    spec = bk.BlockSpec(0.25, True, (32, 0))
    rows = []
    for s in a.seqlens:
        g = torch.Generator().manual_seed(0)
        q, k, v = torch.randn(1, s, 4, 16, generator=g), torch.randn(1, s, 2, 16, generator=g), torch.randn(1, s, 2, 16, generator=g)
        row = dict(seqlen=s, auto=bk.select_backend(q, k, spec).name)
        for name in ("math", "triton"):
            bk.block_forward(q, k, v, spec, name)
            times = []
            for _ in range(3):
                t = time.perf_counter()
                bk.block_forward(q, k, v, spec, name)
                times.append((time.perf_counter() - t) * 1e3)
            row[f"{name}_ms"] = statistics.median(times)
        row["triton_over_math"] = row["triton_ms"] / row["math_ms"]
        rows.append(row)
        print(f"{s:6d} tokens: math {row['math_ms']:.2f} ms, triton (interpreted) {row['triton_ms']:.1f} ms "
              f"({row['triton_over_math']:.0f}x); auto takes {row['auto']}")
    if a.json:
        env = measure.environment(torch.device("cpu"), "TRITON_INTERPRET=1 OMP_NUM_THREADS=2 python "
                                  "benchmarks/cpu_interpreter_cost.py")
        json.dump({"kind": "cpu_interpreter_cost", "env": env, "results": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
