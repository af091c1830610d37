"""What a Ulysses call keeps alive at its peak, in shards, on CPU (gloo ranks;
no GPU needed): the accounting behind ``benchmarks/ulysses_memory.py`` (the
printed report) and ``tests/test_ulysses.py`` (the pinned peaks).

For a case, one forward (no grad) and one forward + backward as
``longattn.bench dist`` measures them (the output is alive through the
backward, gradients land in ``.grad``), every allocation recorded by the
profiler (address, bytes, time, the Python frames and ops around it): the
peak bytes allocated during the call above what was allocated before it, and
what is live at that peak, grouped by where it was made, in shards: one shard
is one rank's local q at 16 heads (batch x seqlen/p x 16 x headdim in the
input dtype; a GQA case's 32 query heads are two).

The local attention is the math backend in float32 on a short sequence with a
large head dim: its float32 copies are no-ops, and what it makes and frees
inside one call (score blocks, GQA's expanded k/v and their gradients:
temporaries a GPU kernel keeps in its own workspace, if at all) is left out
(``KERNEL_LIKE``); its outputs (out, lse, dq, dk, dv) are counted. lse is
(B, H, S) float32, small next to a shard at this head dim.

Head groups: each case runs with the groups ``UlyssesTuning`` gives the same
heads at the GPU shape of the table it stands for (``gpu_rows``: query rows
per head of one kernel call at 131072 tokens), forced onto the small shape.
Frees made by gloo's worker thread are not recorded (NCCL releases a finished
collective's buffers at the wait): a wait here gives the worker time to let go
first (:func:`settled_waits`), a measurement that still misses a free is
taken again, and what stays unseen is reported.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

import longattn

from ..distributed.ulysses import HeadPlan
from ..tuning import UlyssesTuning
from .measure import _quiet_profiler

# name: (kind, layout, causal, nheads, nheads_kv, doc lengths, gpu_rows)
CASES = {
    # dense_128k_causal (dense_128k: the same exchanges and memory)
    "dense MHA contiguous causal": ("dense", "contiguous", True, 16, 16, None, 131072),
    "dense MHA zigzag causal": ("dense", "zigzag", True, 16, 16, None, 131072),
    # gqa_32q8kv_128k_causal
    "dense GQA 32q/8kv contiguous causal": ("dense", "contiguous", True, 32, 8, None, 131072),
    # varlen_mix_32k at 128K: mean document 4096 tokens, one cuDNN call each on CUDA (VarlenTuning)
    "varlen MHA contiguous (mix docs)": ("varlen", "contiguous", True, 16, 16, [16, 1, 4, 1, 8, 2, 1, 31], 4096),
    # varlen_chat_16k at 128K: mean 1160 tokens, one FlashAttention varlen call over all of them
    "varlen GQA 32q/8kv contiguous (chat docs)": ("varlen", "contiguous", True, 32, 8, [3, 9, 15, 24, 7, 6], 131072),
    "varlen MHA zigzag (mix docs)": ("varlen", "zigzag", True, 16, 16, [16, 1, 4, 1, 8, 2, 1, 31], 4096),
}

KERNEL_LIKE = ("longattn/backends/", "_attention_fwd", "_attention_bwd")
"""Frames whose own temporaries are not counted: the local backends (and the
kernel ops around them). What they return is counted."""



def site(frames) -> str:
    """The innermost longattn frames (outside the benchmark suite) of an allocation."""
    ours = [f.split("longattn/")[-1] for f in frames if "longattn/" in f and "bench" not in f]
    return " < ".join(reversed(ours[-3:])) if ours else (frames[-1] if frames else "?")


def _frames_at(ts, tid, spans):
    return [p for p in spans if p.get("tid") == tid and p["ts"] <= ts <= p["ts"] + p.get("dur", 0)]


def live_at_peak(trace: str, kernel_like: tuple = KERNEL_LIKE):
    """From a chrome trace: (peak bytes, [(bytes, where)] live at the peak,
    the most bytes live at the end of a local backward call, what is live
    then, bytes whose free the profiler did not see), leaving out what a
    ``kernel_like`` call made and freed itself; ``where`` names the longattn
    frames (:func:`site`) and the op and autograd node that made it.
    On a GPU the backward kernel's own workspace comes on top of the third
    number while the kernel runs."""
    with open(trace) as f:
        ev = json.load(f)["traceEvents"]
    mem = sorted((e for e in ev if e.get("name") == "[memory]"), key=lambda e: (e["ts"], -e["args"]["Bytes"]))
    spans = sorted((e for e in ev if e.get("cat") in ("python_function", "cpu_op")), key=lambda e: e["ts"])
    allocs, open_at, unseen = [], {}, 0
    for e in mem:
        a, n = e["args"]["Addr"], e["args"]["Bytes"]
        if n > 0:
            if a in open_at:  # freed where the profiler does not look (a gloo worker thread): by now at the latest
                allocs[open_at[a]][3] = e["ts"]
                unseen += allocs[open_at[a]][0]
            open_at[a] = len(allocs)
            allocs.append([n, e["ts"], e.get("tid"), None])
        elif a in open_at:
            allocs[open_at.pop(a)][3] = e["ts"]
    unseen += sum(a[0] for a in allocs if a[3] is None)  # the call frees all it makes: these went unseen
    # per thread, the start times of its spans: a frame's locals are freed at its return, after the profiler
    # stamps its end (by a few us, or more on a loaded machine) and before the thread's next span starts
    starts: dict = {}
    for p in spans:
        starts.setdefault(p.get("tid"), []).append(p["ts"])

    def returned_by(frame) -> float:
        end = frame["ts"] + frame.get("dur", 0)
        later = starts.get(frame.get("tid"), [])
        i = bisect.bisect_left(later, end)
        return max(end + 50, later[i]) if i < len(later) else float("inf")

    keep = []
    for n, ts, tid, t_free in allocs:
        fr = _frames_at(ts, tid, spans)
        outer = [p for p in fr if p.get("cat") == "python_function" and any(k in p["name"] for k in kernel_like)]
        if outer and t_free is not None and t_free <= returned_by(outer[0]):
            continue
        py = [p["name"] for p in fr if p.get("cat") == "python_function"]
        ops = [p["name"] for p in fr if p.get("cat") == "cpu_op"]
        node = [o.split(": ")[-1] for o in ops if o.startswith("autograd::engine::evaluate_function")]
        aten = [o for o in ops if o.startswith("aten::")]
        where = site(py) + " [" + ", ".join(node[-1:] + aten[:1]) + "]"
        keep.append((n, ts, t_free, where))
    events = sorted([(ts, i, n) for i, (n, ts, _, _) in enumerate(keep)]
                    + [(tf, i, -n) for i, (n, _, tf, _) in enumerate(keep) if tf is not None],
                    key=lambda x: (x[0], x[2]))
    # the local backward calls: a GPU kernel's workspace adds to what is live at their end
    bwd_ends = sorted(p["ts"] + p.get("dur", 0) for p in spans if p.get("cat") == "python_function"
                      and any(k in p["name"] for k in kernel_like) and ("bwd" in p["name"] or "backward" in p["name"])
                      and not any(k in q["name"] for q in _frames_at(p["ts"], p.get("tid"), spans)
                                  if q is not p and q.get("cat") == "python_function" for k in kernel_like))
    cur = peak = at_bwd = 0
    live, at_peak, at_bwd_live = set(), set(), set()
    for ts, i, n in events:
        while bwd_ends and bwd_ends[0] < ts:
            if cur > at_bwd:
                at_bwd, at_bwd_live = cur, set(live)
            bwd_ends.pop(0)
        cur += n
        (live.add if n > 0 else live.discard)(i)
        if cur > peak:
            peak, at_peak = cur, set(live)
    listed = lambda ids: [(keep[i][0], keep[i][3]) for i in sorted(ids)]
    return peak, listed(at_peak), at_bwd, listed(at_bwd_live), unseen


@contextlib.contextmanager
def settled_waits(delay_s: float = 0.002):
    """Every wait of a functional collective gives gloo's worker thread
    ``delay_s`` to drop its reference to the finished work, so that the
    buffers the work held are freed by the thread that drops them last in the
    code, where the profiler sees it (as NCCL releases them at the wait).
    Without it, frees race to the worker thread and go unrecorded."""
    ns = torch.ops._c10d_functional
    real = ns.wait_tensor

    def wait(t):
        out = real(t)
        time.sleep(delay_s)
        return out

    ns.wait_tensor = wait
    try:
        yield
    finally:
        ns.wait_tensor = real


def groups_for(case, world: int) -> int:
    """Head groups the tuning gives ``case``'s heads at its GPU shape."""
    _, _, _, h, hkv, _, rows = case
    return UlyssesTuning().chunks(HeadPlan(h, hkv, world), rows)


def _forced(groups: int) -> dict:
    return dict(tuning=UlyssesTuning(max_chunks=groups, min_chunk_rows=0))


def inputs(case, world: int, rank: int, seqlen: int, head_dim: int, dtype):
    """This rank's (q, k, v, dout) and cu_seqlens (None for dense)."""
    kind, layout, _, h, hkv, docs, _ = case
    g = torch.Generator().manual_seed(0)
    if kind == "dense":
        full = [torch.randn(1, seqlen, n, head_dim, generator=g, dtype=dtype) for n in (h, hkv, hkv, h)]
        return [longattn.shard(x, layout=layout) for x in full], None
    lens = [n * seqlen // sum(docs) for n in docs]
    lens[-1] += seqlen - sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    full = [torch.randn(seqlen, n, head_dim, generator=g, dtype=dtype) for n in (h, hkv, hkv, h)]
    return [longattn.shard_varlen(x, cu, layout=layout)[0] for x in full], cu


def call(case, q, k, v, cu, extra):
    kind, layout, causal = case[:3]
    if kind == "dense":
        f = longattn.ulysses_attention
        return f(q, k, v, causal=causal, layout=layout, backend="math", **extra)
    return longattn.ulysses_attention_varlen(q, k, v, cu, causal=causal, layout=layout, backend="math", **extra)


def measure(case, world, rank, seqlen, head_dim, dtype, out_dir, groups=None):
    """({"fwd": ..., "fwd+bwd": ...}, the shard in bytes, the head groups it
    ran with): per phase a dict of the peak in shards, what is live then
    ([(shards, where)]), the same at the end of the fullest local backward
    call, and the shards freed where the profiler did not see it (counted
    live until their address came back, or to the end)."""
    from torch.profiler import ProfilerActivity, profile

    (q, k, v, dout), cu = inputs(case, world, rank, seqlen, head_dim, dtype)
    shard = q.numel() // q.shape[-2] * 16 * q.element_size()
    n = groups or groups_for(case, world)
    extra = _forced(n)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    for _ in range(2):  # the cached checks and index tensors are made here
        call(case, qg, kg, vg, cu, extra).backward(dout)
        qg.grad = kg.grad = vg.grad = None
    res = {}
    for phase in ("fwd", "fwd+bwd"):
        trace = os.path.join(out_dir, f"{phase}_{rank}.json")
        for _ in range(3):  # a free the profiler missed only adds: measure again
            with settled_waits(), _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                                             with_stack=True) as prof:
                if phase == "fwd":
                    with torch.no_grad():
                        call(case, q, k, v, cu, extra)
                else:
                    call(case, qg, kg, vg, cu, extra).backward(dout)
                    qg.grad = kg.grad = vg.grad = None
            prof.export_chrome_trace(trace)
            peak, live, at_bwd, bwd_live, unseen = live_at_peak(trace)
            missed = torch.tensor([unseen >= shard // 100])
            dist.all_reduce(missed, dist.ReduceOp.MAX)  # every rank measures again, or none
            if not missed:
                break
        res[phase] = dict(peak=peak / shard, live=_by_site(live, shard), at_local_backward=at_bwd / shard,
                          live_at_local_backward=_by_site(bwd_live, shard), unseen_frees=unseen / shard)
    return res, shard, n


def _by_site(live, shard):
    sites = collections.Counter()
    for b, where in live:
        sites[where] += b
    return [(round(b / shard, 3), where) for where, b in sites.most_common() if b / shard >= 0.01]
