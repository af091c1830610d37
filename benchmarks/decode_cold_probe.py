"""Why an isolated ("cold") decode step can take longer than the GPU's work:
one ``KVCache``'s steps timed one at a time, backends in a given order, and
a few of each under the profiler.

One layer's cache of ``--context`` tokens (32q/8kv, D=128, bf16, batch 1;
``--prefill``: a causal ``attention`` over the prompt first, as ``python -m
longattn.bench decode`` runs before its rows). Then for each entry of
``--order`` (a ``KVCache.attend`` backend, or ``sdpa`` for SDPA cuDNN over a
preallocated head-major cache of ``context + 1`` tokens, the new one's slot
written each step): ``--warmup`` steps, then ``--iters`` cold
samples (the GPU idle at each start; per sample the CUDA-event time and the
host's time to issue the step), then ``--profiled`` more under the profiler:
per sample, where its first kernel starts after the step is called, the
kernels' total, and the end of the last kernel. Printed as one line per entry
(median and each sample), the profiled samples below.

    python benchmarks/decode_cold_probe.py --context 131072 --order auto triton auto sdpa --json out.json
"""
import argparse
import json
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

import longattn
from longattn.bench.measure import environment, result_path

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, nargs="+", default=[131072])
p.add_argument("--order", nargs="+", default=["auto", "triton", "auto", "triton", "sdpa"])
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--iters", type=int, default=12)
p.add_argument("--profiled", type=int, default=3)
p.add_argument("--prefill", action="store_true")
p.add_argument("--json")
a = p.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
b, h, hkv, d = 1, 32, 8, 128
log = lambda m: print(m, file=sys.stderr, flush=True)


def cold(step) -> tuple[float, float]:
    """(GPU-event ms, host ms) of one step on an idle GPU."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    e.record()
    e.synchronize()
    return s.elapsed_time(e), (t1 - t0) * 1e3


def profiled(step, n: int) -> list[dict]:
    """Per sample: first kernel's start and last kernel's end after the step's
    call (us, the profiler's clock), the kernels' GPU total."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"sample{i}"):
                step()
            torch.cuda.synchronize()
    ev = prof.events()
    marks = sorted((e for e in ev if e.name.startswith("sample") and e.device_type == torch.autograd.DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    kernels = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith("sample")),
                     key=lambda e: e.time_range.start)
    out = []
    for i, m in enumerate(marks):
        t0 = m.time_range.start
        t1 = marks[i + 1].time_range.start if i + 1 < len(marks) else float("inf")
        ks = [k for k in kernels if t0 <= k.time_range.start < t1]
        if not ks:
            continue
        out.append(dict(host_us=m.time_range.end - t0, first_kernel_us=ks[0].time_range.start - t0,
                        last_end_us=max(k.time_range.end for k in ks) - t0,
                        kernels_us=sum(k.time_range.end - k.time_range.start for k in ks),
                        kernels=[(k.name[:48], round(k.time_range.start - t0, 1),
                                  round(k.time_range.end - k.time_range.start, 1)) for k in ks]))
    return out


def run(n: int, gen) -> list[dict]:
    k, v = (torch.randn(b, n, hkv, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    if a.prefill:
        q = torch.randn(b, n, h, d, device=dev, dtype=dt, generator=gen)
        t0 = time.perf_counter()
        with torch.no_grad():
            longattn.attention(q, k, v, causal=True)
        torch.cuda.synchronize()
        log(f"  prefill {n}: {time.perf_counter() - t0:.1f} s")
        del q
    per = a.warmup + a.iters + a.profiled
    cache = longattn.KVCache.from_prefill(k, v, reserve=per * len(a.order) + 8)
    kc, vc = (x.transpose(1, 2).contiguous() for x in (k, v))  # SDPA's head-major copy
    kc, vc = (torch.cat([x, torch.zeros_like(x[:, :, :1])], 2) for x in (kc, vc))
    del k, v
    kn, vn, qn = (torch.randn(b, 1, hh, d, device=dev, dtype=dt, generator=gen) for hh in (hkv, hkv, h))

    def ours(backend):
        def step():
            return cache.attend(qn, k_new=kn, v_new=vn, backend=backend)
        return step

    def theirs():
        qh, kh, vh = qn.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2)

        def step():  # the new token's slot overwritten each step: one length, one cuDNN plan (the bench's row)
            p_ = n
            kc[:, :, p_:p_ + 1] = kh
            vc[:, :, p_:p_ + 1] = vh
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return sdpa(qh, kc[:, :, :p_ + 1], vc[:, :, :p_ + 1], enable_gqa=True)
        return step

    rows = []
    with torch.no_grad():
        for i, what in enumerate(a.order):
            step = theirs() if what == "sdpa" else ours(what)
            warm = [cold(step) for _ in range(a.warmup)]
            samples = [cold(step) for _ in range(a.iters)]
            prof = profiled(step, a.profiled)
            rows.append(dict(context=n, position=i, impl=what, warmup_ms=[w[0] for w in warm],
                             warmup_host_ms=[w[1] for w in warm], samples_ms=[s[0] for s in samples],
                             host_ms=[s[1] for s in samples],
                             median_ms=statistics.median(s[0] for s in samples), profiled=prof))
            log(f"  {n} {what}: {rows[-1]['median_ms']:.3f} ms")
    return rows


gen = torch.Generator(device=dev).manual_seed(0)
rows = [r for n in a.context for r in run(n, gen)]
if a.json:
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_cold_probe", env=environment(dev, " ".join(["python"] + sys.argv)), results=rows), f, indent=1)
for r in rows:
    print(f"{r['context']:>8} #{r['position']} {r['impl']:>6}: median {r['median_ms']:.3f} ms; samples "
          + " ".join(f"{x:.3f}" for x in r["samples_ms"]) + "; host " + " ".join(f"{x:.3f}" for x in r["host_ms"][:4]))
for r in rows:
    for s in r["profiled"]:
        print(f"{r['context']:>8} #{r['position']} {r['impl']:>6} profiled: host {s['host_us']:.0f} us, first kernel at "
              f"{s['first_kernel_us']:.0f}, last end {s['last_end_us']:.0f}, kernels {s['kernels_us']:.0f}: "
              + "; ".join(f"{k[0][:24]}@{k[1]:.0f}+{k[2]:.0f}" for k in s["kernels"]))
