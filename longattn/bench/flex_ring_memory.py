"""What ``ring_flex_attention`` keeps alive at its peak, in shards, on CPU
(gloo ranks; no GPU needed): the accounting behind
``benchmarks/flex_ring_memory.py`` (the printed report) and
``tests/test_flex_ring.py`` (the pinned peaks).

One forward (no grad) and one forward + backward as ``longattn.bench dist``
measures them (the output lives through the backward, gradients land in
``.grad``; the inputs and ``dout`` are allocated before), every allocation
recorded by the profiler: the peak bytes above what was allocated before the
call and what is live then, by where it was made
(:func:`longattn.bench.ulysses_memory.live_at_peak`), in shards: one shard is
one local q/k/v/out tensor (batch x seqlen/p x heads x headdim, input dtype).

Each transport a GPU ring can take is modelled. ``nccl``: gloo's send/recv
(receive buffers allocated per exchange, sends held until the wait, as
NCCL's). ``copy``: an exchange with the memory of the copy transport
(:class:`longattn.distributed.transport.CopyEngineP2P`): two slots per tag,
made once outside the allocator and added to the peak as ``longattn.bench``
adds ``symmetric_bytes()``; blocks sent from the send slot (copied in where
not there already) and received into the other, ``fresh`` receives
allocated, ``release`` sends dropped at the start.

Head dim is large and seqlen small so that the dense score matrices of
FlexAttention's eager CPU path (which the GPU kernels never materialise) stay
small next to a shard; temporaries made and freed inside calls that are one
kernel on CUDA (``KERNEL_LIKE``) are left out. lse is (B, H, S) float32,
small next to a shard at this head dim. From 3 ranks on, float32 sums take
bf16 pieces in place: on CPU each such add makes a float32 copy of the piece
(counted here), which CUDA's kernels do not.

Not seen here: what FlexAttention's compiled (inductor) kernels allocate on a
GPU beyond their outputs; ``tests/test_flex_ring.py``'s GPU test measures the
peak against these numbers.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import longattn

from .. import masks
from ..distributed import transport
from .measure import _quiet_profiler
from .ulysses_memory import _by_site, live_at_peak

KERNEL_LIKE = ("_higher_order_ops/flex_attention.py", "merge_into", "_functorch/_aot_autograd")
"""Calls that are kernels on CUDA: torch's FlexAttention forward and backward
(eager on CPU: dense scores, upcasts, repeated K/V; the backward reached
through AOTAutograd's runtime) and the lse merge (one Triton pass, in place)."""


def patterns(seqlen: int) -> dict:
    """The masks of the bench's flex configs, scaled to ``seqlen``."""
    docs = torch.arange(seqlen) * 7 // seqlen
    return {"local_global": masks.local_global(seqlen // 32, 16),
            "causal_documents": masks.and_(masks.causal(), masks.document(docs)),
            "causal": masks.causal()}


class SlotExchange(transport.P2P):
    """The copy transport's memory on gloo (see the module docstring); the
    slots of each tag (grown, never shrunk) in ``SLOTS``."""

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


@contextlib.contextmanager
def modelled(name: str):
    """Ring exchanges with the memory of transport ``name`` ("copy" or
    "nccl") inside the block: ``transport.exchange``, which a ring's
    transport looks up at each exchange, is replaced in this process."""
    real = transport.exchange
    if name == "copy":
        SlotExchange.SLOTS.clear()
        transport.exchange = lambda group, peers=None, tag="kv", name=None, copy_sync=None: SlotExchange(group, tag)
    try:
        yield
    finally:
        transport.exchange = real


def measure(pattern: str, world: int, rank: int, seqlen: int, heads: int, head_dim: int, dtype, layout: str,
            transport_name: str, out_dir: str) -> tuple[dict, int]:
    """({"fwd": ..., "fwd+bwd": ...}, the shard in bytes): per phase the peak
    in shards (the copy model's slots included), what is live then
    ([(shards, where)]), and the shards whose free the profiler did not see."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(rank)
    b, n = 1, seqlen // world
    q, k, v, dout = (torch.randn(b, n, heads, head_dim, generator=g, dtype=dtype) for _ in range(4))
    shard = q.numel() * q.element_size()
    mask = patterns(seqlen)[pattern]
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    call = lambda *x: longattn.ring_flex_attention(*x, mask_mod=mask, layout=layout, engine="ring")
    res = {}
    with modelled(transport_name):
        for _ in range(2):  # plans, block masks and the slots are made here
            call(qg, kg, vg).backward(dout)
            qg.grad = kg.grad = vg.grad = None
        for phase in ("fwd", "fwd+bwd"):
            trace = os.path.join(out_dir, f"{pattern}_{transport_name}_{phase}_{rank}.json")
            with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                            with_stack=True) as prof:
                if phase == "fwd":
                    with torch.no_grad():
                        call(q, k, v)
                else:
                    call(qg, kg, vg).backward(dout)
                    qg.grad = kg.grad = vg.grad = None
            prof.export_chrome_trace(trace)
            peak, live, _, _, unseen = live_at_peak(trace, KERNEL_LIKE)
            slots = SlotExchange.slot_bytes() if transport_name == "copy" else 0
            if slots:
                live = live + [(slots, "exchange slots (symmetric memory on GPUs)")]
            res[phase] = dict(peak=(peak + slots) / shard, live=_by_site(live, shard), unseen_frees=unseen / shard)
    return res, shard
