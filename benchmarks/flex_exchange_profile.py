"""ring_flex_attention's engines per rank: forward and forward + backward
times (median of REPS calls, each after a barrier), the peak above the
inputs, and (PROFILE=1, the default) one forward + backward's kernel
timeline from torch.profiler (STACK=1: also the ops that launched the most
GPU time, each with the longattn lines that called it). ``flex-exchange:FIELD=VALUE,...`` is the
exchange under ``FlexExchangeTuning(FIELD=VALUE, ...)`` (e.g.
``concurrent=0``: no side stream; ``split_chain=64``: the pieces with one
long side as views in batch rows): the measurements behind those fields.
``flex-exchange-serial`` is ``flex-exchange:concurrent=0``. GRAPH=1 (with
PROFILE=0) also times each impl's forward + backward captured in one CUDA
graph and replayed (no host time: what the host costs). HOSTPROF=1 (with
PROFILE=0) also records cProfile of 5 forward + backward calls queued back to
back (host time by function, own and cumulative, including any time the host
waits), times 10 forward + backward calls each queued behind a 40 ms GPU
sleep: the call's host time (what issuing it costs; longer if it waits on
the GPU) and its GPU time alone (from the end of the sleep), and records
cProfile of 5 calls queued behind such a sleep (what issuing costs by
function, with nothing to wait for). BATCH=N (with PROFILE=0) also times N
forward + backward calls queued back to back, 3 rounds (ms per call). An impl may be
listed twice (timed twice, alternating). One JSON per rank in OUTDIR; rank 0
prints a line per (config, impl).

    NCCL_NVLS_ENABLE=0 PROFILE=0 REPS=15 IMPLS="flex-exchange flex-exchange:concurrent=0" \
        torchrun --nproc_per_node=4 benchmarks/flex_exchange_profile.py OUTDIR flex_swg_128k flex_doc_128k

IMPLS: flex-exchange[:FIELD=VALUE,...], flex-exchange-serial, flex-ring, flex-ring-contiguous (default:
flex-exchange flex-ring).
"""
import json, os, shlex, sys, time
import torch, torch.distributed as dist
from torch.profiler import profile, ProfilerActivity
from longattn.bench import dist as bd, measure
from longattn.bench.configs import CONFIGS
from longattn.bench.torch_cp import flex_dist_build

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
cfgs = sys.argv[2:] or ["flex_swg_128k", "flex_doc_128k"]
impls = os.environ.get("IMPLS", "flex-exchange flex-ring").split()
rank, world, dev = bd._init()
res = {}
for name in cfgs:
    cfg = CONFIGS[name]
    q, k, v = bd._inputs(cfg, cfg.seqlen, dev, torch.bfloat16)
    for impl in impls:
        if impl == "flex-exchange-serial":
            impl = "flex-exchange:concurrent=0"
        fn, (ql, kl, vl) = flex_dist_build(cfg, impl, q, k, v)
        ql, kl, vl = (x.detach().requires_grad_() for x in (ql, kl, vl))
        do = torch.randn_like(ql)
        def step():
            o = fn(ql, kl, vl)
            o = o[0] if isinstance(o, tuple) else o
            o.backward(do)
            ql.grad = kl.grad = vl.grad = None
        for _ in range(3):
            step()
        torch.cuda.synchronize(); dist.barrier()
        # plain timing: fwd only and fwd+bwd
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ts = []
        for _ in range(int(os.environ.get('REPS', 5))):
            dist.barrier(); torch.cuda.synchronize()
            ev[0].record()
            with torch.no_grad():
                fn(ql, kl, vl)
            ev[1].record(); torch.cuda.synchronize()
            dist.barrier(); torch.cuda.synchronize()
            ev[2].record(); step(); ev[3].record(); torch.cuda.synchronize()
            ts.append((ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])))
        ts.sort(key=lambda t: t[1]); mid = len(ts) // 2
        torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        step(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        dist.barrier(); torch.cuda.synchronize()
        if os.environ.get('PROFILE', '1') == '0':
            key = f'{name}/{impl}'
            while key in res: key += '+'
            res[key] = {'fwd_ms': ts[mid][0], 'fwd_bwd_ms': ts[mid][1], 'peak_mib': peak, 'all': ts}
            if rank == 0: print(f'{name} {impl} x{world}: peak {peak:.0f} MiB fwd {ts[mid][0]:.2f} fwd+bwd {ts[mid][1]:.2f}', flush=True)
            if int(os.environ.get('BATCH', 0)) > 0:  # BATCH calls queued back to back, 3 rounds: ms per call
                nb, per = int(os.environ['BATCH']), []
                for _ in range(3):
                    dist.barrier(); torch.cuda.synchronize()
                    ev[2].record()
                    for _ in range(nb):
                        step()
                    ev[3].record(); torch.cuda.synchronize()
                    per.append(ev[2].elapsed_time(ev[3]) / nb)
                res[key]['batched_fwd_bwd_ms'] = sorted(per)[1]
                res[key]['batched_all'] = per
                if rank == 0: print(f'{name} {impl} x{world}: {nb} back to back, per call ' +
                                    ' '.join(f'{x:.2f}' for x in per), flush=True)
            if os.environ.get('HOSTPROF') == '1':
                dist.barrier(); torch.cuda.synchronize()
                for order, text in measure.host_profile(step, 5, dev).items():
                    res[key][f'host_profile_{order}'] = text
                cyc = int(2e7)  # GPU sleep calibrated: cycles per ms
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); torch.cuda._sleep(cyc); e1.record(); torch.cuda.synchronize()
                per_ms = cyc / e0.elapsed_time(e1)
                hs, gs = [], []
                for _ in range(10):
                    dist.barrier(); torch.cuda.synchronize()
                    torch.cuda._sleep(int(40 * per_ms))
                    ev[2].record()
                    t0 = time.perf_counter(); step(); hs.append((time.perf_counter() - t0) * 1e3)
                    ev[3].record(); torch.cuda.synchronize()
                    gs.append(ev[2].elapsed_time(ev[3]))
                res[key]['after_sleep'] = {'host_ms': sorted(hs)[5], 'gpu_ms': sorted(gs)[5], 'all': list(zip(hs, gs))}
                # the same calls profiled behind the sleep: the host's own cost by function, with nothing on the GPU
                # it could wait for (the back-to-back profile above also holds any time the host blocks)
                def queued():
                    torch.cuda._sleep(int(40 * per_ms))
                    step()
                dist.barrier(); torch.cuda.synchronize()
                for order, text in measure.host_profile(queued, 5, dev).items():
                    res[key][f'host_profile_behind_sleep_{order}'] = text
                if rank == 0: print(f"{name} {impl} x{world}: behind a 40 ms GPU sleep: host {sorted(hs)[5]:.2f} ms, "
                                    f"GPU alone {sorted(gs)[5]:.2f} ms", flush=True)
            if os.environ.get('GRAPH') == '1':  # the same fwd+bwd captured in one CUDA graph: no host time at all
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step(); step()
                    torch.cuda.current_stream().wait_stream(side)
                    dist.barrier(); torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    gt = []
                    for _ in range(int(os.environ.get('REPS', 5))):
                        dist.barrier(); torch.cuda.synchronize()
                        ev[2].record(); graph.replay(); ev[3].record(); torch.cuda.synchronize()
                        gt.append(ev[2].elapsed_time(ev[3]))
                    gt.sort()
                    res[key]['graphed_fwd_bwd_ms'] = gt[len(gt) // 2]
                    if rank == 0: print(f'{name} {impl} x{world}: captured in a CUDA graph fwd+bwd {gt[len(gt) // 2]:.2f}', flush=True)
                    del graph
                except Exception as e:  # noqa: BLE001 - recorded: whether it captures is part of the answer
                    res[key]['graphed_error'] = f'{type(e).__name__}: {str(e)[:300]}'
                    if rank == 0: print(f'{name} {impl} x{world}: capture failed: {res[key]["graphed_error"]}', flush=True)
            del fn, ql, kl, vl
            continue
        stacks = os.environ.get('STACK') == '1'
        # verbose: the Python frames of each op are kept on its event (without it the stacks come back empty)
        extra = dict(with_stack=True, experimental_config=torch.profiler._ExperimentalConfig(verbose=True)) \
            if stacks else {}
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], **extra) as prof:
            step(); torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        t0 = min(e.time_range.start for e in evs) if evs else 0
        tl = sorted(((e.time_range.start - t0) / 1e3, e.time_range.elapsed_us() / 1e3, e.name[:90]) for e in evs)
        tot = {}
        for _, d, n in tl:
            tot[n] = tot.get(n, 0) + d
        top = sorted(tot.items(), key=lambda x: -x[1])[:25]
        cpu = sorted(((e.cpu_time_total / 1e3, e.key) for e in prof.key_averages() if e.cpu_time_total > 200), reverse=True)[:25]
        res[f"{name}/{impl}"] = {"fwd_ms": ts[mid][0], "fwd_bwd_ms": ts[mid][1], "peak_mib": peak,
                                 "timeline": [t for t in tl if t[1] > 0.02], "top": top, "cpu_top": cpu,
                                 "gpu_busy_ms": sum(d for _, d, n in tl if "nccl" not in n.lower()),
                                 "span_ms": max(s + d for s, d, _ in tl) if tl else 0}
        if stacks:  # the ops that launched the most GPU time, with the longattn lines that called them
            ops = [e for e in prof.key_averages(group_by_stack_n=8) if e.self_device_time_total > 20]
            res[f"{name}/{impl}"]["by_stack"] = [
                (e.key, round(e.self_device_time_total / 1e3, 3), e.count, [f for f in e.stack if "longattn" in f][:4])
                for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:30]]
        if rank == 0:
            print(f"{name} {impl} x{world}: peak {peak:.0f} MiB fwd {ts[mid][0]:.2f} fwd+bwd {ts[mid][1]:.2f} span {res[f'{name}/{impl}']['span_ms']:.2f} busy {res[f'{name}/{impl}']['gpu_busy_ms']:.2f}", flush=True)
        del fn, ql, kl, vl
res["_meta"] = {"commit": measure.git_commit(),
               "device": torch.cuda.get_device_name(dev), "world": world, "torch": torch.__version__,
               "command": " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in (
                   "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE", "IMPLS", "REPS", "BATCH", "PROFILE", "HOSTPROF", "GRAPH",
                   "STACK") if k in os.environ)
               + f" torchrun --nproc_per_node={world} " + " ".join(sys.argv)}
json.dump(res, open(os.path.join(out_dir, f"prof_r{rank}.json"), "w"), indent=0)
dist.barrier()
dist.destroy_process_group()
