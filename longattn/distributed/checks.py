"""Process-group plumbing every distributed op uses: resolving the group
(:func:`resolve_group`, the one resolver: a ProcessGroup, None or a
DeviceMesh dim), passing it through custom ops by name, and the cross-rank
handshake that turns would-be hangs into errors (:func:`handshake`: one
small all-gather of a digest of the call's fields and a per-rank problem
flag). Its two uses: :func:`check_consistent` (shapes and flags, once per
signature, over one group or the groups of a mesh) and :func:`agree` (every
call, with a per-rank problem)."""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist


def resolve_group(group=None, mesh_dim=None, what: str = "group") -> dist.ProcessGroup:
    """The ProcessGroup of ``group``: None (the default group), a
    ProcessGroup, or a DeviceMesh: 1-D, or with ``mesh_dim`` (name or index)
    naming the dimension. ``what`` names the argument in errors."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first "
                           "(or use the single-device ops)")
    if group is None:
        return dist.group.WORLD
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise TypeError(f"{what}: a {group.ndim}-D DeviceMesh where one dimension is needed; pass one dim "
                            f"(e.g. mesh['ulysses']) or mesh_dim, or use context_parallel_attention(..., mesh=mesh) "
                            f"for the Ulysses x ring hybrid")
        return group.get_group(mesh_dim if mesh_dim is not None else 0)
    if mesh_dim is not None:
        raise ValueError(f"mesh_dim is for a DeviceMesh {what}; a ProcessGroup needs none")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what} must be a ProcessGroup, a DeviceMesh or None, got {type(group).__name__}")
    return group


def group_name(group) -> str:
    """A custom op cannot take a ProcessGroup; it takes this name (as
    PyTorch's own context-parallel code does)."""
    from torch.distributed.distributed_c10d import _get_process_group_name

    return _get_process_group_name(resolve_group(group))


def group_from_name(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


_checked: set = set()


def _backend_config(group) -> str:
    """The group's backend per device: "nccl", "gloo", "cpu:gloo,cuda:nccl"
    (what ``init_process_group()`` without a backend makes on a CUDA machine,
    where ``get_backend`` answers "undefined"), ..."""
    try:
        return str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # pragma: no cover - torch without per-device configs
        return str(dist.get_backend(group))


def nccl_on_cuda(group) -> bool:
    """Whether ``group`` moves CUDA tensors through NCCL: ``"nccl"``, or a
    per-device backend such as ``"cpu:gloo,cuda:nccl"``."""
    config = _backend_config(group)
    return config == "nccl" or "cuda:nccl" in config


def _device_for(group) -> torch.device:
    """Where a check's small tensors travel: the CPU wherever the group has a
    CPU backend (``gloo``, or ``"cpu:gloo,cuda:nccl"``), so reading the result
    never waits for the GPU's queue; the GPU under NCCL alone, where reading it
    is a device sync."""
    config = _backend_config(group)
    if "nccl" in config and "cpu:" not in config:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_ints(group, values: Sequence[int], device: Optional[torch.device] = None) -> list[list[int]]:
    """Every rank's ``values`` (the same count of int64 on every rank), as host
    ints, rank order: one small all-gather on ``device`` (default: where the
    group's checks travel, :func:`_device_for`), one device-to-host copy."""
    dev = _device_for(group) if device is None else device
    t = torch.tensor(list(values), dtype=torch.int64, device=dev)
    got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, t, group=group)
    return torch.stack(got).cpu().tolist()


def handshake(group, what: str, problem: Union[None, str, Exception] = None, once: bool = False,
              **fields) -> None:
    """The cross-rank agreement every distributed call makes before its
    collectives: raise on every rank of ``group`` when a rank found a
    ``problem`` or when ``fields`` differ across ranks; nothing otherwise.

    One small all-gather (a digest of ``fields`` and a problem flag per
    rank). ``problem``: None, or this rank's error (an Exception, or a str for
    a ValueError); the rank with a problem raises its own error; where
    ``fields`` differ, every other rank raises a ValueError saying so;
    otherwise one naming the ranks with a problem. ``once``: skip a signature
    (group, what, fields) already agreed on (shapes and flags; never with a
    problem, which may depend on values a signature does not show).

    ``group`` may be a sequence of groups (the dims of a mesh): the handshake
    runs on each in turn, and a group's verdict is a field of the next, so a
    disagreement inside one group makes every later group it meets disagree
    too and no rank waits in a handshake the others skipped."""
    if not isinstance(group, (list, tuple)):
        return _handshake(group, what, problem, once, fields)
    err = None
    for i, g in enumerate(group):
        try:
            _handshake(g, what, problem if err is None else None, once and err is None and problem is None,
                       dict(fields, earlier_dims_agree=err is None) if i else fields)
        except (ValueError, TypeError) as e:
            err = err or e
    if err is not None:
        raise err


def _handshake(group, what, problem, once, fields) -> None:
    key = (id(group), what, tuple(sorted(fields.items())))
    if once and problem is None and key in _checked:
        return
    if isinstance(problem, str):
        problem = ValueError(problem)
    dev = _device_for(group)
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # every rank captures the same calls, so every rank raises here alike (no rank waits in a collective)
        raise problem or ValueError(f"{what}: a first call with these arguments agrees on them across ranks with a "
                                    f"collective read on the host, which CUDA graph capture cannot run: call it once "
                                    f"with these arguments before capturing")
    vals = gather_ints(group, [digest(fields), int(problem is not None)], dev)
    if problem is not None:
        raise problem
    me = dist.get_rank(group)
    bad = [r for r, x in enumerate(vals) if x[0] != vals[me][0]]
    if bad:
        raise differ(what, me, fields, bad)
    raise_flagged(what, None, [r for r, x in enumerate(vals) if x[1]])
    if once:
        _checked.add(key)


def check_consistent(group, what: str, **fields) -> None:
    """Raise ValueError on every rank when ``fields`` differ across ranks
    (:func:`handshake`, once per distinct local signature).

    A rank whose shapes or flags differ sees the others' values and every
    rank raises the same error instead of deadlocking in the ring.
    Limitation: once a signature was checked, a later call where only some
    ranks change shape again is caught by the collective's own size check,
    not by this one. ``group``: one group, or the groups of a mesh (see
    :func:`handshake`)."""
    handshake(group, what, once=True, **fields)


def local_problem(check, *args):
    """``(check(*args), None)``, or ``(None, error)`` where the check raised
    ValueError/TypeError: a per-rank problem for :func:`consistent_call`,
    so that a bad argument on one rank raises on all of them."""
    try:
        return check(*args), None
    except (ValueError, TypeError) as e:
        return None, e


def consistent_call(group, what: str, problem: Optional[Exception] = None, **fields) -> None:
    """:func:`check_consistent` with this rank's ``problem`` (from
    :func:`local_problem`): every rank raises where one has a problem or the
    fields differ, at the first call of a signature. Checked once per
    signature (a ring call per layer and step pays no collective for it), so
    a later call where one rank alone changes an argument is not caught here:
    that rank checks again while the others, whose signature was agreed,
    do not (the limitation :func:`check_consistent` states). Calls whose
    problems can depend on values use :func:`agree`, every call. Under
    torch.compile (no handshake is traced) the problem raises here alone."""
    if torch.compiler.is_compiling():
        if problem is not None:
            raise problem
        return
    handshake(group, what, problem, once=True, **fields)


def digest(fields: dict) -> int:
    """56 bits of a hash of ``fields`` (their repr, sorted): equal on every rank for equal fields."""
    return int.from_bytes(hashlib.sha1(repr(sorted(fields.items())).encode()).digest()[:7], "little")


def raise_flagged(what: str, problem: Optional[Exception], flagged: Sequence[int]) -> None:
    """After an exchange of per-rank problem flags: the rank with a
    ``problem`` raises it, the others a ValueError naming the ``flagged``
    ranks (nothing when none is)."""
    if problem is not None:
        raise problem
    if flagged:
        raise ValueError(f"{what}: rank(s) {list(flagged)} of the group raised an error (see their message); every "
                         f"rank stops here so that none waits in a collective")


def agree(group, what: str, problem: Union[None, str, Exception] = None, **fields) -> None:
    """:func:`handshake` on every call, never cached: a problem may depend
    on values (lengths) that a signature does not show, and a rank that
    exchanged alone would wait in a collective the others skipped."""
    handshake(group, what, problem, **fields)


def differ(what: str, me: int, fields: dict, bad: list[int]) -> ValueError:
    return ValueError(f"{what}: arguments differ across ranks (this rank {me} has {dict(sorted(fields.items()))}; "
                      f"ranks {bad} differ). Every rank must make the same call: the same shapes (its local part), "
                      f"dtypes and flags.")
