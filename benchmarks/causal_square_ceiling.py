"""How fast can any kernel run the parts causal dilated attention is made of?

    python benchmarks/causal_square_ceiling.py

Every branch of the LongNet config (segment w, rate r, w / r = 2048) is a
stack of 2048-row attention squares; with ``causal=True`` each is a causal
square. The issue's yardstick is dense attention at the full length (causal
at 128K: a negligible share of diagonal tiles). This times, on one GPU, in
bf16, B x H = 64 x 16 stacked 2048-row squares (one branch at 128K tokens)
against dense attention on 128K tokens, causal and not, through each local
backend that runs them (cuDNN, flash, our Triton kernel), fwd and bwd
(CUDA-event medians, triton.testing.do_bench). Useful TF/s count only the
computed pairs (half for causal, flash-attn's convention). The ratio
square / dense of the cuDNN causal rows is the ceiling of every path built
on cuDNN calls (the dilated path adds merges and strided access on top).
Writes $OUT/causal_square_ceiling.json; a table last.
"""
import json
import os

import torch
import triton

import longattn
from longattn.bench.measure import environment

dev = torch.device("cuda")
bench = lambda f: triton.testing.do_bench(f, warmup=3, rep=60, return_mode="median")
H, S_DENSE, SQ = 16, 131072, 2048


def run(b, s, d, causal, backend):
    q, k, v = (torch.randn(b, s, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, s, H, d, device=dev, dtype=torch.bfloat16)
    fwd = lambda: longattn.attention(q, k, v, causal=causal, backend=backend)
    try:
        t_f = bench(fwd)
        t_fb = bench(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
    except Exception as e:  # a backend that refuses the shape: recorded, not hidden
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    flops = 4 * b * H * s * s * d * (0.5 if causal else 1.0)
    t_b = t_fb - t_f
    return {"fwd_ms": t_f, "bwd_ms": t_b, "fwd_tflops": flops / t_f / 1e9, "bwd_tflops": 2.5 * flops / t_b / 1e9}


rows = []
for d in (128, 64):
    for causal in (True, False):
        dense = run(1, S_DENSE, d, causal, "cudnn")
        rows.append(dict(d=d, causal=causal, shape="dense 128K", backend="cudnn", **dense))
        for backend in ("cudnn", "flash", "triton"):
            r = run(S_DENSE // SQ, SQ, d, causal, backend)
            if "error" not in r and "error" not in dense:
                r["x_dense_fwd"] = r["fwd_tflops"] / dense["fwd_tflops"]
                r["x_dense_bwd"] = r["bwd_tflops"] / dense["bwd_tflops"]
            rows.append(dict(d=d, causal=causal, shape="64 x 2048 squares", backend=backend, **r))
        torch.cuda.empty_cache()

out = {"env": environment(dev), "command": "python benchmarks/causal_square_ceiling.py", "rows": rows}
path = os.path.join(os.environ.get("OUT", "."), "causal_square_ceiling.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print("| D | causal | shape | backend | fwd ms | bwd ms | TF/s fwd / bwd | x dense cuDNN fwd / bwd |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f"| {r['d']} | {r['causal']} | {r['shape']} | {r['backend']} | {r['error']} |")
        continue
    x = f"{r['x_dense_fwd']:.2f} / {r['x_dense_bwd']:.2f}" if "x_dense_fwd" in r else "-"
    print(f"| {r['d']} | {r['causal']} | {r['shape']} | {r['backend']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
          f"{r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} | {x} |")
