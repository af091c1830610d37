"""Whether a bench row's fwd+bwd is bound by its kernels or by the host: one
step (forward + backward of ``CONFIG:IMPL``) timed with CUDA events cold (one
call, GPU idle), batched (5 calls back to back), and after a 20 ms GPU sleep
queued first (the host's work hidden: the GPU's own time), the forward alone
the same two ways, the kernels' summed time over 3 batched steps (torch's
profiler, ``cold_gaps.timeline``), the host's wall time per step, the
synchronizing calls torch's sync debug mode reports, and a cProfile of 10
cold steps (the host functions by cumulative and own time). A row whose host
time per step exceeds its GPU time, or whose batched time sits above the
after-sleep time, waits for the host.

    python benchmarks/host_bound.py --json OUT.json longnet_gqa_128k_causal:longattn-dilated flex_bsparse_32k:longattn-flex-fa4
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
import warnings

import torch

from cold_gaps import row_call, rows_args, timeline
from longattn.bench import measure


def _events(f, n: int = 15, reps: int = 1, sleep_cycles: int = 0) -> dict:
    """Medians over n samples: GPU ms per call, host ms per call, and the queued sleep's ms."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, m, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        a.record()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        m.record()
        h0 = time.perf_counter()
        for _ in range(reps):
            f()
        h = (time.perf_counter() - h0) * 1e3
        b.record()
        b.synchronize()
        ts.append((m.elapsed_time(b) / reps, h / reps, a.elapsed_time(m)))
    return dict(gpu_ms=statistics.median(t[0] for t in ts), host_ms=statistics.median(t[1] for t in ts),
                pre_ms=statistics.median(t[2] for t in ts))


def _host_profile(step) -> tuple[str, str]:
    pr = cProfile.Profile()
    for _ in range(10):
        torch.cuda.synchronize()
        pr.enable()
        step()
        pr.disable()
    out = []
    for key, n in (("cumulative", 45), ("tottime", 25)):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(n)
        out.append(s.getvalue())
    return out[0], out[1]


def diagnose(row: str, dev) -> dict:
    fn, (q, k, v, _), step = row_call(row, dev)

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    for _ in range(3):
        step()
    r = {"cold": _events(step), "batched5": _events(step, n=8, reps=5),
         "after_sleep20ms": _events(step, n=8, sleep_cycles=int(2e7)), "fwd_cold": _events(fwd),
         "fwd_after_sleep": _events(fwd, n=8, sleep_cycles=int(2e7))}
    tl = timeline(lambda: [step() for _ in range(3)])
    r["batched3_timeline"] = dict(kernel_ms=tl["kernel_ms"], span_ms=round(tl["end_ms"] - tl["first_kernel_ms"], 3),
                                  gaps=tl["gaps"][:40])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    r["syncs"] = [str(x.message)[:300] for x in w][:10]
    r["cold_profile_cum"], r["cold_profile_tot"] = _host_profile(step)
    print(f"{row:45s} cold {r['cold']['gpu_ms']:.3f} batched {r['batched5']['gpu_ms']:.3f} "
          f"after-sleep {r['after_sleep20ms']['gpu_ms']:.3f} (host {r['after_sleep20ms']['host_ms']:.3f}) "
          f"fwd cold {r['fwd_cold']['gpu_ms']:.3f} after-sleep {r['fwd_after_sleep']['gpu_ms']:.3f} "
          f"kernels/3 {tl['kernel_ms'] / 3:.3f} syncs {len(r['syncs'])}", flush=True)
    return r


def main() -> None:
    a = rows_args(__doc__, "results")
    dev = torch.device("cuda")
    res = {}
    for row in a.rows:
        res[row] = diagnose(row, dev)
        torch.cuda.empty_cache()
        if a.json:
            with open(measure.result_path(a.json), "w") as fh:
                json.dump({"kind": "host_bound", "env": measure.environment(
                    dev, "python benchmarks/host_bound.py " + " ".join(a.rows)), "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
