"""Where a sharded decode step's time goes: one token through ``--layers``
layers' :class:`longattn.KVCache` parts (append + attend, the cache split over
the ranks in the zigzag layout), beside the local attention alone on the same
cache part (``decode_attention`` and SDPA's flash kernel on views, no
collectives), and the step's top kernels and host functions by torch.profiler.

    torchrun --nproc_per_node=2 benchmarks/decode_sharded_profile.py --context 1048576 \\
        --pg-backend nccl --json benchmarks/results/x.json
    torchrun --nproc_per_node=2 benchmarks/decode_sharded_profile.py --pg-backend cpu:gloo,cuda:nccl

``--pg-backend``: the process group's backend. With ``nccl`` alone the
ranks' checks are read back from the GPU (a device sync); with
``cpu:gloo,cuda:nccl`` (what ``init_process_group`` makes on a CUDA machine
when it names none) the checks of calls that exchange nothing else go through
gloo on the host. A sharded step's checks travel in its one all-gather.

Timing: each sample is ``--steps-per-sample`` steps (default one, from an idle
GPU; ranks aligned by a barrier), CUDA events around them, host time beside
(perf_counter to the last launch), per step; the median of ``--iters``. The caches hold random K/V (no prefill: this script
times the step). Rank 0 writes the JSON and prints a table. The step runs
with its checks as ``DecodeTuning.sharded_checks`` picks (``sharded_step``),
then apart and in the partials' all-gather (apart needs a group with a CPU
backend: under ``nccl`` alone its checks travel on the GPU too).
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
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import longattn  # noqa: E402
from longattn.bench.measure import environment, write_json  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1 << 20, help="tokens in each layer's cache, all ranks together")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backend", default="flash", help="the local attention backend of attend() (CPU: use auto)")
    p.add_argument("--pg-backend", default="cpu:gloo,cuda:nccl", help="init_process_group's backend")
    p.add_argument("--iters", type=int, default=10, help="samples (the median is reported)")
    p.add_argument("--steps-per-sample", type=int, default=1,
                   help="steps back to back in a sample (1: a step from an idle GPU; more: as a generation loop)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile 10 steps (as DecodeTuning.sharded_checks picks) queued back to back: the "
                        "host's time by function, where it issues or waits")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def timed(fn, iters: int, cuda: bool, reps: int = 1) -> dict:
    wall, host = [], []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host.append((time.perf_counter() - t0) * 1e3 / reps)
        if cuda:
            b.record()
            b.synchronize()
        wall.append(a.elapsed_time(b) / reps if cuda else host[-1])
    return dict(ms=statistics.median(wall), host_ms=statistics.median(host))


def build(a, dev, dt, rank: int, world: int):
    """``--layers`` sharded caches of random K/V, and one token's (kn, vn, qn)."""
    gen = torch.Generator(device=dev).manual_seed(rank)
    caches = []
    for _ in range(a.layers):
        k, v = (torch.randn(1, a.context // world, a.kv_heads, a.head_dim, device=dev, dtype=dt, generator=gen)
                for _ in range(2))
        caches.append(longattn.KVCache.from_prefill(k, v, layout="zigzag", group=dist.group.WORLD, reserve=4096))
        del k, v
    kn, vn = (torch.randn(1, 1, a.kv_heads, a.head_dim, device=dev, dtype=dt, generator=gen) for _ in range(2))
    return caches, kn, vn, torch.randn(1, 1, a.heads, a.head_dim, device=dev, dtype=dt, generator=gen)


def variants(a, caches, kn, vn, qn, n: int, cuda: bool) -> dict:
    """The sharded step (its checks as ``DecodeTuning.sharded_checks`` picks, then each way: exchanged apart on
    the host, or in the partials' all-gather), and the same attention on this rank's part alone (no
    collective)."""
    lens = torch.tensor([n], dtype=torch.int32)

    def stepper(mode):
        tuning = dataclasses.replace(caches[0].tuning, sharded_checks=mode)  # made once: not in the timed step

        def step():
            for c in caches:
                c.tuning = tuning
                c.append(kn, vn)
                c.attend(qn, backend=a.backend)
        return step

    def local():
        for c in caches:
            longattn.decode_attention(qn, c.k[:, :n], c.v[:, :n], cache_seqlens=lens, backend=a.backend)

    def sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]):
            for c in caches:
                torch.nn.functional.scaled_dot_product_attention(
                    qn.transpose(1, 2), c.k[:, :n].transpose(1, 2), c.v[:, :n].transpose(1, 2), enable_gqa=True)

    steps = {f"sharded_step_checks_{m}": stepper(m) for m in ("apart", "with_partials")}
    return dict(sharded_step=stepper("auto"), **steps, local_decode_attention=local, local_sdpa_flash=sdpa)


def profiled(step, layers: int, cuda: bool):
    """(top kernels, top host functions) of two steps, per layer."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(2):
            step()
            if cuda:
                torch.cuda.synchronize()
    ev, per = prof.key_averages(), 2 * layers
    dev_us = lambda e: getattr(e, "self_device_time_total", 0)
    kernels = [dict(name=e.key[:90], calls_per_layer=e.count / per, device_us_per_layer=dev_us(e) / per)
               for e in sorted(ev, key=lambda e: -dev_us(e))[:8]]
    hosts = [dict(name=e.key[:90], calls_per_layer=e.count / per, cpu_us_per_layer=e.self_cpu_time_total / per)
             for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]]
    return kernels, hosts


def report(a, dev, world: int, n: int, rows: dict, kernels, hosts) -> None:
    env = environment(dev)
    env.update(command=f"torchrun --nproc_per_node={world} " + " ".join(sys.argv), world_size=world)
    if a.json:
        write_json(a.json, dict(benchmark="decode_sharded_profile", env=env, args=vars(a), local_tokens=n, rows=rows,
                                top_kernels=kernels, top_host=hosts))
    print(f"context {a.context} over {world} ranks ({n} local), {a.layers} layers, pg {a.pg_backend}, "
          f"backend {a.backend}: ms per layer (host)")
    for k, r in rows.items():
        if "ms_per_layer" not in r:
            continue
        print(f"  {k:34s} {r['ms_per_layer']:.3f} ({r['host_ms_per_layer']:.3f})")
    for k in kernels or []:
        print(f"  kernel {k['name'][:60]:60s} {k['calls_per_layer']:.1f}/layer {k['device_us_per_layer']:.0f} us")
    print(json.dumps({k: r for k, r in rows.items() if "ms_per_layer" in r}))


def main(argv=None):
    a = parse(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(a.pg_backend if cuda else "gloo")  # CPU: a smoke run
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    caches, kn, vn, qn = build(a, dev, torch.bfloat16 if cuda else torch.float32, rank, world)
    n = caches[0].layout.local[rank][0]
    fns, rows = variants(a, caches, kn, vn, qn, n, cuda), {}
    for name, fn in fns.items():
        for _ in range(a.warmup):
            fn()
        t = timed(fn, a.iters, cuda, a.steps_per_sample)
        rows[name] = dict(ms_per_layer=t["ms"] / a.layers, host_ms_per_layer=t["host_ms"] / a.layers)
    kernels, hosts = (None, None) if a.no_profile else profiled(fns["sharded_step"], a.layers, cuda)
    if a.host_profile:
        from longattn.bench.measure import host_profile

        dist.barrier()
        rows["host_profile"] = host_profile(fns["sharded_step"], 10, dev, (("tottime", 30), ("cumulative", 40)))
        if rank == 0:
            print(rows["host_profile"]["tottime"])
    if rank == 0:
        report(a, dev, world, n, rows, kernels, hosts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
