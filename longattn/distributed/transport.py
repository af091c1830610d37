"""How ring steps move blocks between ranks: batched NCCL/gloo send/recv
(:class:`P2P`), or copy engines over peer memory for ranks of one host
(:class:`CopyEngineP2P`), and the choice between them (:func:`exchange`)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._config import ENV, TRANSPORTS
from .._streams import side_stream
from . import checks


class P2P:
    """Batched point-to-point exchange over a ring of peers (group ranks;
    default: the whole group in order): send tensors to one peer, receive
    same-shaped tensors from another, wait after the overlapping compute.
    Indices passed to ``start`` are positions in the peer ring."""

    def __init__(self, group: dist.ProcessGroup, peers: Optional[Sequence[int]] = None):
        self.group = group
        me = dist.get_rank(group)
        self.peers = list(range(dist.get_world_size(group))) if peers is None else list(peers)
        self.rank = self.peers.index(me)
        self.size = len(self.peers)
        self.bytes_sent = 0
        self._reqs = None
        self._bufs = None

    def global_rank(self, index: int) -> int:
        return dist.get_global_rank(self.group, self.peers[index % self.size])

    def start(self, tensors: Sequence[torch.Tensor], send_to: int, recv_from: int, fresh: bool = False,
              release: bool = False) -> None:
        """``fresh``: the received tensors must not share memory with anything
        (they are returned to the caller); NCCL receives are always fresh.
        ``release``: the caller drops the sent tensors now (the copy transport
        then frees them before ``wait``; send/recv holds them until it)."""
        assert self._reqs is None, "previous exchange not waited"
        # contiguous receive buffers: a P2P receive needs one (empty_like keeps a permuted input's strides)
        bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        dst, src = self.global_rank(send_to), self.global_rank(recv_from)
        ops = []
        for t, b in zip(tensors, bufs):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), dst, self.group))
            ops.append(dist.P2POp(dist.irecv, b, src, self.group))
            self.bytes_sent += t.numel() * t.element_size()
            traffic["bytes_sent"] += t.numel() * t.element_size()
        self._reqs = dist.batch_isend_irecv(ops)
        self._bufs = bufs

    def wait(self) -> list[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        bufs, self._reqs, self._bufs = self._bufs, None, None
        return bufs


# Bytes this process sent through P2P exchanges (tests and the volume helper check it).
traffic = {"bytes_sent": 0}


class CopyEngineP2P(P2P):
    """The same exchange through CUDA peer memory, for ranks of one host.

    NCCL's send/recv kernels occupy SMs while the attention kernels run (2.5%
    of a 128K ring step on 2 H200s, docs/performance.md); here the receiver
    pulls the sender's block with ``cudaMemcpyAsync`` from a symmetric-memory
    buffer, which the copy engines carry over NVLink, and the ranks signal
    each other with stream memory operations (``cuStreamWriteValue32`` into
    the peer's flag, ``cuStreamWaitValue32`` on one's own), which the GPU's
    front end executes: no SM takes part. Where the driver refuses stream
    memory operations, a barrier kernel of symmetric memory orders the
    exchange instead.

    Two slots per rank, alternating with the exchange number n (counted per
    slot set, across calls): exchange n sends from slot n % 2 and receives into
    slot (n + 1) % 2, so a block received at exchange n is sent at n + 1
    without a copy (the ring's K/V, the backward's dK/dV). Tensors not already
    in the send slot are copied into it first. Contract (what the ring does):
    once ``start`` is called, the tensors an earlier ``wait`` returned are dead
    except those being sent.

    Exchange n, on a side stream that first waits for the compute stream:
    fill the send slot; READY(receiver)[me] := n + 1; wait READY(mine)[sender]
    >= n + 1 (the sender's slot holds block n); wait DONE(mine)[p] >= n, p the
    rank that pulled from me at exchange n - 1 (it finished reading the slot I
    now receive into); pull; DONE(sender)[me] := n + 1. ``wait`` makes the
    compute stream wait for the pull. Flags are per (rank, peer): partners
    change (the backward's last hop goes straight home when the ring stops
    early), and one counter per rank would let a later sender's write satisfy
    a wait meant for another.
    """

    ALIGN = 256

    def __init__(self, group: dist.ProcessGroup, tag: str, copy_sync: str = "memops"):
        super().__init__(group)
        self.tag, self.copy_sync = tag, copy_sync
        self._event = None
        self._hold = None
        self._stream = side_stream(torch.cuda.current_device(), "ring transport")

    def start(self, tensors: Sequence[torch.Tensor], send_to: int, recv_from: int, fresh: bool = False,
              release: bool = False) -> None:
        """``release``: the tensors are copied into the send slot on the calling
        stream, not the exchange's, so their memory is free for the next kernel
        once the caller drops them (at the cost of that copy on the calling stream)."""
        assert self._event is None, "previous exchange not waited"
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        sl = _symmetric_slots(self.group, self.tag, total, self.copy_sync)
        buf, hdl, cap, n = sl.buf, sl.hdl, sl.cap, sl.n
        sl.n += 1
        send, recv = n % 2, (n + 1) % 2
        src_rank = self.peers[recv_from % self.size]
        dst_rank = self.peers[send_to % self.size]
        last_dst, sl.last_dst = sl.last_dst, dst_rank
        cur = torch.cuda.current_stream()
        # fresh receives are allocated on the compute stream, which waits for the pull before any use
        outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors] if fresh else None
        if release:
            self._fill(tensors, buf, send * cap, offsets)
        self._stream.wait_stream(cur)
        views = []
        with torch.cuda.stream(self._stream):
            if not release:
                self._fill(tensors, buf, send * cap, offsets)
            if sl.memops:
                ops, st = _memops(), self._stream
                ops.write(st, sl.flag(dst_rank, _READY, sl.rank), n + 1)
                ops.wait_geq(st, sl.flag(sl.rank, _READY, src_rank), n + 1)
                if last_dst is not None:
                    ops.wait_geq(st, sl.flag(sl.rank, _DONE, last_dst), n)
            else:
                hdl.barrier(channel=0)
            for t, off in zip(tensors, offsets):
                nbytes = t.numel() * t.element_size()
                theirs = _as(hdl.get_buffer(src_rank, (nbytes,), torch.uint8, send * cap + off), t)
                dst = outs[len(views)] if fresh else _as(buf[recv * cap + off: recv * cap + off + nbytes], t)
                dst.copy_(theirs)  # peer memory -> local: a copy-engine transfer
                views.append(dst)
            if sl.memops:
                _memops().write(self._stream, sl.flag(src_rank, _DONE, sl.rank), n + 1)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        self._hold = ([] if release else list(tensors), views)

    def _fill(self, tensors, buf, base: int, offsets) -> None:
        """The send slot (bytes from ``base``) takes the tensors not already in it."""
        for t, off in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            mine = _as(buf[base + off: base + off + nbytes], t)
            if not (t.is_contiguous() and t.data_ptr() == mine.data_ptr()):
                mine.copy_(t)
            self.bytes_sent += nbytes
            traffic["bytes_sent"] += nbytes

    def wait(self) -> list[torch.Tensor]:
        torch.cuda.current_stream().wait_event(self._event)
        views = self._hold[1]
        self._event = self._hold = None
        return views


def _as(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return raw.view(like.dtype).view(like.shape)


class _MemOps:
    """cuStreamWriteValue32 / cuStreamWaitValue32 from the driver (ctypes: torch exposes no wait)."""

    def __init__(self):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        for f in (self._write, self._wait):
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed with CUresult {code}")

    def write(self, stream, addr: int, value: int) -> None:
        self._check(self._write(stream.cuda_stream, addr, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")

    def wait_geq(self, stream, addr: int, value: int) -> None:  # CU_STREAM_WAIT_VALUE_GEQ = 0
        self._check(self._wait(stream.cuda_stream, addr, value & 0xFFFFFFFF, 0), "cuStreamWaitValue32")


_memops_obj: list = []


def _memops() -> _MemOps:
    if not _memops_obj:
        _memops_obj.append(_MemOps())
    return _memops_obj[0]


_READY, _DONE = 0, 1


def _flag_bytes(world: int) -> int:
    """READY and DONE: one int32 per peer each, padded to 256 bytes."""
    return -(-8 * world // 256) * 256


class _Slots:
    """A rank's two exchange slots and its READY/DONE flags in one symmetric buffer."""

    def __init__(self, buf, hdl, cap: int, rank: int, memops: bool):
        self.buf, self.hdl, self.cap, self.rank, self.memops = buf, hdl, cap, rank, memops
        self.n = 0  # exchanges made with these slots (flags count them; both survive calls)
        self.last_dst = None  # who pulled from these slots at exchange n - 1
        self.world = len(hdl.buffer_ptrs)

    def flag(self, rank: int, which: int, peer: int) -> int:
        """Address of ``rank``'s READY or DONE flag for ``peer``."""
        return int(self.hdl.buffer_ptrs[rank]) + 2 * self.cap + 4 * (which * self.world + peer)


# (group name, tag) -> _Slots; grown, never shrunk.
_slots: dict = {}


def _memops_usable(device: torch.device, flag: torch.Tensor, copy_sync: str) -> bool:
    """Whether the driver runs stream memory operations here (one write + wait
    on a local flag) and the copy transport is not told to use the barrier."""
    if copy_sync == "barrier":
        return False
    try:
        ops, st = _memops(), torch.cuda.current_stream(device)
        ops.write(st, flag.data_ptr(), 1)
        ops.wait_geq(st, flag.data_ptr(), 1)
        torch.cuda.synchronize(device)
        ok = int(flag.view(torch.int32)[0].item()) == 1
        flag.zero_()
        torch.cuda.synchronize(device)
        return ok
    except (OSError, AttributeError, RuntimeError):
        return False


def _symmetric_slots(group, tag: str, nbytes: int, copy_sync: str) -> _Slots:
    """A rank's exchange slots in symmetric memory (a collective the first time
    and when a larger block arrives: every rank asks for the same sizes in the
    same order, since shapes were checked consistent)."""
    import torch.distributed._symmetric_memory as symm_mem

    key = (group.group_name, tag)
    have = _slots.get(key)
    if have is not None and have.cap >= nbytes:
        return have
    cap = max(nbytes, have.cap if have else 0)
    if have is not None:  # no peer may still be pulling from the old slots when they are freed
        torch.cuda.synchronize()
        dist.barrier(group=group)
        del _slots[key], have
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
            symm_mem.enable_symm_mem_for_group(group.group_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = symm_mem.empty(2 * cap + _flag_bytes(dist.get_world_size(group)), dtype=torch.uint8, device=dev)
    buf[2 * cap:].zero_()
    memops = _memops_usable(dev, buf[2 * cap: 2 * cap + 4], copy_sync)
    hdl = symm_mem.rendezvous(buf, group.group_name)
    # every rank must take the same path (and have zeroed its flags before any peer writes them)
    agree = torch.tensor([1 if memops else 0], device=dev)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    _slots[key] = _Slots(buf, hdl, cap, dist.get_rank(group), bool(agree.item()))
    return _slots[key]


def release_slots() -> None:
    """Drop the exchange slots (the next exchange allocates them again)."""
    if _slots:  # called by every rank at the same point; no peer may still be pulling
        torch.cuda.synchronize()
        dist.barrier()
        _slots.clear()


def slot_syncs() -> set[str]:
    """How the copy exchanges of this process's slots are ordered: 'memops' or 'barrier'."""
    return {"memops" if sl.memops else "barrier" for sl in _slots.values()}


def symmetric_bytes() -> int:
    """Bytes this process holds in exchange slots (benchmarks add them to peak memory:
    they live outside the caching allocator's counters)."""
    return sum(sl.buf.numel() for sl in _slots.values())


_transport_override: list = []


@contextlib.contextmanager
def use_transport(name: str, copy_sync: Optional[str] = None):
    """Force the ring transport inside the block: ``"copy"`` (peer memory, copy
    engines), ``"nccl"`` (send/recv through the process group) or ``"auto"``.
    ``copy_sync="barrier"`` orders copy exchanges with a barrier kernel instead
    of stream memory operations (slots allocated inside the block keep it;
    :func:`release_slots` drops earlier ones). Defaults: ``LONGATTN_RING_TRANSPORT``,
    ``LONGATTN_COPY_SYNC``."""
    if name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {name!r}")
    if copy_sync not in (None, "memops", "barrier"):
        raise ValueError(f"copy_sync must be 'memops', 'barrier' or None, got {copy_sync!r}")
    _transport_override.append((name, copy_sync or _choice()[1]))
    try:
        yield
    finally:
        _transport_override.pop()


def _choice() -> tuple[str, str]:
    return _transport_override[-1] if _transport_override else (ENV.ring_transport, ENV.copy_sync)


def requested() -> tuple[str, str]:
    """(transport, copy_sync) a ring call takes now (see :func:`use_transport`):
    read once per call, when its plan is made
    (:func:`longattn.distributed.ring_plan.choose_transport`)."""
    return _choice()


def transport() -> str:
    """The transport ring calls take now (see :func:`use_transport`)."""
    return _choice()[0]


_peer_ok: dict = {}


def copy_engine_refusal(group) -> str:
    """Why the copy-engine transport cannot serve ``group`` ('' when it can).
    A collective the first time per group (every rank must agree)."""
    if not checks.nccl_on_cuda(group):
        return f"backend {dist.get_backend(group)} (needs nccl on CUDA)"
    key = group.group_name
    if key not in _peer_ok:
        import socket

        try:
            import torch.distributed._symmetric_memory  # noqa: F401
            have = True
        except Exception:  # pragma: no cover - builds without symmetric memory
            have = False
        me = (socket.gethostname(), torch.cuda.current_device(), have)
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, me, group=group)
        if not all(e[2] for e in everyone):
            _peer_ok[key] = "torch.distributed._symmetric_memory unavailable on some rank"
        elif len({e[0] for e in everyone}) != 1:
            _peer_ok[key] = "ranks span several hosts"
        else:
            devs = [e[1] for e in everyone]
            bad = [d for d in devs if d != me[1] and not torch.cuda.can_device_access_peer(me[1], d)]
            local_bad = torch.tensor([1 if bad else 0], device=torch.device("cuda", me[1]))
            dist.all_reduce(local_bad, group=group)
            _peer_ok[key] = "no peer access between some GPUs" if int(local_bad.item()) else ""
    return _peer_ok[key]


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


def resolve(group: dist.ProcessGroup, name: str) -> str:
    """The exchange a ring call over the whole of ``group`` uses for the
    transport ``name``: ``"copy"``, copy engines over peer memory (ranks of
    one host with peer access); ``"nccl"``, batched send/recv through the
    process group. ``"auto"`` takes copy where it can (torch >= 2.9, whose
    symmetric-memory API this was tested with) and send/recv elsewhere (other
    backends, several hosts). ValueError where ``"copy"`` cannot serve the
    group. docs/performance.md has both measured side by side."""
    if name == "nccl" or (name == "auto" and not _torch_at_least(2, 9)):
        return "nccl"
    why = copy_engine_refusal(group)
    if not why:
        return "copy"
    if name == "copy":
        raise ValueError(f"ring transport 'copy' refused: {why} (use 'nccl' or 'auto')")
    return "nccl"


def exchange(group: dist.ProcessGroup, peers: Optional[Sequence[int]] = None, tag: str = "kv",
             name: Optional[str] = None, copy_sync: Optional[str] = None) -> P2P:
    """The ring's exchange object for the transport ``name`` (default: the one
    :func:`use_transport` or the environment sets now; see :func:`resolve`).
    Sub-rings (``peers`` not the whole group) exchange by send/recv."""
    name, copy_sync = name or transport(), copy_sync or _choice()[1]
    whole = peers is None or list(peers) == list(range(dist.get_world_size(group)))
    if whole and resolve(group, name) == "copy":
        return CopyEngineP2P(group, tag, copy_sync)
    return P2P(group, peers)


def ring_transport(group: dist.ProcessGroup, peers: Optional[Sequence[int]] = None, name: Optional[str] = None,
                   copy_sync: Optional[str] = None):
    """``transport(tag) -> exchange`` for the ring algorithm: one exchange per
    tag (``"kv"``, ``"dkv"``) over ``group`` (a sub-ring of ``peers`` where
    given), for the transport ``name`` (see :func:`exchange`)."""
    return lambda tag: exchange(group, peers, tag, name, copy_sync)
