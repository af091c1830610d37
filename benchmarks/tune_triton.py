"""Small, time-boxed sweep of Triton launch configs (bf16, H=16) on the dense
16K and LongNet 32K cases; streams each row to $OUT/tune_triton.jsonl and
prints the best per kernel. TUNE_BUDGET_S bounds the wall time."""
import json
import os
import time

import torch
import triton

import longattn
from longattn.kernels import triton_attention as ta

dev = "cuda"
d = int(os.environ.get("TUNE_D", "128"))
budget = float(os.environ.get("TUNE_BUDGET_S", "150"))
t_end = time.time() + budget
out = open(os.path.join(os.environ.get("OUT", "."), "tune_triton.jsonl"), "a")
segs, rates = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)
qd = torch.randn(1, 16384, 16, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
qs = torch.randn(1, 32768, 16, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
cases = {"dense": (qd, lambda q: longattn.attention(q, q, q, backend="triton")),
         "dilated": (qs, lambda q: longattn.dilated_attention(q, q, q, segment_lengths=segs, dilation_rates=rates,
                                                              backend="triton"))}
C = lambda m, n, w, s: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
sweep = {
    "fwd": [C(128, 64, 8, 3), C(128, 128, 8, 3), C(128, 64, 4, 3), C(64, 64, 4, 3), C(128, 32, 4, 4)],
    "dkdv": [C(32, 128, 4, 3), C(64, 128, 8, 3), C(64, 64, 4, 3), C(32, 64, 4, 3), C(64, 128, 8, 2)],
    "dq": [C(128, 32, 4, 3), C(128, 64, 8, 3), C(64, 64, 4, 3), C(64, 32, 4, 3), C(128, 32, 8, 2)],
}
best = {}
for kind, cfgs in sweep.items():
    default = dict(ta._TUNED[(kind, d)])
    for cfg in cfgs:
        if time.time() > t_end:
            break
        ta._TUNED[(kind, d)] = dict(cfg)
        row = dict(kind=kind, d=d, **cfg)
        for name, (q, fn) in cases.items():
            try:
                if kind == "fwd":
                    with torch.no_grad():
                        row[name] = triton.testing.do_bench(lambda: fn(q), warmup=20, rep=100, return_mode="median")
                else:
                    o = fn(q)
                    do = torch.randn_like(o)
                    row[name] = triton.testing.do_bench(lambda: torch.autograd.grad(o, q, do, retain_graph=True),
                                                        warmup=20, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001
                row[name + "_error"] = repr(e)[:160]
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(row, flush=True)
        score = row.get("dilated", 1e9) + row.get("dense", 1e9)
        if score < best.get(kind, (1e18, None))[0]:
            best[kind] = (score, cfg)
    ta._TUNED[(kind, d)] = dict(best.get(kind, (0, default))[1])
print("BEST", {k: v[1] for k, v in best.items()}, flush=True)
