"""Where a cold call's time goes beyond its kernels: one call of a bench row
(``CONFIG:IMPL``) under torch's profiler, forward + backward and the backward
alone (its graph kept, as ``bench run`` times it), on an idle GPU as the
cold timing starts it. Per row: when the first kernel starts (the host's work
before it), the end of the last, the kernels' summed time, every stretch of
more than 15 us in which no kernel runs after the first (the host behind the
GPU: a sync, small launches, an autograd or FA4 prologue) with the kernel
that ends it, and the host ops longer than 20 us before the first kernel.
The profiler slows the host, so its gaps are upper bounds of the unprofiled
ones; which stretch exists and where is what it shows.

    python benchmarks/cold_gaps.py --json OUT.json varlen_mix_32k:longattn-varlen flex_swg_32k:longattn-flex-fa4
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from longattn.bench import measure
from longattn.bench.configs import CONFIGS
from longattn.bench.impls import IMPLS
from longattn.bench.single import make_inputs

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def timeline(f) -> dict:
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        f()
        torch.cuda.synchronize()
    ev = sorted((e for e in p.events() if e.device_type == CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)
    cpu = [e for e in p.events() if e.device_type == CPU]
    t0 = min(e.time_range.start for e in cpu)
    ms = lambda us: round(us / 1e3, 3)
    kernels, gaps, end = [], [], None
    for e in ev:
        s, t = e.time_range.start, e.time_range.end
        if end is not None and s - end > 15:
            gaps.append((ms(end - t0), ms(s - end), e.name[:60]))
        kernels.append((e.name[:70], ms(s - t0), ms(t - s)))
        end = t if end is None else max(end, t)
    first = ev[0].time_range.start
    host = sorted({(e.name[:60], ms(e.time_range.start - t0), ms(e.time_range.elapsed_us())) for e in cpu
                   if e.time_range.start < first and e.time_range.elapsed_us() > 20}, key=lambda x: x[1])
    return dict(first_kernel_ms=ms(first - t0), end_ms=ms(end - t0),
                kernel_ms=ms(sum(e.time_range.elapsed_us() for e in ev)), gaps=gaps, kernels=kernels[:60],
                host_before_first=host[:30])


def row_call(row: str, dev):
    """(the bench row's function, its inputs (q, k, v, dout) in bf16, one
    fwd+bwd step that clears the gradients) of ``CONFIG:IMPL``."""
    name, impl = row.split(":")
    cfg = CONFIGS[name]
    fn = IMPLS[impl].build(cfg, dev)
    q, k, v = make_inputs(cfg, dev, torch.bfloat16, True)
    do = torch.randn_like(q)

    def step():
        fn(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None

    return fn, (q, k, v, do), step


def rows_args(doc: str, what: str) -> argparse.Namespace:
    """``rows`` (CONFIG:IMPL ...) and ``--json`` from the command line of a script whose docstring is ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", help="CONFIG:IMPL, as python -m longattn.bench list names them")
    ap.add_argument("--json", help=f"write the {what} here")
    return ap.parse_args()


def main() -> None:
    a = rows_args(__doc__, "timelines")
    dev = torch.device("cuda")
    res = {}
    for row in a.rows:
        name, impl = row.split(":")
        fn, (q, k, v, do), step = row_call(row, dev)
        graph = fn(q, k, v)

        def bwd():
            graph.backward(do, retain_graph=True)
            q.grad = k.grad = v.grad = None

        for what, f in (("fwd_bwd", step), ("bwd", bwd)):
            r = res[f"{row}:{what}"] = timeline(f)
            print(f"{name:18s} {impl:20s} {what:7s} first kernel {r['first_kernel_ms']:.3f} end {r['end_ms']:.3f} "
                  f"kernels {r['kernel_ms']:.3f} ms; gaps (at, ms) {[g[:2] for g in r['gaps']][:6]}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"kind": "cold_gaps", "env": measure.environment(dev, "python benchmarks/cold_gaps.py " +
                                                                        " ".join(a.rows)), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
