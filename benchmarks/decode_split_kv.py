"""The split-KV decode kernel's tiles, and decoding through it against the
flash kernel and SDPA, in one process.

For each context (one query, B rows, 32 query / 8 kv heads, D=128, bf16 by
default): every tile (``--block-n`` x ``--warps`` x ``--stages``), device
fill (``--programs-per-sm``) and load kind (``--descriptors``: pointers,
tensor descriptors) of the split-KV kernel, timed as ten calls
replayed from one CUDA graph (the kernels' own time, no host; the cache read
at the memory's rate is the bound, printed as GB/s); then one decode step (append
the token's K/V to a preallocated cache, attend) through the split-KV
kernel with the best tiles and with the default ones, through the flash
kernel on views of the cache, and SDPA (flash, cuDNN) over a whole
preallocated cache, each ``cold`` (one isolated step, host time counts) and
``batched``; with ``--batch`` above 1 also attention over rows of different
lengths (n down to about n / 2): one split-KV launch against one flash call
per row. ``--layout token head``: the cache stored token-major (B, S, Hkv, D)
or head-major (B, Hkv, S, D), the kernel reading both as (B, S, Hkv, D) views
(SDPA always gets its own best, head-major contiguous). Outputs are checked
against the flash kernel's.

    python benchmarks/decode_split_kv.py --json out.json
"""
import argparse
import dataclasses
import itertools
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from longattn import tuning as tn
from longattn.bench.decode import replayed_ms
from longattn.bench.measure import environment, result_path, time_ms
from longattn.bench.single import _failure
from longattn.decode.engine import dense_part, split_kv_args
from longattn.kernels import decode as kd

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, nargs="+", default=[131072, 1048576])
p.add_argument("--batch", type=int, nargs="+", default=[1])
p.add_argument("--heads", type=int, default=32)
p.add_argument("--kv-heads", type=int, default=8)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
p.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8])
p.add_argument("--heads-fastest", type=int, nargs="+", default=[0, 1], help="launch orders (0: splits, 1: heads)")
p.add_argument("--descriptors", type=int, nargs="+", default=[0], help="K/V loads (0: pointers, 1: tensor descriptors)")
p.add_argument("--min-split", type=int, default=256)
p.add_argument("--layout", nargs="+", default=["token"], choices=["token", "head"],
               help="cache storage: token-major (B, S, Hkv, D) or head-major (B, Hkv, S, D), read as (B, S, Hkv, D) views")
p.add_argument("--iters", type=int, default=30)
p.add_argument("--json")
a = p.parse_args()
dev = torch.device("cuda")
dt = torch.bfloat16
log = lambda m: print(m, file=sys.stderr, flush=True)


def tuning(bn, w, s, pps, hf=0, desc=0):
    return dataclasses.replace(tn.DECODE, block_n=bn, h200_block_n=bn, num_warps=w, num_stages=s, h200_num_stages=s,
                               programs_per_sm=pps, programs_per_sm_d64=pps, min_split=a.min_split,
                               heads_fastest=bool(hf), h200_heads_fastest=bool(hf),
                               descriptor_loads="always" if desc else "never")


def case(n, b, layout):
    h, hkv, d = a.heads, a.kv_heads, a.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    if layout == "head":
        kc, vc = (torch.randn(b, hkv, n + 4096, d, device=dev, dtype=dt, generator=g).transpose(1, 2) for _ in range(2))
    else:
        kc, vc = (torch.randn(b, n + 4096, hkv, d, device=dev, dtype=dt, generator=g) for _ in range(2))
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt, generator=g)
    kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=dt, generator=g) for _ in range(2))
    scale = d ** -0.5
    cache_bytes = 2 * b * n * hkv * d * kc.element_size()
    want, want_lse = dense_part(q, kc, vc, [n] * b, True, scale, "flash")
    rows = []
    grid = list(itertools.product(a.block_n, a.warps, a.stages, a.programs_per_sm, a.heads_fastest, a.descriptors))
    for i, (bn, w, s, pps, hf, desc) in enumerate(grid):
        t = tuning(bn, w, s, pps, hf, desc)
        try:
            out, lse = dense_part(q, kc, vc, [n] * b, True, scale, "triton", tuning=t)
            err = ((out.float() - want.float()).abs().max().item(), (lse - want_lse).abs().max().item())
            ms = replayed_ms(lambda: dense_part(q, kc, vc, [n] * b, True, scale, "triton", tuning=t), dev, a.iters)
            rows.append(dict(kind="tile", layout=layout, context=n, batch=b, block_n=bn, warps=w, stages=s, programs_per_sm=pps,
                             heads_fastest=hf, descriptors=int(split_kv_args(q, t)["descriptors"] and not kd.descriptor_refusals(kc, vc)), ms=ms, gb_s=cache_bytes / ms / 1e6, max_abs_diff_out=err[0], max_abs_diff_lse=err[1]))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is recorded
            rows.append(dict(kind="tile", layout=layout, context=n, batch=b, block_n=bn, warps=w, stages=s, programs_per_sm=pps,
                             heads_fastest=hf, descriptors=desc, status=_failure(e)))
        log(f"context {n} batch {b} {layout}: tile {i + 1}/{len(grid)} {rows[-1].get('ms', rows[-1].get('status'))}")
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])
    t_best = tuning(best["block_n"], best["warps"], best["stages"], best["programs_per_sm"], best["heads_fastest"],
                    best["descriptors"])
    pos = [n]

    def ours(be, t=tn.DECODE):
        def step():
            kc[:, pos[0]:pos[0] + 1] = kn  # the token's K/V into the preallocated cache
            vc[:, pos[0]:pos[0] + 1] = vn
            return dense_part(q, kc, vc, [pos[0] + 1] * b, True, scale, be, tuning=t)
        return step

    kt, vt = kc[:, : n + 1].transpose(1, 2).contiguous(), vc[:, : n + 1].transpose(1, 2).contiguous()
    qt, knt, vnt = q.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2)

    def sdpa_step(which):
        def step():
            kt[:, :, n:] = knt
            vt[:, :, n:] = vnt
            with sdpa_kernel(which):
                return sdpa(qt, kt, vt, enable_gqa=True)
        return step

    ragged = [n - i * (n // (2 * b)) for i in range(b)]  # rows of different lengths, n down to about n / 2

    def ours_ragged(be):
        return lambda: dense_part(q, kc, vc, ragged, True, scale, be)

    steps = {"split_kv_best": ours("triton", t_best), "split_kv_default": ours("triton"), "flash": ours("flash"),
             "sdpa_flash": sdpa_step(SDPBackend.FLASH_ATTENTION), "sdpa_cudnn": sdpa_step(SDPBackend.CUDNN_ATTENTION)}
    if b > 1:  # attention alone: one split-KV launch against one flash call per row
        steps.update(ragged_split_kv=ours_ragged("triton"), ragged_flash=ours_ragged("flash"))
    for name, fn in steps.items():
        for timing in ("cold", "batched"):
            r = time_ms(fn, dev, warmup=3, iters=a.iters, batched=timing == "batched")
            rows.append(dict(kind="step", layout=layout, context=n, batch=b, impl=name, timing=timing, ms=r["median_ms"],
                             host_ms=r["host_ms"]))
        log(f"context {n} batch {b} {layout}: step {name} {rows[-2]['ms']:.3f} cold / {rows[-1]['ms']:.3f} batched ms")
    del kc, vc, kt, vt
    torch.cuda.empty_cache()
    return rows, best


res = []
table = []
for n in a.context:
    for b, layout in itertools.product(a.batch, a.layout):
        rows, best = case(n, b, layout)
        res += rows
        steps = {(r["impl"], r["timing"]): r for r in rows if r["kind"] == "step"}
        table.append(f"| {n} | {b} | {layout} | {best['block_n']}/{best['warps']}/{best['stages']}/{best['programs_per_sm']}{'/heads first' if best['heads_fastest'] else ''}{'/descriptors' if best['descriptors'] else ''} | "
                     f"{best['ms']:.3f} ({best['gb_s']:.0f} GB/s) | "
                     + " | ".join(f"{steps[(i, 'cold')]['ms']:.3f} / {steps[(i, 'batched')]['ms']:.3f}"
                                  for i in ("split_kv_best", "split_kv_default", "flash", "sdpa_flash", "sdpa_cudnn"))
                     + " |")
env = environment(dev, command=" ".join(["python", "benchmarks/decode_split_kv.py", *sys.argv[1:]]))
if a.json:  # json.dump, not measure.write_json: that would put a CSV of the rows beside it
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_split_kv", env=env, results=res), f, indent=1)
print("| context | batch | cache | best tile (block_n/warps/stages/programs per SM) | kernel ms | step ms cold / batched: "
      "split-KV best | split-KV default | flash (ours) | SDPA flash | SDPA cuDNN |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(table))
