"""Where a generation loop's decode step spends its GPU and host time:
``KVCache`` (``attend(q, k_new=, v_new=)``: the append in the step's call,
``backend="auto"``) against SDPA's cuDNN over a preallocated head-major
cache (the new token written in, attention over ``n + 1`` keys), one layer,
one query, 32q/8kv, D=128, bf16, batch 1.

For each context: each step's time back to back (CUDA events over ``--steps``
steps, as ``python -m longattn.bench decode --timing batched``), the host's
time to issue one step (the GPU held behind a sleep, so the host never waits),
the kernels of ``--steps`` steps under the profiler (name, count per step,
GPU us per step), so the two steps' kernels can be read side by side, and
the host functions of as many steps under cProfile (the 15 with the most
time of their own, us per step).

    python benchmarks/decode_step_profile.py --json out.json
"""
import argparse
import contextlib
import cProfile
import json
import pstats
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.profiler import ProfilerActivity, profile

import longattn
from longattn.bench.measure import environment, result_path

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, nargs="+", default=[131072, 1048576])
p.add_argument("--steps", type=int, default=50)
p.add_argument("--json")
a = p.parse_args()
dev, dt = torch.device("cuda"), torch.bfloat16
b, h, hkv, d = 1, 32, 8, 128
log = lambda m: print(m, file=sys.stderr, flush=True)


def steps_ours(n, gen):
    k, v = (torch.randn(b, n, hkv, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    cache = longattn.KVCache.from_prefill(k, v, reserve=20 * a.steps + 64)
    del k, v
    kn, vn, qn = (torch.randn(b, 1, hh, d, device=dev, dtype=dt, generator=gen) for hh in (hkv, hkv, h))

    def step():
        return cache.attend(qn, k_new=kn, v_new=vn)
    return step, cache


def steps_sdpa(n, gen):
    kc, vc = (torch.randn(b, hkv, n + 1, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    kn, vn = (torch.randn(b, hkv, 1, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    qn = torch.randn(b, h, 1, d, device=dev, dtype=dt, generator=gen)

    def step():  # under sdpa_kernel(CUDNN_ATTENTION), entered once around the measurement
        kc[:, :, n:n + 1] = kn
        vc[:, :, n:n + 1] = vn
        return sdpa(qn, kc, vc, enable_gqa=True)
    return step, (kc, vc)


def measure(step):
    with torch.no_grad():
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.steps):
            step()
        e1.record()
        e1.synchronize()
        batched = e0.elapsed_time(e1) / a.steps
        torch.cuda._sleep(int(2e9))  # about a second of GPU spin: the host issues every step without waiting
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        host = (time.perf_counter() - t0) / a.steps * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))
        cp = cProfile.Profile()
        cp.enable()
        for _ in range(a.steps):
            step()
        cp.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(cp).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    host_fns = {f"{fn[2]} ({'/'.join(fn[0].split('/')[-2:])}:{fn[1]})": dict(
        per_step=round(v[0] / a.steps, 2), own_us_per_step=round(v[2] / a.steps * 1e6, 2),
        cum_us_per_step=round(v[3] / a.steps * 1e6, 2)) for fn, v in top}
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            x = kernels.setdefault(e.key, dict(per_step=0.0, us_per_step=0.0))
            x["per_step"] = round(x["per_step"] + e.count / a.steps, 2)
            x["us_per_step"] = round(x["us_per_step"] + us / a.steps, 2)
    return dict(step_ms=batched, host_ms=host, kernels=kernels, host_functions=host_fns,
                gpu_us_per_step=round(sum(x["us_per_step"] for x in kernels.values()), 2))


rows = []
for n in a.context:
    for name, make in (("KVCache auto", steps_ours), ("SDPA cuDNN", steps_sdpa)):
        gen = torch.Generator(device=dev).manual_seed(0)
        step, keep = make(n, gen)
        log(f"{name}, context {n}")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if name.startswith("SDPA") else contextlib.nullcontext():
            r = dict(impl=name, context=n, **measure(step))
        rows.append(r)
        del step, keep
        torch.cuda.empty_cache()

if a.json:
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_step_profile", env=environment(dev, " ".join(["python"] + sys.argv)),
                       results=rows), f, indent=1)
for r in rows:
    print(f"{r['impl']:>13} {r['context']:>8}: step {r['step_ms']:.3f} ms back to back, host {r['host_ms']:.3f} ms, "
          f"kernels {r['gpu_us_per_step']:.1f} us/step")
    for k, x in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["us_per_step"]):
        print(f"    {x['us_per_step']:8.2f} us  x{x['per_step']:<5} {k[:90]}")
    for k, x in list(r["host_functions"].items())[:8]:
        print(f"    host {x['own_us_per_step']:7.2f} us own, {x['cum_us_per_step']:7.2f} cumulative  x{x['per_step']:<5} {k}")
