"""Host time of a short dilated call whose passes replay from CUDA graphs
(LongNet, 16 heads, bf16): forward, backward alone (one forward's graph
re-run) and forward+backward, each issued with the GPU idle before it (what
``dilated_short_seq.py`` calls host time) and back to back (the GPU runs
behind), then cProfile of 50 idle-GPU calls, heaviest functions first.

    python benchmarks/dilated_host_replay.py [--seqlen 8192] [--head-dim 128] [--causal]

Writes $OUT/dilated_host_replay.json (or --json), a table last.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

import longattn
from longattn.bench.measure import environment, write_json

SEGS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]


def issue_ms(call, n, idle):
    """Median host time of issuing ``call``: each from an idle GPU, or back to back."""
    times = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        if idle:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        call()
        if idle:
            times.append((time.perf_counter() - t0) * 1e3)
    if not idle:
        times.append((time.perf_counter() - t0) * 1e3 / n)
    torch.cuda.synchronize()
    return statistics.median(times)


def top_functions(call, n=50, top=15):
    pr = cProfile.Profile()
    for _ in range(n):
        torch.cuda.synchronize()
        pr.enable()
        call()
        pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    # stats: (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [dict(function=f"{os.path.basename(path)}:{line}({name})", ncalls=calls,
                 own_us_per_call=own / n * 1e6, cum_us_per_call=cum / n * 1e6)
            for (path, line, name), (_, calls, own, cum, _) in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "dilated_host_replay.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    q, k, v = (torch.randn(1, a.seqlen, 16, a.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES, causal=a.causal)
    for _ in range(4):  # eager, capture, replays
        torch.autograd.grad(f(), (q, k, v), do)
    o = f()
    calls = {
        "fwd": f,
        "bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
        "fwd_bwd": lambda: torch.autograd.grad(f(), (q, k, v), do),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(5):
            call()
        rows.append(dict(call=name, host_ms_idle_gpu=issue_ms(call, 30, True),
                         host_ms_back_to_back=issue_ms(call, 30, False), top_functions=top_functions(call)))
        print(f"== {name}", {k: round(v, 3) for k, v in rows[-1].items() if k.startswith("host")}, flush=True)
    cmd = " ".join(["python", "benchmarks/dilated_host_replay.py", *sys.argv[1:]])
    write_json(a.json, dict(env=environment(dev, command=cmd), command=cmd, seqlen=a.seqlen, head_dim=a.head_dim,
                            causal=a.causal, rows=rows))
    for r in rows:
        print(f"\n{r['call']}: host {r['host_ms_idle_gpu']:.3f} ms (GPU idle before), "
              f"{r['host_ms_back_to_back']:.3f} ms (back to back); own µs per call:")
        for t in r["top_functions"][:10]:
            print(f"  {t['own_us_per_call']:7.1f}  {t['cum_us_per_call']:7.1f}  {t['ncalls']:>5}  {t['function']}")


if __name__ == "__main__":
    main()
