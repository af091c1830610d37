"""In-process A/B of the dilated views path's gathering threshold
(``DilatedTuning.gather_max_rows``, passed as ``tuning=``): both settings alternate in one process
(host time moves between processes), cold forward and backward times (CUDA
events around one call, the GPU idle before it) and host times, LongNet
config, B=1, D=128 bf16 (H=16, or ``--heads 32 --kv-heads 8`` for GQA), plus the relative
difference of the two results.

    python benchmarks/dilated_gather_ab.py --rows 262144 0 --json out.json
    python benchmarks/dilated_gather_ab.py --heads 32 --kv-heads 8 --json out.json
"""
import argparse
import json
import statistics
import sys
import time

import torch

import longattn
from longattn.bench.measure import environment
from longattn.tuning import DilatedTuning

p = argparse.ArgumentParser()
p.add_argument("--rows", type=int, nargs=2, default=[DilatedTuning().gather_max_rows, 0])
p.add_argument("--rounds", type=int, default=4)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
p.add_argument("--graphed", action="store_true",
               help="gather in passes replayed from graphs too (DilatedTuning.gather_graphed); without it "
                    "both arms of a graphed pass run ungathered")
p.add_argument("--json")
a = p.parse_args()
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]


def timed(fn):
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    t = time.perf_counter()
    r = fn()
    host = (time.perf_counter() - t) * 1e3
    e1.record()
    e1.synchronize()
    return r, e0.elapsed_time(e1), host


rows_out = []
hkv = a.kv_heads or a.heads
for S, causal in [(s, c) for s in a.seqlens for c in (True, False)]:
    q = torch.randn(1, S, a.heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, S, hkv, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn_like(q)
    f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=causal,
                                           tuning=tuning)
    acc = {r: ([], [], [], []) for r in a.rows}
    res = {}
    for _ in range(a.rounds):
        for rows in a.rows:
            tuning = DilatedTuning(gather_max_rows=rows, gather_graphed=a.graphed)
            for _ in range(2):
                torch.autograd.grad(f(), (q, k, v), g)
            torch.cuda.synchronize()
            for _ in range(8):
                o, ft, fh = timed(f)
                gr, bt, bh = timed(lambda: torch.autograd.grad(o, (q, k, v), g))
                for lst, x in zip(acc[rows], (ft, bt, fh, bh)):
                    lst.append(x)
            res[rows] = [o.float()] + [x.float() for x in gr]
    x, y = (res[r] for r in a.rows)
    diff = [((s - t).norm() / t.norm()).item() for s, t in zip(x, y)]
    for rows in a.rows:
        ft, bt, fh, bh = (statistics.median(v) for v in acc[rows])
        rows_out.append(dict(gather_max_rows=rows, seqlen=S, heads=a.heads, kv_heads=hkv, causal=causal, fwd_ms=ft,
                             bwd_ms=bt, fwd_host_ms=fh, bwd_host_ms=bh, rel_diff_out_dq_dk_dv=diff))
if a.json:
    command = "python benchmarks/dilated_gather_ab.py " + " ".join(sys.argv[1:])
    json.dump({"env": dict(environment(torch.device("cuda")), command=command), "command": command, "rows": rows_out},
              open(a.json, "w"), indent=1)
for r in rows_out:
    print(f"rows {r['gather_max_rows']:7d} {r['seqlen'] // 1024:4d}K {r['heads']}q/{r['kv_heads']}kv "
          f"causal={int(r['causal'])} fwd {r['fwd_ms']:.3f} "
          f"(host {r['fwd_host_ms']:.2f}) bwd {r['bwd_ms']:.3f} (host {r['bwd_host_ms']:.2f})")
