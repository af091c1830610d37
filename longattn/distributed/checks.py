"""Process-group plumbing every distributed op uses: resolving the group,
passing it through custom ops by name, and the cross-rank consistency check
that turns would-be hangs into errors."""
from __future__ import annotations

import hashlib

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
