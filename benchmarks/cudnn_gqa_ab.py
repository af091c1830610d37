"""In-process A/B of GQA through cuDNN: native (kv heads passed as they are,
what the cudnn backend does) against expanding K/V to the query heads first
and summing dK/dV back (what a caller without native GQA would do). bf16, B=1, H=32,
Hkv=8, D=128; median CUDA-event times over alternating rounds, peak memory
beyond the inputs.

    python benchmarks/cudnn_gqa_ab.py --json out.json
"""
import argparse
import json
import statistics

import torch

import longattn
from longattn.bench.measure import environment, time_ms

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="*", default=[16384, 65536])
p.add_argument("--iters", type=int, default=10)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--json")
a = p.parse_args()
H, HKV, D = 32, 8, 128


def native(q, k, v, causal):
    return longattn.attention(q, k, v, causal=causal, backend="cudnn")


def expanded(q, k, v, causal):
    g = H // HKV
    return longattn.attention(q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2), causal=causal,
                              backend="cudnn")


def med(fn, iters):
    """Median of cold CUDA-event timings (warm-up is the caller's)."""
    return time_ms(fn, torch.device("cuda"), warmup=0, iters=iters)["median_ms"]


rows = []
for s in a.seqlens:
    for causal in (False, True):
        q = torch.randn(1, s, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, s, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn_like(q)
        outs, res = {}, {}
        for name, f in (("native", native), ("expanded", expanded)):
            o = f(q, k, v, causal)
            grads = torch.autograd.grad(o, (q, k, v), g)
            outs[name] = (o.detach().float(), [x.float() for x in grads])
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.autograd.grad(f(q, k, v, causal), (q, k, v), g)
            res[name] = dict(fwd=[], bwd=[], peak_mib=(torch.cuda.max_memory_allocated() - base) / 2**20)
        for _ in range(a.rounds):
            for name, f in (("native", native), ("expanded", expanded)):
                with torch.no_grad():
                    fwd = med(lambda: f(q, k, v, causal), a.iters)
                tot = med(lambda: torch.autograd.grad(f(q, k, v, causal), (q, k, v), g), a.iters)
                res[name]["fwd"].append(fwd)
                res[name]["bwd"].append(tot - fwd)
        diff = [((x - y).norm() / y.norm()).item() for x, y in zip([outs["native"][0], *outs["native"][1]],
                                                                  [outs["expanded"][0], *outs["expanded"][1]])]
        for name, r in res.items():
            rows.append(dict(seqlen=s, causal=causal, variant=name, fwd_ms=statistics.median(r["fwd"]),
                             bwd_ms=statistics.median(r["bwd"]), fwd_rounds=r["fwd"], bwd_rounds=r["bwd"],
                             peak_fwd_bwd_mib=r["peak_mib"], rel_diff_out_dq_dk_dv=diff))
        del q, k, v, g
        torch.cuda.empty_cache()
if a.json:
    with open(a.json, "w") as fh:
        json.dump(dict(environment=environment(torch.device("cuda")), rows=rows,
                       command="python benchmarks/cudnn_gqa_ab.py"), fh, indent=1)
print(f"{'S':>7s} {'causal':6s} {'variant':9s} {'fwd ms':>8s} {'bwd ms':>8s} {'peak MiB':>9s}  rel diff out/dq/dk/dv")
for r in rows:
    print(f"{r['seqlen']:7d} {str(r['causal']):6s} {r['variant']:9s} {r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
          f"{r['peak_fwd_bwd_mib']:9.0f}  {' '.join('%.1e' % x for x in r['rel_diff_out_dq_dk_dv'])}")
