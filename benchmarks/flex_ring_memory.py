"""What ``ring_flex_attention`` keeps alive at its peak, in shards, on CPU.

Runs one forward + backward per pattern on gloo ranks (spawned processes),
records every allocation with the profiler (address, bytes, time, Python
stack), and prints for rank 0: the peak bytes allocated during the call (the
measure ``longattn.bench`` takes on GPUs, there through the caching
allocator: allocations above the inputs), the same for the forward alone, and
the allocations live at the peak grouped by the line of longattn that made
them, in units of one shard (one local q/k/v/out tensor: batch x
seqlen_local x heads x headdim in the input dtype).

Each transport the ring can take on GPUs is modelled: ``nccl`` is gloo's
send/recv (receive buffers allocated per exchange, sends held until the
wait, as NCCL's); ``copy`` replaces the exchange with one that has the copy
transport's memory (``CopyEngineP2P``): two slots per tag, allocated once
outside the allocator and added to the peak as ``longattn.bench`` adds
``symmetric_bytes()``, blocks sent from the send slot and received into the
other, ``fresh`` receives and ``release`` sends as there.

Head dim is large and seqlen small so that the dense score matrices of
FlexAttention's eager CPU path (which the GPU kernels never materialise) stay
small next to a shard; temporaries made and freed inside calls that are one
kernel on CUDA (``KERNEL_LIKE``) are left out unless ``--eager-temporaries``.

    PYTHONPATH=. python benchmarks/flex_ring_memory.py --world 2 --seqlen 512 --heads 2 --head-dim 4096
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch.distributed as dist  # noqa: E402

import longattn  # noqa: E402
from longattn import masks  # noqa: E402
from longattn.distributed import transport  # noqa: E402


def _patterns(s: int):
    docs = torch.arange(s) * 7 // s
    return {"local_global": masks.local_global(s // 32, 16),
            "causal_documents": masks.and_(masks.causal(), masks.document(docs)),
            "causal": masks.causal()}


KERNEL_LIKE = ("_higher_order_ops/flex_attention.py", "merge_into", "_functorch/_aot_autograd")
"""Calls that are kernels on CUDA: torch's FlexAttention forward and backward (eager on
CPU: dense scores, upcasts, repeated K/V; the backward reached through AOTAutograd's
runtime) and the lse merge (one Triton pass, in place)."""


class _SlotExchange(transport.P2P):
    """The copy transport's memory on gloo (see the module docstring): the
    slots of each tag (grown, never shrunk) in ``SLOTS``, outside the
    profiled call once the warm-up calls made them."""

    SLOTS: dict = {}

    def __init__(self, group, tag: str):
        super().__init__(group)
        self.tag, self._held = tag, None

    def start(self, tensors, send_to, recv_from, fresh=False, release=False):
        sizes = [t.numel() * t.element_size() for t in tensors]
        sl = self.SLOTS.get(self.tag)
        if sl is None or sl["cap"] < sum(sizes):
            sl = self.SLOTS[self.tag] = dict(cap=sum(sizes), buf=torch.empty(2 * sum(sizes), dtype=torch.uint8), n=0)
        n, sl["n"] = sl["n"], sl["n"] + 1
        sends, recvs, off = [], [], 0
        for t, nb in zip(tensors, sizes):
            mine = sl["buf"][(n % 2) * sl["cap"] + off:][:nb].view(t.dtype).view(t.shape)
            if not (t.is_contiguous() and t.data_ptr() == mine.data_ptr()):
                mine.copy_(t)
            theirs = sl["buf"][((n + 1) % 2) * sl["cap"] + off:][:nb].view(t.dtype).view(t.shape)
            sends.append(mine)
            recvs.append(torch.empty_like(t, memory_format=torch.contiguous_format) if fresh else theirs)
            off += nb
        src, dst = self.global_rank(recv_from), self.global_rank(send_to)
        ops = [op for a, b in zip(sends, recvs) for op in (dist.P2POp(dist.isend, a, dst, self.group),
                                                           dist.P2POp(dist.irecv, b, src, self.group))]
        self._reqs, self._bufs = dist.batch_isend_irecv(ops), recvs
        self._held = None if release else list(tensors)

    def wait(self):
        self._held = None
        return super().wait()

    @classmethod
    def slot_bytes(cls) -> int:
        return sum(2 * sl["cap"] for sl in cls.SLOTS.values())


def _use_transport(name: str) -> None:
    """The ring's exchanges for ``name`` (``transport.exchange``, which the
    ring's transport looks up at each call, is replaced in this process)."""
    if name == "copy":
        transport.exchange = lambda group, peers=None, tag="kv", name=None, copy_sync=None: _SlotExchange(group, tag)
    else:
        transport.exchange = _EXCHANGE


_EXCHANGE = transport.exchange


def _live_at_peak(trace: str, kernel_like: bool):
    """(peak bytes, [(bytes, stack)] live at the peak) from a chrome trace. With
    ``kernel_like``, an allocation made and freed inside one call of a
    ``KERNEL_LIKE`` function is left out (the GPU kernels keep no such
    temporaries): what remains is what the ring itself holds."""
    with open(trace) as f:
        ev = json.load(f)["traceEvents"]
    mem = sorted((e for e in ev if e.get("name") == "[memory]"), key=lambda e: (e["ts"], -e["args"]["Bytes"]))
    py = [e for e in ev if e.get("cat") == "python_function"]

    def frames_at(ts, tid):
        return sorted((p for p in py if p.get("tid") == tid and p["ts"] <= ts <= p["ts"] + p.get("dur", 0)),
                      key=lambda p: p["ts"])

    def temporary(frames, t_free):
        outer = [p for p in frames if any(f in p["name"] for f in KERNEL_LIKE)]
        # the profiler stamps a frame's end a little before the frees of its locals
        return bool(outer) and t_free is not None and t_free <= outer[0]["ts"] + outer[0].get("dur", 0) + 50

    allocs, open_at = [], {}
    for e in mem:
        a, n = e["args"]["Addr"], e["args"]["Bytes"]
        if n > 0:
            open_at[a] = len(allocs)
            allocs.append([n, e["ts"], e.get("tid"), None])
        elif a in open_at:
            allocs[open_at.pop(a)][3] = e["ts"]
    keep = []
    for n, ts, tid, tf in allocs:
        fr = frames_at(ts, tid)
        if kernel_like and temporary(fr, tf):
            continue
        keep.append((n, ts, tf, [p["name"] for p in fr]))
    events = sorted([(ts, i, n) for i, (n, ts, tf, _) in enumerate(keep)]
                    + [(tf, i, -n) for i, (n, ts, tf, _) in enumerate(keep) if tf is not None],
                    key=lambda x: (x[0], x[2]))
    cur = peak = 0
    live, at_peak = set(), set()
    for _, i, n in events:
        cur += n
        (live.add if n > 0 else live.discard)(i)
        if cur > peak:
            peak, at_peak = cur, set(live)
    return peak, [(keep[i][0], keep[i][3]) for i in at_peak]


def _site(frames) -> str:
    ours = [f.split("longattn/")[-1] for f in frames if "longattn/" in f and "bench" not in f]
    return " < ".join(reversed(ours[-3:])) if ours else (frames[-1] if frames else "?")


def _run(rank, world, args, out_dir):
    torch.manual_seed(rank)
    b, l, h, d = 1, args.seqlen // world, args.heads, args.head_dim
    dt = getattr(torch, args.dtype)
    shard = b * l * h * d * dt.itemsize
    pats = _patterns(args.seqlen)
    report = {}
    for tname, name in [(t, n) for t in args.transports for n in args.patterns]:
        _use_transport(tname)
        _SlotExchange.SLOTS.clear()
        mask = pats[name]
        q, k, v = (torch.randn(b, l, h, d, dtype=dt).requires_grad_() for _ in range(3))
        dout = torch.randn(b, l, h, d, dtype=dt)
        call = lambda: longattn.ring_flex_attention(q, k, v, mask_mod=mask, layout=args.layout)
        for _ in range(2):  # plans and block masks are built and cached by the first call
            call().backward(dout)
            q.grad = k.grad = v.grad = None
        res = {}
        for phase in ("fwd", "fwd+bwd"):
            trace = os.path.join(out_dir, f"{name}_{phase}_{rank}.json")
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
                if phase == "fwd":
                    with torch.no_grad():
                        call()
                else:
                    call().backward(dout)
                    q.grad = k.grad = v.grad = None
            prof.export_chrome_trace(trace)
            peak, live = _live_at_peak(trace, not args.eager_temporaries)
            groups = collections.Counter()
            for n, frames in live:
                groups[_site(frames)] += n
            slots = _SlotExchange.slot_bytes() if tname == "copy" else 0
            if slots:
                groups["exchange slots (symmetric memory on GPUs)"] += slots
            peak += slots
            res[phase] = dict(peak_shards=peak / shard,
                              live=[(site, n / shard) for site, n in groups.most_common() if n / shard >= 0.01])
        report[f"{tname} {name}"] = res
    if rank == 0:
        print(f"world {world}, {args.layout}, B=1 S={args.seqlen} H={h} D={d} {args.dtype}; "
              f"1 shard = {shard / 2**20:.2f} MiB")
        for name, res in report.items():
            for phase, r in res.items():
                print(f"\n{name} {phase}: peak {r['peak_shards']:.2f} shards; live at the peak:")
                for site, s in r["live"]:
                    print(f"  {s:6.2f}  {site}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=512, help="global sequence length")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--eager-temporaries", action="store_true",
                   help="count the temporaries of torch's eager FlexAttention too (no GPU kernel has them)")
    p.add_argument("--patterns", nargs="+", default=["local_global", "causal_documents"])
    p.add_argument("--transports", nargs="+", default=["copy", "nccl"], choices=["copy", "nccl"],
                   help="the exchange whose memory is modelled (see the module docstring)")
    args = p.parse_args()
    from dist_utils import run_world

    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_run, args.world, args, out_dir)


if __name__ == "__main__":
    main()
