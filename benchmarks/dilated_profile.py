"""Where the GPU time of a dilated pass goes: kernels by kind, gaps, and what
the same cuDNN work costs on contiguous squares.

    python benchmarks/dilated_profile.py [--seqlens 32768 131072] [--causal 1 0] [--iters 20]

LongNet (segments 2K..32K, rates 1..16: every branch's parts are 2048-row
squares), bf16, D=128, 16 heads, the default plan of ``dilated_attention``.
For each pass (forward, backward):

* ``cold`` / ``batched`` ms (see ``longattn.bench.measure.time_ms``) and
  ``x dense``: useful TF/s over dense cuDNN's at the same length and mask kind;
* one call under torch.profiler: the GPU span (first kernel start to last
  kernel end), the sum of kernel times, the idle gaps between them, and the
  kernel time by kind (cuDNN attention, cuDNN's own helpers, our Triton
  merges / adds / gathers, torch copies and fills);
* ``squares``: cuDNN on contiguous (n, 2048, 16, D) tensors holding as many
  squares as each branch has, one call per branch (``per_branch``) and all
  branches in one call (``one_call``): what the attention work alone costs, and
  what stacking every branch into one call would save.

Writes --json (default $OUT/dilated_profile.json), a table last.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import longattn
from longattn.bench.configs import Config
from longattn.bench.impls import useful_pairs
from longattn.bench.measure import environment, time_ms, write_json
from longattn.dilated.schedule import schedule

SEGS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
KINDS = (("cudnn_attn", ("sdpa", "fmha", "flash", "cudnn_generated")), ("merge", ("_merge",)),
         ("add", ("_add", "add_into")), ("gather", ("_copy",)), ("cudnn_other", ("cudnn", "cask", "xmma")),
         ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "reduce")))


def kind(name: str) -> str:
    low = name.lower()
    for k, pats in KINDS:
        if any(p in low for p in pats):
            return k
    return "other"


def profile_call(fn):
    """GPU span, kernel sum, gaps and time by kind of one call (µs)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ks = sorted((e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)
    if not ks:
        return {}
    by_kind, by_name = collections.Counter(), collections.Counter()
    for e in ks:
        by_kind[kind(e.name)] += e.time_range.elapsed_us()
        by_name[e.name[:90]] += e.time_range.elapsed_us()
    span = max(e.time_range.end for e in ks) - ks[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in ks)
    return dict(span_us=span, kernel_sum_us=busy, kernels=len(ks), by_kind=dict(by_kind),
                top=by_name.most_common(12))


def squares(seqlen, causal, dev, iters):
    """cuDNN on contiguous squares: one call per branch against one call for all."""
    counts = collections.Counter()
    for part in schedule(seqlen, SEGS, RATES, 16):
        counts[(part.w, part.r)] += part.nseg * part.nheads(16)  # squares of m = w / r rows
    m = SEGS[0] // RATES[0]

    def run(n, bwd):
        """ms of the forward over n squares, or (``bwd``) of the forward and backward."""
        q, k, v = (torch.randn(n // 16, m, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=bwd)
                   for _ in range(3))
        f = lambda: longattn.attention(q, k, v, causal=causal, backend="cudnn")
        if not bwd:
            return time_ms(f, dev, warmup=2, iters=iters, batched=True)["median_ms"]
        do = torch.randn_like(q)
        fb = lambda: torch.autograd.grad(f(), (q, k, v), do)
        return time_ms(fb, dev, warmup=2, iters=iters, batched=True)["median_ms"]

    res = {}
    for bwd in (False, True):
        p = "bwd" if bwd else "fwd"
        per_branch = {f"{w}/{r}": run(n, bwd) for (w, r), n in counts.items()}
        one_call = run(sum(counts.values()), bwd)
        if bwd:  # the backward alone: the forward's time, measured above, comes off
            per_branch = {wr: ms - res["fwd_per_branch_ms"][wr] for wr, ms in per_branch.items()}
            one_call -= res["fwd_one_call_ms"]
        res[f"{p}_per_branch_ms"] = per_branch
        res[f"{p}_branches_sum_ms"] = sum(per_branch.values())
        res[f"{p}_one_call_ms"] = one_call
    res["squares"] = {f"{w}/{r}": n for (w, r), n in counts.items()}
    return res


def case(s, causal, dev, iters):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, s, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES, causal=causal)
    out = f()
    fb = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    full = lambda: torch.autograd.grad(f(), (q, k, v), do)
    row = dict(seqlen=s, causal=causal)
    row["fwd_cold_ms"] = time_ms(f, dev, warmup=3, iters=iters)["median_ms"]
    row["fwd_batched_ms"] = time_ms(f, dev, warmup=1, iters=iters, batched=True)["median_ms"]
    row["bwd_cold_ms"] = time_ms(full, dev, warmup=3, iters=iters)["median_ms"] - row["fwd_cold_ms"]
    row["bwd_batched_ms"] = time_ms(full, dev, warmup=1, iters=iters, batched=True)["median_ms"] - row["fwd_batched_ms"]
    row["fwd_profile"], row["bwd_profile"] = profile_call(f), profile_call(fb)
    dq, dk, dv = (torch.randn(1, s, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dense = lambda: longattn.attention(dq, dk, dv, causal=causal, backend="cudnn")
    ddo = torch.randn_like(dq)
    dfwd = time_ms(dense, dev, warmup=2, iters=max(3, iters // 4))["median_ms"]
    dbwd = time_ms(lambda: torch.autograd.grad(dense(), (dq, dk, dv), ddo), dev, warmup=2,
                   iters=max(3, iters // 4))["median_ms"] - dfwd
    cfg = Config("dilated_profile", 1, s, 16, 128, causal=causal, segment_lengths=tuple(SEGS),
                 dilation_rates=tuple(RATES))
    pairs = useful_pairs(cfg)  # per head, as dense_pairs: the ratio is the same
    dense_pairs = useful_pairs(dataclasses.replace(cfg, segment_lengths=None, dilation_rates=None))
    for p, dt in (("fwd", dfwd), ("bwd", dbwd)):
        for t in ("cold", "batched"):
            row[f"{p}_{t}_x_dense"] = (pairs / row[f"{p}_{t}_ms"]) / (dense_pairs / dt)
    row["dense_fwd_ms"], row["dense_bwd_ms"] = dfwd, dbwd
    row["squares"] = squares(s, causal, dev, iters)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "dilated_profile.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for s in a.seqlens:
        for c in a.causal:
            rows.append(case(s, bool(c), dev, a.iters))
            print(f"done {s} causal={c}", flush=True)
    env = environment(dev, command=" ".join(["python", "benchmarks/dilated_profile.py", *sys.argv[1:]]))
    write_json(a.json, dict(env=env, command=env["command"], rows=rows))  # "rows", not "results": no CSV
    print(f"{'case':>14} {'pass':>4} {'cold':>6} {'batch':>6} {'x dense c/b':>11} {'span':>6} {'kern':>6} {'n':>4}  "
          "by kind (ms) | squares per-branch / one call")
    for r in rows:
        for p in ("fwd", "bwd"):
            pr = r[f"{p}_profile"]
            kinds = " ".join(f"{k}={v / 1e3:.2f}" for k, v in sorted(pr["by_kind"].items(), key=lambda x: -x[1]))
            sq = r["squares"]
            print(f"{r['seqlen']:>8}{' c' if r['causal'] else '  '}     {p} {r[f'{p}_cold_ms']:6.2f} "
                  f"{r[f'{p}_batched_ms']:6.2f} {r[f'{p}_cold_x_dense']:5.2f}/{r[f'{p}_batched_x_dense']:4.2f} "
                  f"{pr['span_us'] / 1e3:6.2f} {pr['kernel_sum_us'] / 1e3:6.2f} {pr['kernels']:4d}  {kinds} | "
                  f"{sq[f'{p}_branches_sum_ms']:.2f} / {sq[f'{p}_one_call_ms']:.2f}")


if __name__ == "__main__":
    main()
