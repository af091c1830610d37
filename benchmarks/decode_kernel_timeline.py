"""Where the split-KV decode kernel's time goes inside one launch: each
program's timeline from the GPU's own timers (``decode(..., trace=...)``).

For each context (one query, batch 1, 32 query / 8 kv heads, D=128, bf16, the
default ``DecodeTuning`` unless ``--programs-per-sm``, ``--descriptors``,
``--min-split``, ``--merge-floats`` or ``--warps`` say otherwise), ten
traced launches are replayed from one CUDA graph, as a generation loop's
steps run back to back, and the last launch's records are
read: per program its start, the end of its key loop, its arrival at the
splits' counter and its end (after the merge for the program that merges
its row and kv head), on the global timer (ns, one clock for every SM). From
them:

- ``span_us``: first start to last end, against ``kernel_us`` (the same
  launch untraced, from graph replays: the timers' own cost) and
  ``cudnn_us`` (SDPA's cuDNN kernels on a head-major copy of the cache);
- ``start_spread_us``: first to last program start (launch ramp);
- ``loop_us`` median and max: one program's key loop (the streaming);
- ``loop_tail_us``: median to last end of the key loops (the slowest
  programs: uneven bandwidth between SMs);
- ``arrive_us``: a program's partial stores and its counter's atomic;
- ``merge_us``: median and max of the merging programs' merge;
- ``after_loops_us``: last key loop's end to the kernel's last end (what the
  merge adds to the launch);
- ``per_program`` (``--per-program``): each program's split, kv head, SM,
  start, end of its key loop and end, us from the launch's first start.

    python benchmarks/decode_kernel_timeline.py --json out.json
"""
import argparse
import dataclasses
import itertools
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend

from longattn import tuning as tn
from longattn.bench.decode import KERNEL_HEAD_DIM, KERNEL_HEADS, KERNEL_KV_HEADS, kernel_case, replayed_ms
from longattn.bench.measure import environment, result_path
from longattn.decode.engine import split_kv_args
from longattn.kernels import decode as kd

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, nargs="+", default=[1 << 14, 1 << 17, 1 << 20])
p.add_argument("--programs-per-sm", type=int, nargs="+", default=[tn.DECODE.programs_per_sm])
p.add_argument("--descriptors", type=int, nargs="+", default=[0], choices=[0, 1])
p.add_argument("--min-split", type=int, nargs="+", default=[tn.DECODE.min_split])
p.add_argument("--merge-floats", type=int, nargs="+", default=[tn.DECODE.merge_floats_per_thread],
               help="DecodeTuning.merge_floats_per_thread: partial floats per thread per merge step")
p.add_argument("--warps", type=int, nargs="+", default=[tn.DECODE.num_warps])
p.add_argument("--iters", type=int, default=30)
p.add_argument("--per-program", action="store_true",
               help="also record each program's (split, kv head, SM, start, loop end, end) in us from the first start")
p.add_argument("--json")
a = p.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
h, hkv, d = KERNEL_HEADS, KERNEL_KV_HEADS, KERNEL_HEAD_DIM
log = lambda m: print(m, file=sys.stderr, flush=True)


def kernel_us(fn) -> float:
    return replayed_ms(fn, dev, a.iters) * 1e3


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def timeline(tr: torch.Tensor, nsplit: int) -> dict:
    t = tr.view(-1, kd.TRACE_FIELDS).cpu()
    g0, g1, g2, g3 = (t[:, i].double() / 1e3 for i in range(4))  # us
    c0, c1, c2, c3 = (t[:, i].double() for i in range(4, 8))
    sm, merged = t[:, 8], t[:, 9].bool()
    ghz = med(((c1 - c0) / (g1 - g0).clamp_min(1e-3) / 1e3)[(g1 - g0) > 1].tolist())
    mc = ((c3 - c2)[merged] / ghz / 1e3).tolist()  # the merges on the SM's cycle counter, us
    return dict(
        programs=len(t), sms=len(set(sm.tolist())), max_programs_per_sm=int(torch.bincount(sm).max()),
        mergers=int(merged.sum()), span_us=(g3.max() - g0.min()).item(),
        start_spread_us=(g0.max() - g0.min()).item(), loop_us_median=med((g1 - g0).tolist()),
        loop_us_max=(g1 - g0).max().item(), loop_tail_us=(g1.max() - med(g1.tolist())).item(),
        arrive_us=med((g2 - g1).tolist()), merge_us_median=med(mc), merge_us_max=max(mc) if mc else float("nan"),
        after_loops_us=(g3.max() - g1.max()).item(), sm_ghz=ghz,
        **({"per_program": [[i % nsplit, i // nsplit, int(sm[i]), *(round((g[i] - g0.min()).item(), 2)
                                                                  for g in (g0, g1, g3))] for i in range(len(t))]}
           if a.per_program else {}))


rows = []


def case(n):
    q, kc, vc, sdpa_call = kernel_case(n, dev, dt)
    scale = d ** -0.5
    cudnn = sdpa_call(SDPBackend.CUDNN_ATTENTION)
    cudnn_us = kernel_us(cudnn)
    want = cudnn().transpose(1, 2)
    for pps, desc, ms, mf, w in itertools.product(a.programs_per_sm, a.descriptors, a.min_split, a.merge_floats,
                                                  a.warps):
        t = dataclasses.replace(tn.DECODE, programs_per_sm=pps, min_split=ms, merge_floats_per_thread=mf,
                                num_warps=w, descriptor_loads="always" if desc else "never")
        args = split_kv_args(q, t)
        used = int(args["descriptors"] and not kd.descriptor_refusals(kc, vc))
        tr = torch.zeros(kd.trace_size(n, 1, hkv, dev, args["programs_per_sm"], args["block_n"], args["min_split"]),
                         dtype=torch.int64, device=dev)
        plain = lambda: kd.decode(q, kc, vc, [n], True, scale, **args)
        traced = lambda: kd.decode(q, kc, vc, [n], True, scale, **args, trace=tr)
        err = (plain()[0].float() - want.float()).abs().max().item()
        us = kernel_us(plain)
        traced_us = kernel_us(traced)  # its graph's last launch leaves its records in tr
        chunk = kd.merge_chunk(1 << (h // hkv - 1).bit_length(), d, w, dev, mf)  # the query rows a kv head reads
        row = dict(context=n, programs_per_sm=pps, min_split=ms, merge_floats=mf, merge_chunk=chunk, num_warps=w,
                   descriptors_used=used, kernel_us=us, traced_us=traced_us, cudnn_us=cudnn_us,
                   max_abs_diff_out=err, **timeline(tr, tr.numel() // kd.TRACE_FIELDS // hkv))
        rows.append(row)
        log(f"{n}: pps {pps} desc {used} min_split {ms} merge {mf} warps {w}: {us:.1f} us (traced "
            f"{traced_us:.1f}, span {row['span_us']:.1f}), cuDNN {cudnn_us:.1f}")

for n in a.context:
    case(n)
    torch.cuda.empty_cache()

env = environment(dev, command=" ".join(["python", "benchmarks/decode_kernel_timeline.py", *sys.argv[1:]]))
if a.json:
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_kernel_timeline", env=env, results=rows), f, indent=1)
cols = ["kernel_us", "cudnn_us", "traced_us", "span_us", "start_spread_us", "loop_us_median", "loop_us_max",
        "loop_tail_us", "arrive_us", "merge_us_median", "merge_us_max", "after_loops_us"]
print("| context | pps | desc | min_split | merge chunk | warps | programs | " + " | ".join(cols) + " |")
print("|---|---|---|---|---|---|---|" + "---|" * len(cols))
for r in rows:
    print(f"| {r['context'] // 1024}K | {r['programs_per_sm']} | {r['descriptors_used']} | {r['min_split']} | "
          f"{r['merge_chunk']} | {r['num_warps']} | {r['programs']} | " + " | ".join(f"{r[c]:.1f}" for c in cols)
          + " |")
