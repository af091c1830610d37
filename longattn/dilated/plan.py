"""Which engine runs a dilated call: decided once per call, here.

:func:`choose` reads the backends' capabilities and a
:class:`longattn.tuning.DilatedTuning`, and returns a :class:`DilatedPlan`
that the forward and the backward both follow. Custom ops cannot take a
dataclass, so the plan travels through them as a string (:meth:`DilatedPlan.key`).
"""
from __future__ import annotations

import dataclasses
import functools
import json

import torch

from .. import backends as bk
from .. import tuning as _tuning
from ..kernels.geometry import GroupedPlan, dedup_chain
from .schedule import kv_views_ok

ENGINES = ("views", "gather", "fused")
FUSED_SCHEDULES = ("grouped", "dedup", "per_branch", "per_branch_zero_fill")


@dataclasses.dataclass(frozen=True)
class DilatedPlan:
    """How one dilated call runs.

    ``fwd`` / ``bwd``: ``"views"`` (the local backend on strided views of
    q/k/v), ``"gather"`` (parts copied into dense blocks), ``"fused"`` (our
    Triton kernels, launched per ``fused_schedule``). The views path gathers
    stacked branches of at most ``gather_max_rows`` (row, head) pairs
    (``gather_max_rows_bwd`` in the backward; see :func:`gather_rows`), cuts
    calls at ``piece_bytes`` of output and adopts the base branch's gradients whole up to
    ``adopt_bwd_max_elems`` elements. ``autotune``: the fused kernels' tile
    mode (see :class:`longattn.kernels.autotune.Autotuner`; '' the environment's).
    ``concurrent``: the views path launches its calls on side streams at once
    (``DilatedTuning.concurrent_calls``). ``graphs``: each pass replays
    a CUDA graph per shape (:mod:`longattn.dilated.graphs`,
    ``DilatedTuning.graph_max_tokens``; the fused engine's triton_op pair is
    not graphed: torch.compile takes its kernels)."""

    fwd: str
    bwd: str
    fused_schedule: str = "per_branch"
    gather_max_rows: int = 0
    gather_max_rows_bwd: int = 0
    piece_bytes: int = 128 << 20
    adopt_bwd_max_elems: int = 2 ** 29
    autotune: str = ""
    concurrent: bool = False
    graphs: bool = False

    def key(self) -> str:
        return _key(self)

    @staticmethod
    def from_key(key: str) -> "DilatedPlan":
        return _from_key(key)

    def engine(self, pass_: str) -> str:
        return self.fwd if pass_ == "fwd" else self.bwd


@functools.lru_cache(maxsize=256)
def _key(plan: DilatedPlan) -> str:
    return json.dumps(dataclasses.astuple(plan))


@functools.lru_cache(maxsize=256)
def _from_key(key: str) -> DilatedPlan:
    return DilatedPlan(*json.loads(key))


def fused_refusals(q: torch.Tensor) -> list[str]:
    """Why our fused Triton dilated kernels cannot take this call."""
    return bk.BACKENDS["triton"].kernel_refusals(q)


def grouped_runs(seqlen: int, segment_lengths, dilation_rates, tuning=_tuning.DILATED) -> bool:
    """The default fused schedule is grouped: branches nest and every branch
    has at most ``tuning.grouped_max_keys`` keys per segment class."""
    return _short_classes(seqlen, segment_lengths, dilation_rates, tuning) and _nests(seqlen, segment_lengths,
                                                                                      dilation_rates)


def _short_classes(seqlen, segment_lengths, dilation_rates, tuning) -> bool:
    return max(min(w, seqlen) // r for w, r in zip(segment_lengths, dilation_rates)) <= tuning.grouped_max_keys


def _nests(seqlen, segment_lengths, dilation_rates) -> bool:
    return GroupedPlan.of(seqlen, list(segment_lengths), list(dilation_rates), False) is not None


def _fused_schedule(seqlen, segs, rates, head_dim, tuning) -> str:
    """Grouped for short nested classes, else per branch with every pair
    computed once where the branches form a chain (``dedup``) and the head dim
    is at most ``tuning.dedup_max_head_dim``, else per branch. A forced
    schedule the branches cannot take runs per branch."""
    chain = dedup_chain(seqlen, segs, rates) is not None
    if tuning.schedule in ("per_branch", "per_branch_zero_fill"):
        return tuning.schedule
    if tuning.schedule == "grouped":
        return "grouped" if _nests(seqlen, segs, rates) else "per_branch"
    if tuning.schedule == "dedup":
        return "dedup" if chain else "per_branch"
    if grouped_runs(seqlen, segs, rates, tuning):
        return "grouped"
    return "dedup" if chain and head_dim <= tuning.dedup_max_head_dim else "per_branch"


def _engine(pass_: str, q, k, segs, rates, causal: bool, backend: str, views_ok: bool, tuning) -> str:
    """One pass's engine (see :func:`choose`)."""
    local = "views" if views_ok else "gather"
    if tuning.schedule in ("views", "gather"):
        return "gather" if tuning.schedule == "gather" or not views_ok else "views"
    if tuning.schedule in FUSED_SCHEDULES or backend == "triton":
        return "fused"
    if backend != "auto" or q.device.type != "cuda":
        return local
    # The views pay where a flash-class kernel (FA4, else cuDNN) takes their blocks: the thresholds were measured so.
    fast_views = views_ok and any(not bk.BACKENDS[n].refusals(bk.BlockSpec(1.0), q, k) for n in ("fa4", "cudnn"))
    grouped_bwd = (pass_ == "bwd" and not causal and tuning.grouped_backward_noncausal
                   and grouped_runs(q.shape[1], segs, rates, tuning))
    if q.shape[0] * q.shape[1] >= tuning.views_min_tokens and fast_views and not grouped_bwd:
        return "views"
    return local if fused_refusals(q) else "fused"


# Plans already made: short sequences are bound by host time, and walking the
# backends' refusals costs tens of microseconds per check. The key holds
# everything choose() reads; bounded so shapes that never repeat cannot grow it.
_chosen: dict = {}
_CHOSEN_MAX = 1024


def choose(q: torch.Tensor, k: torch.Tensor, segment_lengths, dilation_rates, causal: bool, backend: str,
           tuning: _tuning.DilatedTuning = _tuning.DILATED) -> DilatedPlan:
    """The plan of a dilated call on q (B, S, H, D), k (B, S, Hkv, D).

    ``backend="triton"``: the fused kernels. Another backend name: that
    backend on the views (GQA whose rates and group size do not divide each
    other: on gathered blocks). ``"auto"``: on CUDA, cuDNN on the views from
    ``tuning``'s token thresholds (MHA by head dim; GQA where rates and group
    size divide), except the non-causal backward of short nested classes
    (grouped fused kernels); the fused kernels below the thresholds; elsewhere
    the views through the best local backend. ``tuning.schedule`` other than
    ``"auto"`` forces an engine (A/B measurements, tests)."""
    if torch.compiler.is_compiling():  # traced once per graph; shapes may be symbolic
        return _choose(q, k, list(segment_lengths), list(dilation_rates), causal, backend, tuning)
    key = (q.shape, k.shape, q.dtype, q.device, tuple(segment_lengths), tuple(dilation_rates), causal, backend,
           tuning)
    plan = _chosen.get(key)
    if plan is None:
        plan = _choose(q, k, list(segment_lengths), list(dilation_rates), causal, backend, tuning)
        if len(_chosen) >= _CHOSEN_MAX:
            _chosen.clear()
        _chosen[key] = plan
    return plan


def gather_rows(tuning: _tuning.DilatedTuning, graphs: bool) -> int:
    """The views path's gathering bound: ``tuning.gather_max_rows``, except
    where the plan's passes are graphed (``tuning.gather_graphed``):
    replayed, gathering has no host time left to save. (A graphed plan's
    first call of a shape, and calls inside a caller's capture, run eagerly
    with the same bound.)"""
    return 0 if graphs and not tuning.gather_graphed else tuning.gather_max_rows


def _choose(q, k, segs, rates, causal, backend, tuning) -> DilatedPlan:
    views_ok = kv_views_ok(rates, q.shape[2], k.shape[2])
    cuda = q.device.type == "cuda"
    # FA4 takes the views' blocks where `backend` names it or `auto` picks it for them (the backends' one choice)
    fa4 = cuda and (backend == "fa4" or backend == "auto" and bk.select_backend(
        q, k, bk.BlockSpec(1.0, causal), exclude=("triton",)).name == "fa4")
    graphs = cuda and tuning.graphs(q.shape[0] * q.shape[1], q.shape[2] == k.shape[2], q.shape[-1], causal, fa4)
    fwd, bwd = (_engine(p, q, k, segs, rates, causal, backend, views_ok, tuning) for p in ("fwd", "bwd"))
    if "fused" in (fwd, bwd):
        why = fused_refusals(q)
        if why:
            raise ValueError(f"the fused Triton dilated kernels cannot run this call: {'; '.join(why)}")
    rows = gather_rows(tuning, graphs)
    return DilatedPlan(
        fwd=fwd, bwd=bwd, fused_schedule=_fused_schedule(q.shape[1], segs, rates, q.shape[-1], tuning),
        gather_max_rows=rows,
        gather_max_rows_bwd=rows if causal or tuning.gather_noncausal_backward else 0,
        piece_bytes=tuning.piece_bytes, adopt_bwd_max_elems=tuning.adopt_bwd_max_elems, autotune=tuning.autotune,
        concurrent=cuda and tuning.concurrent(graphs), graphs=graphs)
