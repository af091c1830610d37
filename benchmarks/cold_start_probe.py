"""Cold versus queued timing of plain GPU work with no host overhead.

    python benchmarks/cold_start_probe.py [--json PATH]

A chain of bf16 matrix products (n launches of 4096^3, each ~0.1 ms on an
H100/H200) is issued in a fraction of its GPU time, so the host is never
what the GPU waits for. Cold timing (the GPU idle when the start event is
recorded) against queued timing (behind a GPU spin-wait) then isolates what
an idle GPU costs at the start of a call (clock ramp), per chain length.
"""
import argparse
import json
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
rows = []
for n in (1, 10, 70, 280):
    def chain():
        for _ in range(n):
            torch.mm(x, y)
    cold = measure.time_ms(chain, dev, warmup=5, iters=a.iters)
    queued = measure.time_ms(chain, dev, warmup=5, iters=a.iters, queued=True)
    rows.append(dict(launches=n, cold_ms=cold["median_ms"], queued_ms=queued["median_ms"], host_ms=cold["host_ms"],
                     cold_minus_queued_ms=cold["median_ms"] - queued["median_ms"]))
env = measure.environment(dev)
if a.json:
    measure.write_json(a.json, dict(kind="cold_start_probe", env=env, results=rows))
print(f"# {env['device']}")
print("| launches | host ms | cold ms | queued ms | cold - queued |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['launches']} | {r['host_ms']:.3f} | {r['cold_ms']:.3f} | {r['queued_ms']:.3f} | {r['cold_minus_queued_ms']:.3f} |")
