"""Host (Python) time of one dilated-attention views-path forward, the kernels
stubbed out: what the CPU spends on planning, strided views and calls before
any GPU work. Short sequences (32K) are bound by it on H200
(docs/performance.md §2).

    python benchmarks/dilated_host_time.py [--seqlen 32768]

Runs on the CPU (no GPU needed): the local backend returns empty tensors, the
merge and the gathers do nothing, so only our host code is timed.
"""
import argparse
import time

import torch

import longattn.dilated as dil
from longattn import backends as bk
from longattn.kernels import triton_merge

p = argparse.ArgumentParser()
p.add_argument("--seqlen", type=int, default=32768)
p.add_argument("--iters", type=int, default=200)
args = p.parse_args()


class _Stub:
    def forward(self, q, k, v, spec):
        n, m, h, d = q.shape
        return torch.empty(n, m, h, d, dtype=q.dtype), torch.empty(n, h, m)


stub = _Stub()
bk.select_backend = lambda *a, **k: stub
dil.merge_into = lambda *a, **k: None
dil._gather_views = lambda *xs: [x.new_empty(x.shape).view(-1, *x.shape[2:]) for x in xs]  # copies stubbed too
triton_merge.usable = lambda x: True  # the output-dtype accumulator, as on CUDA
q = torch.randn(1, args.seqlen, 16, 8, dtype=torch.bfloat16)  # tiny head dim: copies cost nothing
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
run = lambda: dil.forward(q, q, q, segs, rates, False, 0.1, "math")
for _ in range(3):
    run()
t = time.perf_counter()
for _ in range(args.iters):
    run()
print(f"host ms per forward (S={args.seqlen}, LongNet config, kernels stubbed): "
      f"{(time.perf_counter() - t) / args.iters * 1e3:.3f}")
