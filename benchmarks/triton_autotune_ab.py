"""In-process A/B of the fused Triton dilated kernels' settings: the static
tile table (``DilatedTuning(autotune="0")``) against per-shape autotuning (the
default on CUDA), eager and under torch.compile (Inductor compiles the kernels
of the triton_op pair); the schedules: grouped where branches nest (default),
one launch per branch with a rate-1 branch writing first (``per_branch``), or
merging into zero-filled buffers (``zero_fill``); beside dense cuDNN at the
same length. bf16, B=1, H=16.
Forward and forward+backward times are medians of CUDA-event timings after
warm-up, the variants alternating over --rounds (clocks drift between them);
the first call's wall time (compiles, and tuning where on) is reported.

    python benchmarks/triton_autotune_ab.py --json out.json
"""
import argparse
import json
import statistics
import time

import torch

import longattn
from longattn import dilated
from longattn.bench.measure import environment, time_ms
from longattn.kernels.autotune import default_tuner
from longattn.tuning import DilatedTuning

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=10)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--cases", nargs="*", help="case names (default: all)")
p.add_argument("--json")
p.add_argument("--compile", action="store_true", help="also time the fused ops under torch.compile")
p.add_argument("--variants", nargs="*", default=["static", "autotuned", "per_branch", "dense_cudnn"],
               help="static, autotuned, per_branch, zero_fill (autotuned; per-branch launches), static_per_branch, "
                    "static_grouped, static_zero_fill, dense_cudnn")
a = p.parse_args()
LONGNET = ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16])
SHORT = ([256, 512, 1024], [1, 2, 4])
CASES = [  # name, seqlen, hkv, head dim, (segments, rates), causal
    ("longnet_32k", 32768, 16, 128, LONGNET, False),
    ("longnet_32k_causal", 32768, 16, 128, LONGNET, True),
    ("longnet_128k", 131072, 16, 128, LONGNET, False),
    ("longnet_32k_d64", 32768, 16, 64, LONGNET, False),
    ("longnet_32k_gqa4", 32768, 4, 128, LONGNET, False),
    ("short_segments_32k", 32768, 16, 128, SHORT, False),
    ("short_segments_32k_causal", 32768, 16, 128, SHORT, True),
]


def med(fn, iters):
    """Median of cold CUDA-event timings (warm-up is the caller's)."""
    return time_ms(fn, torch.device("cuda"), warmup=0, iters=iters)["median_ms"]


def first_call(f, q, k, v, g):
    wall = time.perf_counter()
    out = f(q, k, v)
    torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    first = time.perf_counter() - wall
    torch.autograd.grad(f(q, k, v), (q, k, v), g)
    return round(first, 2), out.detach()


def timings(f, q, k, v, g):
    with torch.no_grad():
        fwd = med(lambda: f(q, k, v), a.iters)
    total = med(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), g), a.iters)
    return fwd, total - fwd


rows = []
for name, s, hkv, d, (segs, rates), causal in CASES:
    if a.cases and name not in a.cases:
        continue
    q = torch.randn(1, s, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, s, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn_like(q)
    pairs = dilated.pair_count(s, segs, rates, 16, causal)
    def dil(mode, schedule):
        tuning = DilatedTuning(autotune=mode, schedule=schedule)
        return lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                                          causal=causal, backend="triton", tuning=tuning)

    dense = lambda q, k, v: longattn.attention(q, k, v, causal=causal, backend="cudnn")
    table = {"static": ("0", "auto"), "autotuned": ("1", "auto"), "per_branch": ("1", "per_branch"),
             "zero_fill": ("1", "per_branch_zero_fill"), "static_per_branch": ("0", "per_branch"),
             "static_grouped": ("0", "grouped"), "static_zero_fill": ("0", "per_branch_zero_fill")}
    variants = [(label, dense if label == "dense_cudnn" else dil(*table[label])) for label in a.variants
                if label != "dense_cudnn" or (hkv == 16 and d <= 128)]
    if a.compile:
        variants.append(("autotuned_compiled", torch.compile(dil("1", "auto"), fullgraph=True)))
    res = {}
    for label, f in variants:
        first, out = first_call(f, q, k, v, g)
        res[label] = dict(first_call_s=first, out=out, fwd=[], bwd=[])
    for _ in range(a.rounds):
        for label, f in variants:
            fwd, bwd = timings(f, q, k, v, g)
            res[label]["fwd"].append(fwd)
            res[label]["bwd"].append(bwd)
    ref = res[variants[0][0]]["out"].float()
    for label, r in res.items():
        fwd, bwd = statistics.median(r["fwd"]), statistics.median(r["bwd"])
        if label == "dense_cudnn":
            flops = 4 * s * s * 16 * d * (0.5 if causal else 1.0)
        else:
            flops = 4 * pairs * d
        rows.append(dict(case=name, variant=label, first_call_s=r["first_call_s"], fwd_ms=fwd, bwd_ms=bwd,
                         fwd_rounds=r["fwd"], bwd_rounds=r["bwd"], fwd_tflops=flops / fwd / 1e9,
                         bwd_tflops=2.5 * flops / bwd / 1e9,
                         rel_diff_vs_first=((r["out"].float() - ref).norm() / ref.norm()).item()))
    del q, k, v, g
    torch.cuda.empty_cache()

tuned = {" ".join(map(str, k)): v for k, v in default_tuner("1").by_shape.items()}
if a.json:
    with open(a.json, "w") as fh:
        json.dump(dict(environment=environment(torch.device("cuda")), rows=rows, tuned=tuned,
                       command="python benchmarks/triton_autotune_ab.py " + " ".join(
                           f"--{k} {' '.join(v) if isinstance(v, list) else v}" if not isinstance(v, bool)
                           else (f"--{k}" if v else "") for k, v in vars(a).items()
                           if k != "json" and v is not None)), fh, indent=1)
for k, v in tuned.items():
    print(k, v)
print(f"{'case':22s} {'variant':20s} {'first s':>8s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF':>7s} {'bwd TF':>7s}")
for r in rows:
    print(f"{r['case']:22s} {r['variant']:20s} {r['first_call_s']:8.2f} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
          f"{r['fwd_tflops']:7.1f} {r['bwd_tflops']:7.1f}")
