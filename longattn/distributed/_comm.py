"""Process-group plumbing: group names for custom ops, the ring exchange,
and the cross-rank consistency check that turns would-be hangs into errors."""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def resolve_group(group) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first "
                           "(or use the single-device ops)")
    return dist.group.WORLD if group is None else group


def group_name(group) -> str:
    """A custom op cannot take a ProcessGroup; it takes this name (as
    PyTorch's own context-parallel code does)."""
    from torch.distributed.distributed_c10d import _get_process_group_name

    return _get_process_group_name(resolve_group(group))


def group_from_name(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


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

    def start(self, tensors: Sequence[torch.Tensor], send_to: int, recv_from: int) -> None:
        assert self._reqs is None, "previous exchange not waited"
        bufs = [torch.empty_like(t) for t in tensors]
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

    def ring(self, tensors: Sequence[torch.Tensor]) -> None:
        """Send to the next peer, receive from the previous one."""
        self.start(tensors, self.rank + 1, self.rank - 1)


# Bytes this process sent through P2P exchanges (tests and the volume helper check it).
traffic = {"bytes_sent": 0}


_checked: set = set()


def _device_for(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_consistent(group, what: str, **fields) -> None:
    """Raise ValueError on every rank when ``fields`` differ across ranks.

    One small all-gather per distinct local signature (cached): a rank whose
    shapes or flags differ sees the others' values and every rank raises the
    same error instead of deadlocking in the ring. Limitation: once a
    signature was checked, a later call where only some ranks change shape
    again is caught by the collective's own size check, not by this one.
    """
    key = (id(group), what, tuple(sorted(fields.items())))
    if key in _checked:
        return
    text = repr(sorted(fields.items())).encode()
    digest = int.from_bytes(hashlib.sha1(text).digest()[:7], "little")
    t = torch.tensor([digest], dtype=torch.int64, device=_device_for(group))
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    vals = [int(x.item()) for x in gathered]
    if len(set(vals)) != 1:
        bad = [r for r, v in enumerate(vals) if v != vals[dist.get_rank(group)]]
        raise ValueError(
            f"{what}: arguments differ across ranks (this rank {dist.get_rank(group)} has "
            f"{dict(sorted(fields.items()))}; ranks {bad} differ). Every rank must pass the same "
            f"shapes (local shard), dtype and flags.")
    _checked.add(key)
