"""Sweep Triton launch configs for the dense and dilated kernels (fwd, bwd)
on one GPU; print the best per (kind, head dim) and write JSON to $OUT."""
import itertools
import json
import os
import sys

import torch
import triton

import longattn
from longattn.kernels import triton_attention as ta

dev = "cuda"
res = []
S_DENSE, S_DIL = 16384, 32768
segs, rates = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def cases(d):
    qd = torch.randn(1, S_DENSE, 16, d, device=dev, dtype=torch.bfloat16)
    qs = torch.randn(1, S_DIL, 16, d, device=dev, dtype=torch.bfloat16)
    return qd, qs


fwd_cfgs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)) if not (m == 64 and w == 8)]
bwd_cfgs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
            for (m, n), w, s in itertools.product(((32, 64), (64, 64), (64, 128), (128, 128)), (4, 8), (1, 2))]
for d in [int(x) for x in os.environ.get("TUNE_D", "128").split(",")]:
    qd, qs = cases(d)
    dod, dos = torch.randn_like(qd), torch.randn_like(qs)
    for kind, cfgs in (("fwd", fwd_cfgs), ("bwd", bwd_cfgs)):
        best = {}
        for cfg in cfgs:
            ta._TUNED[(kind, d)] = dict(cfg)
            row = dict(kind=kind, d=d, **cfg)
            try:
                for name, q, do, fn in (
                        ("dense", qd, dod, lambda q: longattn.attention(q, q, q, backend="triton")),
                        ("dense_causal", qd, dod, lambda q: longattn.attention(q, q, q, causal=True, backend="triton")),
                        ("dilated", qs, dos, lambda q: longattn.dilated_attention(q, q, q, segment_lengths=segs,
                                                                                  dilation_rates=rates, backend="triton"))):
                    if kind == "fwd":
                        with torch.no_grad():
                            row[name] = bench(lambda: fn(q))
                    else:
                        qg = q.detach().requires_grad_()
                        out = fn(qg)
                        row[name] = bench(lambda: torch.autograd.grad(out, qg, do, retain_graph=True))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:200]
            res.append(row)
            print(row, flush=True)
    torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, "tune_triton.json"), "w"), indent=1)
print("\nBEST (by dilated, then dense):")
for kind in ("fwd", "bwd"):
    for d in sorted({r["d"] for r in res}):
        ok = [r for r in res if r["kind"] == kind and r["d"] == d and "error" not in r]
        for key in ("dilated", "dense", "dense_causal"):
            b = min(ok, key=lambda r: r[key])
            print(kind, d, key, f"{b[key]:.3f} ms", {k: b[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")})
