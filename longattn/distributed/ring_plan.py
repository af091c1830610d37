"""Every choice of one ring call, made once: :class:`RingPlan`.

A public ring op (``ring_attention``, ``ring_attention_varlen``, the spanning
branches of ``dilated_attention(..., group=...)``) builds the plan at the call
from the backends' capabilities, the tuning and the resolved backend name,
and hands it to its forward and backward ops, which both follow it: the
backend of every block, whether packed-document steps fuse into one varlen
launch (:mod:`longattn.distributed.fused_varlen`), the transport. What
follows deterministically from the plan and the call's arguments (the
schedule of steps and calls, :mod:`longattn.distributed.plan`) is rebuilt,
never chosen again. Custom ops cannot take a dataclass, so the plan travels
through them as a string (:meth:`RingPlan.key`), as
:class:`longattn.dilated.plan.DilatedPlan` does.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Iterable, Optional

import torch

from .. import backends as bk
from . import checks
from . import transport as _transport
from .ring import flat_calls


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """How one ring call runs.

    ``backend``: the resolved name the call was made with. ``blocks``: the
    backend of every block kind the call's schedule holds, as ``((scale,
    causal, left, right, q_offset, softcap, seqlen_q, seqlen_k, nheads, nheads_kv),
    backend name)``; None in the plan of a call traced by torch.compile, which
    cannot run the planning: its forward and backward ops complete it from
    the same arguments, the same plan for both (:meth:`complete`). ``fuse``:
    the varlen kernel (``"fa4"``, ``"flash"``) in which a packed-document
    step runs as one launch, where that pays
    (:func:`longattn.distributed.fused_varlen.step_kernel`, ``fused_call``);
    False or "" where steps never fuse.
    ``transport``: ``"copy"`` or ``"nccl"`` (:func:`longattn.distributed.transport.resolve`;
    in a traced call the requested name, resolved for the group alike by both
    passes); ``copy_sync``: how copy exchanges are ordered."""

    backend: str = "auto"
    blocks: Optional[tuple] = None
    fuse: "str | bool" = False
    transport: str = "nccl"
    copy_sync: str = "memops"

    def key(self) -> str:
        return _key(self)

    @staticmethod
    def from_key(key: str) -> "RingPlan":
        return _from_key(key)

    def __post_init__(self):
        # the lookup table of backend_of, made once (hashing the plan per block would cost O(blocks))
        object.__setattr__(self, "_table", dict(self.blocks or ()))

    def complete(self, build) -> "RingPlan":
        """This plan, or where it was made at a traced call, ``build(backend,
        (transport, copy_sync))``: the planning the call would have made (a
        cached pure function of the call's arguments)."""
        return self if self.blocks is not None else build(self.backend, (self.transport, self.copy_sync))

    def backend_of(self, spec: bk.BlockSpec, q: torch.Tensor, k: torch.Tensor) -> str:
        """The backend chosen for a block of ``spec`` on q (B, Sq, H, D), k (B, Sk, Hkv, D)."""
        name = self._table.get(_kind(spec, q, k))
        if name is None:
            raise RuntimeError(f"ring block {_kind(spec, q, k)} is not in the call's plan (planned: "
                               f"{[b for b, _ in self.blocks]})")
        return name

    def transport_for(self, group, peers=None):
        """``transport(tag) -> exchange`` over ``group`` (a sub-ring of ``peers`` where given)."""
        return _transport.ring_transport(group, peers, self.transport, self.copy_sync)


def _kind(spec: bk.BlockSpec, q, k) -> tuple:
    return (spec.scale, spec.causal, *spec.window, spec.q_offset, spec.softcap, q.shape[1], k.shape[1], q.shape[2],
            k.shape[2])


@functools.lru_cache(maxsize=256)
def _key(plan: RingPlan) -> str:
    blocks = None if plan.blocks is None else [[list(k), name] for k, name in plan.blocks]
    return json.dumps([plan.backend, blocks, plan.fuse, plan.transport, plan.copy_sync])


@functools.lru_cache(maxsize=256)
def _from_key(key: str) -> RingPlan:
    backend, blocks, fuse, tr, sync = json.loads(key)
    return RingPlan(backend, None if blocks is None else tuple((tuple(k), name) for k, name in blocks), fuse, tr,
                    sync)


def meta(x: torch.Tensor) -> tuple:
    """What a plan reads of a tensor: (shape, dtype name, device name)."""
    return tuple(int(n) for n in x.shape), str(x.dtype).removeprefix("torch."), str(x.device)


def tensor_like(m: tuple, shape) -> torch.Tensor:
    """A tensor of ``shape`` with the dtype and device of :func:`meta` ``m`` (one element, expanded)."""
    return torch.empty((1,) * len(shape), dtype=getattr(torch, m[1]), device=torch.device(m[2])).expand(*shape)


def block_backends(q_meta: tuple, k_meta: tuple, steps: Iterable, backend: str) -> tuple:
    """``RingPlan.blocks`` for the calls of ``steps`` (each an iterable of
    Calls on a q of ``q_meta`` (B, S, H, D) and a visiting block of
    ``k_meta``, see :func:`meta`): each block kind's backend,
    :func:`longattn.backends.select_backend` on the block's shape
    (``backend`` resolved: a forced name raises here, before any collective,
    where a block refuses it)."""
    qs, ks = q_meta[0], k_meta[0]
    q1, k1 = tensor_like(q_meta, (1, 1, 1, 1)), tensor_like(k_meta, (1, 1, 1, 1))
    out = {}
    for calls in steps:
        for c in flat_calls(calls):
            qb = q1.expand(qs[0], c.q1 - c.q0, qs[2], qs[3])
            kb = k1.expand(ks[0], c.k1 - c.k0, ks[2], ks[3])
            kind = _kind(c.spec, qb, kb)
            if kind not in out:
                out[kind] = bk.select_backend(qb, kb, c.spec, backend).name
    return tuple(sorted(out.items()))


def choose_transport(group, whole: bool = True) -> tuple[str, str]:
    """(transport, copy_sync) of a call on ``group``: the forced or configured
    transport (:func:`longattn.distributed.transport.use_transport`), read
    here once per call, resolved to what serves the group (a collective the
    first time per group; ``whole``: some ring of the call spans the whole
    group, else every ring is a sub-ring and exchanges by send/recv). Traced
    by torch.compile, the name stays (both passes resolve it for the group
    alike)."""
    name, sync = _transport.requested()
    if not whole:
        return "nccl", sync
    if not torch.compiler.is_compiling():
        name = _transport.resolve(group, name)
    return name, sync


# Plans already made, as dilated.plan does: walking every step's blocks costs
# host time each call. Bounded so shapes that never repeat cannot grow it.
_made: dict = {}
_MADE_MAX = 1024


def cached(key: tuple, build, group, what: str) -> RingPlan:
    """``build()``, remembered under ``key`` (everything ``build`` reads).

    A plan is made on every rank of ``group`` at the same call (the same
    calls miss alike): where a rank cannot plan (a forced backend that refuses
    one of its blocks), every rank raises (:func:`longattn.distributed.checks.agree`),
    before any ring step. The group is part of the key: a process in two
    groups of one size, at one rank, makes a plan (and its agreement) in each."""
    key = (checks.group_name(group), *key)
    plan = _made.get(key)
    if plan is None:
        problem = None
        try:
            plan = build()
        except (ValueError, TypeError) as e:
            problem = e
        checks.agree(group, what, problem)
        if len(_made) >= _MADE_MAX:
            _made.clear()
        _made[key] = plan
    return plan


def make(build, backend: str, tr: tuple) -> str:
    """The key of a public call's plan: ``build(backend, tr)``'s, or under
    torch.compile (which cannot trace the planning) a plan of the resolved
    names only, that both ops complete alike (:meth:`RingPlan.complete`)."""
    if torch.compiler.is_compiling():  # RingPlan(backend, None, False, *tr).key(), spelt out for the tracer
        return f'["{backend}", null, false, "{tr[0]}", "{tr[1]}"]'
    return build(backend, tr).key()
