"""Three ways to time the same host-free GPU work, and what each measures.

    python benchmarks/cold_start_probe.py [--json PATH]

A chain of bf16 matrix products (n launches of 4096^3) is issued in a small
fraction of its GPU time, so the host is never what the GPU waits for. Timed
per product:

* cold: one chain per sample, the GPU idle (briefly) when the start event is
  recorded;
* batched: chains back to back between the events (``measure.time_ms``,
  ``batched=True``), the GPU never idle;
* rested: one chain per sample behind a GPU spin-wait twice as long plus 1 ms
  (a way to hide host time that rests the chip first).

If rested is faster than batched, resting before a measurement buys clock
headroom (power), and a benchmark must not do it.
"""
import argparse
import sys

import torch

sys.path.insert(0, ".")
from longattn.bench import measure  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--json")
p.add_argument("--iters", type=int, default=30)
a = p.parse_args()
dev = torch.device("cuda")
x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
y = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)


def cycles_per_ms():
    n = 2_000_000
    torch.cuda._sleep(n)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(n)
    e.record()
    e.synchronize()
    return n / s.elapsed_time(e)


def rested_ms(fn, gpu_ms, iters):
    lead = int((2 * gpu_ms + 1.0) * cycles_per_ms())
    times = []
    for _ in range(iters):
        torch.cuda._sleep(lead)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


rows = []
for n in (1, 10, 70, 280):
    def chain():
        for _ in range(n):
            torch.mm(x, y)
    cold = measure.time_ms(chain, dev, warmup=5, iters=a.iters)
    batched = measure.time_ms(chain, dev, warmup=5, iters=a.iters, batched=True)
    rested = rested_ms(chain, cold["median_ms"], a.iters)
    rows.append(dict(launches=n, host_ms=cold["host_ms"], cold_ms_per_mm=cold["median_ms"] / n,
                     batched_ms_per_mm=batched["median_ms"] / n, rested_ms_per_mm=rested / n,
                     batched_calls_per_sample=batched["calls_per_sample"]))
env = measure.environment(dev)
if a.json:
    measure.write_json(a.json, dict(kind="cold_start_probe", env=env, results=rows))
print(f"# {env['device']}: ms per 4096^3 bf16 product")
print("| launches | host ms (chain) | cold | batched | rested |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['launches']} | {r['host_ms']:.3f} | {r['cold_ms_per_mm']:.4f} | {r['batched_ms_per_mm']:.4f} | "
          f"{r['rested_ms_per_mm']:.4f} |")
