"""Where a one-GPU flex call replayed from CUDA graphs spends GPU time that
the eager call does not: the call as planned (``longattn.flex.pieces.single_executor``,
forward + backward through ``fa4.Fa4Flex``) eagerly and with its passes
replayed from graphs (``FlexFa4Tuning.graph_max_tokens``), alternated twice;
per variant the GPU time after a 20 ms GPU sleep queued first (the host's
work hidden; median of 10) and the kernels of 3 steps under torch's profiler,
summed per name per step. The graphs' extra kernels are the copies of the
inputs in and the outputs out (32K x 16 heads x 128: 128 MiB per tensor).

    python benchmarks/flex_graph_kernels.py --json OUT.json flex_bsparse_32k flex_swg_32k
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from longattn.bench import measure
from longattn.bench.configs import CONFIGS
from longattn.bench.patterns import flex_fa4_step

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from host_bound import _events  # noqa: E402


def kernels(step) -> tuple[list, float]:
    """(name, launches, µs) per step over 3 steps, longest first; their summed µs per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:110]]
            a[0] += 1
            a[1] += e.device_time_total
    rows = sorted(((n, c / 3, t / 3) for n, (c, t) in agg.items()), key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    out = {}
    for name in a.configs:
        run, call = flex_fa4_step(CONFIGS[name], dev)
        res = {"executor": type(run).__name__}
        for label, graphed in (("eager", False), ("graphed", True), ("eager2", False), ("graphed2", True)):
            def step(graphed=graphed):
                call(graphed)
            for _ in range(4):  # the graphed variant's first call runs eagerly, its second captures
                step()
            gpu = _events(step, n=10, sleep_cycles=int(2e7))["gpu_ms"]
            rows, total = kernels(step)
            res[label] = {"after_sleep_ms": gpu, "kernels_us_per_call": rows[:25], "kernel_sum_us": total}
            print(f"{name} {label}: gpu {gpu:.3f} ms, kernel sum {total / 1e3:.3f} ms", flush=True)
            for n, c, t in rows[:12]:
                print(f"    {t:9.1f} us x{c:4.1f}  {n}")
        out[name] = res
    if a.json:
        measure.write_json(measure.result_path(a.json), {
            "kind": "flex_graph_kernels",
            "env": measure.environment(dev, " ".join(["python", "benchmarks/flex_graph_kernels.py", *a.configs])),
            "results": out})


if __name__ == "__main__":
    main()
