"""Summing gradient rows at listed positions into a float32 accumulator, as
the flex exchange's ``GradSum`` does for returned halo gradients: ``index_add_``
along dim 1 of (B, n, H, D) against ``index_put_`` with accumulate per batch
row (``exchange_run._add_at``), CUDA events, median of ``--iters``.

    python benchmarks/row_sums_ab.py --rows 32768 --positions 2048 4096 --json OUT.json
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from longattn.bench.measure import environment, write_json


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--positions", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for n in a.positions:
        acc = torch.zeros(1, a.rows, a.heads, a.head_dim, device=dev)
        pos = torch.randperm(a.rows, device=dev)[:n].sort().values
        x = torch.randn(1, n, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16)
        add = timed(lambda: acc.index_add_(1, pos, x.float()), a.iters)
        put = timed(lambda: acc[0].index_put_((pos,), x[0].float(), accumulate=True), a.iters)
        rows.append(dict(positions=n, index_add_ms=add, index_put_ms=put))
        print(f"{n} positions x {a.heads * a.head_dim} values: index_add_ {add:.3f} ms, index_put_ {put:.3f} ms")
    if a.json:
        write_json(a.json, dict(benchmark="row_sums_ab", env=environment(dev, "python " + " ".join(sys.argv)),
                                args=vars(a), rows=rows))


if __name__ == "__main__":
    main()
