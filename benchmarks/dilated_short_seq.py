"""Where the time of a short dilated call goes: host, GPU, launches, per engine.

    python benchmarks/dilated_short_seq.py [--seqlens 8192 16384 32768 131072] [--head-dim 128]
        [--gqa --gqa-seqlens 32768] [--iters 20] [--rounds 1]

LongNet segments 2K..32K, rates 1..16, bf16, D=128 (--head-dim), MHA 16 heads
(and with --gqa 32q/8kv at --gqa-seqlens), causal and not. For each engine of ``dilated_attention``:

* ``views``: cuDNN on strided views, branch calls in order on one stream;
* ``views_concurrent``: the same calls, each on a side stream at once
  (``DilatedTuning.concurrent_calls``);
* ``views_graphs`` (``_serial``): each pass replayed from a CUDA graph the
  op captures per shape (``DilatedTuning.graph_max_tokens``), with the calls
  concurrent (in order);
* ``fused``: our Triton kernels (built-in tiles: the autotuner's first call
  of a shape takes minutes; the plan's schedule: LongNet's chain runs
  ``dedup``, every pair once, at head dim <= 64, per-branch launches above),
  ``fused_per_branch`` (every branch's pairs, duplicates included),
  ``fused_autotuned`` (tiles autotuned);
* ``auto`` (the default engine; eagerly the op skips torch.library's
  dispatcher) and ``auto_dispatcher`` (the same through the dispatcher);
* ``dense``: dense cuDNN at the same length, the yardstick.

and for the forward and forward+backward: ``cold`` (one call between CUDA
events, the GPU idle before it: host time shows), ``batched`` (calls back to
back: the host runs ahead), ``graph`` (the call captured by
``torch.cuda.make_graphed_callables`` and replayed: GPU time with no host
issue time, input copies included), ``host`` (median wall time of issuing one
call, no synchronisation) and the number of kernels launched (profiler).
Useful TF/s count only computed pairs (flash-attn's convention, backward
2.5x the forward). Writes $OUT/dilated_short_seq.json (or --json), a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import longattn
from longattn.bench.configs import Config
from longattn.bench.impls import fwd_flops
from longattn.bench.measure import environment, time_ms, write_json
from longattn.dilated import graphs
from longattn.tuning import DilatedTuning

SEGS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
VARIANTS = {
    "views": dict(tuning=DilatedTuning(schedule="views", concurrent_calls="never").graphs_up_to(0)),
    "views_concurrent": dict(tuning=DilatedTuning(schedule="views", concurrent_calls="always").graphs_up_to(0)),
    "views_graphs": dict(tuning=DilatedTuning(schedule="views", concurrent_calls="graphs").graphs_up_to(1 << 40)),
    "views_graphs_serial": dict(
        tuning=DilatedTuning(schedule="views", concurrent_calls="never").graphs_up_to(1 << 40)),
    "fused": dict(backend="triton", tuning=DilatedTuning(autotune="0")),
    "fused_per_branch": dict(backend="triton", tuning=DilatedTuning(autotune="0", schedule="per_branch")),
    "fused_autotuned": dict(backend="triton", tuning=DilatedTuning(autotune="1")),
    "auto": dict(),
    "auto_dispatcher": dict(),  # the same op through torch.library's dispatcher (as under a dispatch mode)
}


def via_dispatcher(q, k, v, causal):
    """``dilated_attention(q, k, v)``'s output (default engine and tuning)
    through its custom op, as a call under a dispatch mode runs it
    (``longattn._autograd.direct``)."""
    from longattn import dilated as dil
    from longattn.tuning import DILATED

    ops = sys.modules["longattn.ops.dilated"]
    plan = dil.choose(q, k, SEGS, RATES, causal, "auto", DILATED)
    scale = q.shape[-1] ** -0.5
    if plan.fwd == plan.bwd == "fused":
        return dil.fused.fused_op.fwd_op(q, k, v, SEGS, RATES, scale, causal, plan.fused_schedule, plan.autotune)[0]
    return ops._dilated.fwd_op(q, k, v, SEGS, RATES, scale, causal, "auto", plan.key())[0]


def host_ms(fn, dev, n=10):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize(dev)
    return statistics.median(out)


def launches(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(f, q, k, v, do, dev, iters, full=True):
    """fwd and fwd+bwd timings of f(q, k, v) -> out; ``full`` False: cold only
    (dense attention: no host-bound regime, seconds per call at 128K)."""
    fwd = lambda: f(q, k, v)
    fb = lambda: torch.autograd.grad(f(q, k, v), (q, k, v), do)
    r = {}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fb)):
        r[f"{name}_cold_ms"] = time_ms(fn, dev, warmup=3 if full else 1, iters=iters)["median_ms"]
        if not full:
            continue
        r[f"{name}_batched_ms"] = time_ms(fn, dev, warmup=1, iters=iters, batched=True)["median_ms"]
        r[f"{name}_host_ms"] = host_ms(fn, dev)
        r[f"{name}_kernels"] = launches(fn)
    if not full:
        r["bwd_cold_ms"] = r["fwd_bwd_cold_ms"] - r["fwd_cold_ms"]
        return r
    try:
        g = torch.cuda.make_graphed_callables(f, tuple(x.detach().clone().requires_grad_() for x in (q, k, v)))
        r["fwd_graph_ms"] = time_ms(lambda: g(q, k, v), dev, warmup=2, iters=iters)["median_ms"]
        r["fwd_bwd_graph_ms"] = time_ms(lambda: torch.autograd.grad(g(q, k, v), (q, k, v), do), dev, warmup=2,
                                        iters=iters)["median_ms"]
    except Exception as e:  # recorded, not hidden
        r["graph_error"] = f"{type(e).__name__}: {e}"[:300]
    for t in ("cold", "batched", "graph"):
        if f"fwd_{t}_ms" in r:
            r[f"bwd_{t}_ms"] = r[f"fwd_bwd_{t}_ms"] - r[f"fwd_{t}_ms"]
    return r


def case(s, h, hkv, d, causal, variants, dev, iters, rounds=1, cold_only=False):
    torch.manual_seed(0)
    q = torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    dilated = Config("dilated_short_seq", 1, s, h, d, kv_heads=hkv, causal=causal, segment_lengths=tuple(SEGS),
                     dilation_rates=tuple(RATES))
    dilated_flops = fwd_flops(dilated)
    dense_flops = fwd_flops(dataclasses.replace(dilated, segment_lengths=None, dilation_rates=None))
    rows = []
    ref = None
    # rounds > 1 alternate the variants (A B A B): a drift of the machine over the run shows as spread within a
    # variant instead of as a difference between them
    for rnd, name in ((r, n) for r in range(rounds) for n in variants):
        if name == "dense":
            f = lambda q, k, v: longattn.attention(q, k, v, causal=causal, backend="cudnn")
            flops = dense_flops
        elif name == "auto_dispatcher":
            f = lambda q, k, v: via_dispatcher(q, k, v, causal)
            flops = dilated_flops
        else:
            kw = VARIANTS[name]
            f = lambda q, k, v, kw=kw: longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES,
                                                                  causal=causal, **kw)
            flops = dilated_flops
        row = dict(seqlen=s, heads=h, kv_heads=hkv, head_dim=d, causal=causal, impl=name, round=rnd)
        try:
            if name != "dense":
                o = f(q, k, v).float()
                ref = o if ref is None else ref
                row["rel_diff_vs_views"] = ((o - ref).norm() / ref.norm()).item()
            dense = name == "dense"
            row.update(measure(f, q, k, v, do, dev, max(3, iters * 8192 // s) if dense else iters,
                               full=not (dense or cold_only)))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        for t in ("cold", "batched", "graph"):
            if f"fwd_{t}_ms" in row:
                row[f"fwd_{t}_tflops"] = flops / row[f"fwd_{t}_ms"] / 1e9
                row[f"bwd_{t}_tflops"] = 2.5 * flops / max(row[f"bwd_{t}_ms"], 1e-6) / 1e9
        rows.append(row)
        graphs.clear()  # each variant's captured passes hold memory
        print(json.dumps(row), flush=True)
    for r in rows:
        dense = next((x for x in rows if x["impl"] == "dense" and "error" not in x and x["round"] == r["round"]),
                     None)
        for p in ("fwd", "fwd_bwd"):  # the measure: host time of issuing a call over its cold time
            if f"{p}_host_ms" in r:
                r[f"{p}_host_share"] = r[f"{p}_host_ms"] / r[f"{p}_cold_ms"]
        for t in ("cold", "batched", "graph"):
            for p in ("fwd", "bwd"):
                if dense and f"{p}_{t}_tflops" in r:  # dense attention is GPU-bound: its cold time
                    r[f"{p}_{t}_x_dense"] = r[f"{p}_{t}_tflops"] / dense[f"{p}_cold_tflops"]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384, 32768, 131072])
    ap.add_argument("--variants", nargs="+", choices=[*VARIANTS, "dense"],
                    default=["views", "views_concurrent", "views_graphs", "views_graphs_serial", "fused", "auto",
                             "dense"])
    ap.add_argument("--gqa", action="store_true", help="also GQA 32q/8kv (at --gqa-seqlens)")
    ap.add_argument("--gqa-seqlens", type=int, nargs="+", default=[32768])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="run the variants this many times, alternating")
    ap.add_argument("--cold-only", action="store_true", help="cold fwd and fwd+bwd times only (A/B of GPU time)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "dilated_short_seq.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    shapes = [(s, 16, 16) for s in a.seqlens] + ([(s, 32, 8) for s in a.gqa_seqlens] if a.gqa else [])
    rows = []
    env = environment(dev, command=" ".join(["python", "benchmarks/dilated_short_seq.py", *sys.argv[1:]]))
    for i, (s, h, hkv) in enumerate(shapes):
        for causal in (False, True):
            print(f"[{i + 1}/{len(shapes)}] seqlen {s} heads {h}/{hkv} causal {causal}", flush=True)
            rows += case(s, h, hkv, a.head_dim, causal, a.variants, dev, a.iters, a.rounds, a.cold_only)
            # after every case: a run cut short keeps what it measured
            write_json(a.json, dict(env=env, command=env["command"], rows=rows))  # "rows", not "results": no CSV
    print(f"\n{'seqlen':>7} {'h/kv':>6} {'c':>1} {'impl':>17} | {'fwd cold/batch/graph x dense':>29} | "
          f"{'bwd cold/batch/graph x dense':>29} | host fwd/fb ms | host % fwd/fb | kernels fwd/fb")
    for r in rows:
        x = lambda p: " ".join(f"{r.get(f'{p}_{t}_x_dense', float('nan')):5.2f}" for t in ("cold", "batched", "graph"))
        host = (f"{r.get('fwd_host_ms', 0):5.2f} / {r.get('fwd_bwd_host_ms', 0):5.2f} | "
                f"{100 * r.get('fwd_host_share', 0):5.1f} / {100 * r.get('fwd_bwd_host_share', 0):5.1f}")
        err = f"  ERROR {r['error']}" if "error" in r else ""
        print(f"{r['seqlen']:>7} {r['heads']:>3}/{r['kv_heads']:<2} {int(r['causal'])} "
              f"{r['impl']:>17}{r['round']:>2} | "
              f"{x('fwd'):>29} | {x('bwd'):>29} | {host} | {r.get('fwd_kernels', 0)} / {r.get('fwd_bwd_kernels', 0)}"
              + err)

if __name__ == "__main__":
    main()
