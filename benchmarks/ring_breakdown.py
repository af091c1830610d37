"""Where ring attention's parallel efficiency goes (N GPUs, NCCL).

    torchrun --nproc_per_node=N benchmarks/ring_breakdown.py [--seqlens 32768 131072] [--tag NAME]

For each case (B=1, H=16, D=128, bf16; non-causal contiguous and causal
zigzag) it times, forward and forward+backward:

* ``single``: ``longattn.attention`` (cuDNN) on the whole sequence, rank 0 alone;
* ``ring``: ``ring_attention`` as shipped;
* ``ring_<transport>``: the same with another transport (``--transports nccl copy``:
  NCCL send/recv, then copy engines over peer memory);
* ``nocomm``: the same ring with its P2P exchange replaced by a no-op (every
  rank keeps its own K/V and dK/dV buffers): the same calls and merges, no
  traffic and no NCCL kernels beside the attention kernels.

``single / (N * nocomm)`` is the efficiency the local work allows (kernel
efficiency on the split problem + merges); ``nocomm / ring`` is what the
exchange costs on top (NCCL kernels sharing the SMs, waits). A profiler pass
over one forward+backward on rank 0 sums GPU kernel time by class (attention,
NCCL, the rest: merges, casts, accumulation). Rank 0 appends one JSON line per
case to $OUT/ring_breakdown.jsonl and prints a table.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import longattn
from longattn.bench import measure
from longattn.distributed import _comm

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
p.add_argument("--heads", type=int, default=16)
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--iters", type=int, default=5)
p.add_argument("--tag", default="default")
p.add_argument("--transports", nargs="+", default=["nccl"], choices=["nccl", "copy", "auto"],
               help="ring transports to time; the first is reported as 'ring'")
p.add_argument("--batched", action="store_true", help="calls back to back, time per call (measure.time_ms)")
p.add_argument("--timeline", action="store_true", help="also record one forward's GPU timeline (gaps)")
p.add_argument("--high-priority", action="store_true", help="NCCL streams at high priority (pg_options)")
args = p.parse_args()

GPU = torch.cuda.is_available()  # CPU + gloo runs the same script as a smoke test
if GPU:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
pg_options = None
if GPU and args.high_priority:
    pg_options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
dist.init_process_group("nccl" if GPU else "gloo", pg_options=pg_options)
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", torch.cuda.current_device()) if GPU else torch.device("cpu")
DT = torch.bfloat16 if GPU else torch.float32
H, D = args.heads, 128
TRANSPORTS = tuple(args.transports)


class _NoComm:
    """Stand-in for P2P.start/wait: hands back the tensors it was given."""

    def start(self, tensors, send_to, recv_from, fresh=False):
        self._bufs = [t.clone() for t in tensors] if fresh else list(tensors)

    def wait(self):
        bufs, self._bufs = self._bufs, None
        return bufs


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed(fn):
    # every rank runs the same number of calls per sample (each holds collectives)
    agree = lambda reps: int(_max_over_ranks(reps))
    return _max_over_ranks(measure.time_ms(fn, dev, warmup=args.warmup, iters=args.iters, batched=args.batched,
                                           agree=agree)["median_ms"])


def _classes(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if GPU else ProfilerActivity.CPU]) as prof:
        fn()
        measure.sync(dev)
    agg = {"attention": 0.0, "nccl": 0.0, "other": 0.0}
    others = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.key.startswith("ProfilerStep") or us <= 0:
            continue
        name = e.key.lower()
        if "nccl" in name:
            agg["nccl"] += us / 1e3
        elif any(t in name for t in ("fmha", "flash", "cudnn", "attn", "attention", "sm90_", "sdpa")):
            agg["attention"] += us / 1e3
        else:
            agg["other"] += us / 1e3
            others.append((round(us / 1e3, 3), e.count, e.key[:70]))
    agg["top_other"] = sorted(others, reverse=True)[:8]  # (ms, calls, kernel): merges, casts, accumulation
    return agg


def _timeline(fn):
    try:
        return _timeline_of(fn)
    except Exception as e:  # noqa: BLE001 - a diagnostic must not end the run
        return dict(cpu_issue_ms=float("nan"), error=repr(e)[:300])


def _timeline_of(fn):
    """GPU timeline of one call: when the first kernel starts after the call
    begins on the CPU, how long the GPU is busy, the largest idle gaps, and the
    CPU time until the call returns (issue time, no sync)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    measure.sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("timed_call"):
            t0 = time.perf_counter()
            fn()
            issue = (time.perf_counter() - t0) * 1e3
        measure.sync(dev)
    evs = prof.events()
    call = next(e for e in evs if e.name == "timed_call" and e.device_type == DeviceType.CPU)
    kern = sorted((e for e in evs if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kern:
        return dict(cpu_issue_ms=issue)
    busy, gaps, end = 0.0, [], kern[0].time_range.start
    for e in kern:
        a, b = e.time_range.start, e.time_range.end
        if a > end:
            gaps.append(((a - end) / 1e3, e.name[:60]))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    gaps.sort(reverse=True)
    return dict(cpu_issue_ms=issue, first_kernel_after_ms=(kern[0].time_range.start - call.time_range.start) / 1e3,
                span_ms=(end - call.time_range.start) / 1e3, gpu_busy_ms=busy / 1e3, top_gaps=gaps[:6],
                first_kernels=[e.name[:50] for e in kern[:6]])


rows = []
for S in args.seqlens:
    for causal, layout in ((False, "contiguous"), (True, "zigzag")):
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, S, H, D, device=dev, dtype=DT, generator=g) for _ in range(3))
        res = dict(tag=args.tag, batched=args.batched, high_priority_streams=args.high_priority, world=world, seqlen=S, heads=H, causal=causal, layout=layout,
                   device=torch.cuda.get_device_name(dev) if GPU else "cpu", torch=torch.__version__,
                   commit=os.environ.get("LONGATTN_COMMIT", "unknown"),
                   nccl_env={k_: v_ for k_, v_ in os.environ.items() if k_.startswith("NCCL_")})
        if rank == 0:
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            do = torch.randn_like(q)

            def s_fwd():
                with torch.no_grad():
                    longattn.attention(q, k, v, causal=causal)

            def s_step():
                longattn.attention(qg, kg, vg, causal=causal).backward(do)
                qg.grad = kg.grad = vg.grad = None
            res["single_fwd_ms"] = measure.time_ms(s_fwd, dev, warmup=args.warmup, iters=args.iters, batched=args.batched)["median_ms"]
            res["single_fwd_bwd_ms"] = measure.time_ms(s_step, dev, warmup=args.warmup, batched=args.batched,
                                                       iters=args.iters)["median_ms"]
            if args.timeline and GPU:
                res["single_timeline_fwd"] = _timeline(s_fwd)
            del qg, kg, vg, do
        dist.barrier()
        ql, kl, vl = (longattn.shard(x, layout=layout) for x in (q, k, v))
        del q, k, v
        qg, kg, vg = (x.detach().requires_grad_() for x in (ql, kl, vl))
        do = torch.randn_like(ql)

        def r_fwd():
            with torch.no_grad():
                longattn.ring_attention(ql, kl, vl, causal=causal, layout=layout)

        def r_step():
            longattn.ring_attention(qg, kg, vg, causal=causal, layout=layout).backward(do)
            qg.grad = kg.grad = vg.grad = None

        for tr in TRANSPORTS:
            with _comm.use_transport(tr):
                key = "ring" if tr == TRANSPORTS[0] else f"ring_{tr}"
                res[f"{key}_fwd_ms"], res[f"{key}_fwd_bwd_ms"] = _timed(r_fwd), _timed(r_step)
                res[f"{key}_classes_ms"] = _classes(r_step)
            if args.timeline and GPU:
                res[f"{key}_timeline_fwd"] = _timeline(r_fwd)
                res[f"{key}_timeline_fwd_bwd"] = _timeline(r_step)
        res["transports"] = list(TRANSPORTS)
        real_start, real_wait = _comm.P2P.start, _comm.P2P.wait
        try:
            _comm.P2P.start, _comm.P2P.wait = _NoComm.start, _NoComm.wait
            with _comm.use_transport("nccl"):  # a plain P2P object, whose exchange is the no-op
                res["nocomm_fwd_ms"], res["nocomm_fwd_bwd_ms"] = _timed(r_fwd), _timed(r_step)
                res["nocomm_classes_ms"] = _classes(r_step)
                if args.timeline and GPU:
                    res["nocomm_timeline_fwd_bwd"] = _timeline(r_step)
        finally:
            _comm.P2P.start, _comm.P2P.wait = real_start, real_wait
        t1 = torch.tensor([res.get("single_fwd_ms", 0.0), res.get("single_fwd_bwd_ms", 0.0)], device=dev,
                          dtype=torch.float64)
        dist.broadcast(t1, 0)
        for m, t in (("fwd", t1[0].item()), ("fwd_bwd", t1[1].item())):
            res[f"eff_ring_{m}"] = t / (world * res[f"ring_{m}_ms"])
            for tr in TRANSPORTS[1:]:
                res[f"eff_ring_{tr}_{m}"] = t / (world * res[f"ring_{tr}_{m}_ms"])
            res[f"eff_nocomm_{m}"] = t / (world * res[f"nocomm_{m}_ms"])
        rows.append(res)
        del ql, kl, vl, qg, kg, vg, do
        torch.cuda.empty_cache()
        dist.barrier()

if rank == 0:
    with open(os.path.join(os.environ.get("OUT", "."), "ring_breakdown.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"| tag | GPUs | S | causal | single ms fwd / fwd+bwd | ring | eff ring | nocomm | eff nocomm | "
          f"profile ring attn/nccl/other ms |")
    for r in rows:
        c = r["ring_classes_ms"]
        print(f"| {r['tag']} | {world} | {r['seqlen']} | {r['causal']} | {r['single_fwd_ms']:.2f} / "
              f"{r['single_fwd_bwd_ms']:.2f} | {r['ring_fwd_ms']:.2f} / {r['ring_fwd_bwd_ms']:.2f} | "
              f"{r['eff_ring_fwd']:.3f} / {r['eff_ring_fwd_bwd']:.3f} | {r['nocomm_fwd_ms']:.2f} / "
              f"{r['nocomm_fwd_bwd_ms']:.2f} | {r['eff_nocomm_fwd']:.3f} / {r['eff_nocomm_fwd_bwd']:.3f} | "
              f"{c['attention']:.1f}/{c['nccl']:.1f}/{c['other']:.1f} |")
        print(f"|   ring top other kernels (ms, calls): {c['top_other'][:5]}")
        for key, m in [(k_, m_) for k_ in ["ring"] + [f"ring_{tr}" for tr in TRANSPORTS[1:]] + ["nocomm"]
                       for m_ in ("fwd", "fwd_bwd")]:
            if f"{key}_timeline_{m}" in r:
                t = r[f"{key}_timeline_{m}"]
                print(f"|   {key} {m} timeline: cpu issue {t['cpu_issue_ms']:.2f} ms, first kernel at "
                      f"{t.get('first_kernel_after_ms', 0):.2f}, span {t.get('span_ms', 0):.2f}, busy "
                      f"{t.get('gpu_busy_ms', 0):.2f}, gaps {[(round(g, 3), n) for g, n in t.get('top_gaps', [])[:4]]}")
        for tr in TRANSPORTS[1:]:
            c = r[f"ring_{tr}_classes_ms"]
            print(f"|   ring over {tr} | | | | | {r[f'ring_{tr}_fwd_ms']:.2f} / {r[f'ring_{tr}_fwd_bwd_ms']:.2f} | "
                  f"{r[f'eff_ring_{tr}_fwd']:.3f} / {r[f'eff_ring_{tr}_fwd_bwd']:.3f} | | | "
                  f"{c['attention']:.1f}/{c['nccl']:.1f}/{c['other']:.1f} |")
dist.barrier()
dist.destroy_process_group()
