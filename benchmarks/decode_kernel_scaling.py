"""Decode attention's kernel time against the cache's length: where a step's
fixed cost ends and the memory's rate begins, ours against SDPA's.

For each context (one query, batch 1, 32 query / 8 kv heads, D=128, bf16):
the split-KV kernel at the default tuning (``DecodeTuning``: pointer and
descriptor loads, each at ``--programs-per-sm`` fills), SDPA's cuDNN and
flash kernels over a head-major ``(1, 8, n, 128)`` cache (``enable_gqa``),
each as ten calls replayed from one CUDA graph (kernel time, no host but the
replay's own launch, about a microsecond per call in ``fixed_us``). Then,
per implementation, a least-squares line over the contexts from
``--fit-from`` on: time = fixed + bytes / rate (``fixed_us``: what a call
costs beyond streaming the cache, ``rate_tb_s``: the streaming rate).
Outputs are checked against SDPA's flash kernel.

    python benchmarks/decode_kernel_scaling.py --json out.json
"""
import argparse
import dataclasses
import json
import sys

import torch
from torch.nn.attention import SDPBackend

from longattn import tuning as tn
from longattn.bench.decode import KERNEL_HEAD_DIM, KERNEL_KV_HEADS, kernel_case, replayed_ms
from longattn.bench.measure import environment, result_path
from longattn.bench.single import _failure
from longattn.decode.engine import dense_part, split_kv_args
from longattn.kernels import decode as kd

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, nargs="+", default=[1 << i for i in range(14, 21)])
p.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4])
p.add_argument("--fit-from", type=int, default=65536, help="fit the line over contexts from this many tokens on")
p.add_argument("--iters", type=int, default=30)
p.add_argument("--json")
a = p.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
hkv, d = KERNEL_KV_HEADS, KERNEL_HEAD_DIM
log = lambda m: print(m, file=sys.stderr, flush=True)


def kernel_us(fn) -> float:
    return replayed_ms(fn, dev, a.iters) * 1e3


impls = {f"ours_{'descriptors' if desc else 'pointers'}_pps{pps}": dataclasses.replace(
    tn.DECODE, descriptor_loads="always" if desc else "never", programs_per_sm=pps)
    for desc in (0, 1) for pps in a.programs_per_sm}
if not torch.cuda.get_device_name(dev).startswith("NVIDIA H200"):  # DecodeTuning takes descriptors there only
    log(f"{torch.cuda.get_device_name(dev)}: the ours_descriptors rows run pointer loads (see descriptors_used)")
rows = []
used = {}


def case(n):
    q, kc, vc, sdpa_call = kernel_case(n, dev, dt)
    scale = d ** -0.5
    cache_bytes = 2 * n * hkv * d * kc.element_size()
    want = sdpa_call(SDPBackend.FLASH_ATTENTION)().transpose(1, 2)
    calls = {name: (lambda t=t: dense_part(q, kc, vc, [n], True, scale, "triton", tuning=t)[0])
             for name, t in impls.items()}
    calls.update(sdpa_cudnn=sdpa_call(SDPBackend.CUDNN_ATTENTION), sdpa_flash=sdpa_call(SDPBackend.FLASH_ATTENTION))
    for name, fn in calls.items():
        try:
            out = fn()
            out = out if out.shape == want.shape else out.transpose(1, 2)
            err = (out.float() - want.float()).abs().max().item()
            us = kernel_us(fn)
            rows.append(dict(impl=name, context=n, us=us, gb_s=cache_bytes / us / 1e3, max_abs_diff_out=err))
        except Exception as e:  # noqa: BLE001 - recorded, the others still run
            rows.append(dict(impl=name, context=n, status=_failure(e)))
        log(f"context {n}: {name} {rows[-1].get('us', rows[-1].get('status'))}")
    used.update({name: int(split_kv_args(q, t)["descriptors"] and not kd.descriptor_refusals(kc, vc))
                 for name, t in impls.items()})


for n in a.context:
    case(n)
    torch.cuda.empty_cache()

fits = {}
for name in dict.fromkeys(r["impl"] for r in rows):
    pts = [(2 * r["context"] * hkv * d * 2, r["us"]) for r in rows
           if r["impl"] == name and "us" in r and r["context"] >= a.fit_from]
    if len(pts) >= 2:
        xs, ys = torch.tensor([x for x, _ in pts], dtype=torch.float64), torch.tensor([y for _, y in pts],
                                                                                      dtype=torch.float64)
        slope = ((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum()
        fixed = ys.mean() - slope * xs.mean()
        fits[name] = dict(fixed_us=fixed.item(), rate_tb_s=1e-6 / slope.item(), points=len(pts))
env = environment(dev, command=" ".join(["python", "benchmarks/decode_kernel_scaling.py", *sys.argv[1:]]))
if a.json:
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_kernel_scaling", env=env, descriptors_used=used, fits=fits, results=rows), f,
                  indent=1)
ctx = a.context
print("| impl | " + " | ".join(f"{n // 1024}K us" for n in ctx) + " | fixed us | TB/s |")
print("|---|" + "---|" * (len(ctx) + 2))
for name in dict.fromkeys(r["impl"] for r in rows):
    cells = {r["context"]: (f"{r['us']:.1f}" if "us" in r else "fail") for r in rows if r["impl"] == name}
    f = fits.get(name, {})
    print(f"| {name} | " + " | ".join(cells.get(n, "–") for n in ctx)
          + f" | {f.get('fixed_us', float('nan')):.1f} | {f.get('rate_tb_s', float('nan')):.2f} |")
