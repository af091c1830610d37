"""FlashAttention-4 for the patterns of :mod:`longattn.masks`: the one module
that builds FA4's masks and block tables (CuTe mask functions through
``cutlass.cute.jit`` and ``flash_attn.cute.utils.scalar_to_ssa``,
``flash_attn.cute.block_sparsity.BlockSparseTensorsTorch``). Its calls go
through :mod:`longattn.backends._fa4_api` (``masked_forward`` /
``masked_backward``: the one module that calls FA4's private functions,
written for its pinned release); :func:`signature_problem` checks on first use
that the mask arguments and block tensors are still what this module passes,
and the kernel is refused with that reason when they moved.

A call runs here when the pattern has an FA4 form (``mask_mod.fa4``, see
:mod:`.blocks`) and FA4 runs on the GPU (:meth:`Fa4Masks.refusals` lists why
not; :func:`choose` is the one decision, :func:`explain` says it). The block
table is exact (:func:`longattn.flex.plan.block_table` at FA4's sparse block,
:func:`.blocks.sparse_block`): full blocks run without the mask, partial ones
call it, empty ones are skipped; the backward takes the same table per key
block. FA4's backward on sm_90 and sm_100 takes the mask and the block
sparsity (flash-attn-4 4.0.0b36), so the choice does not depend on whether a
gradient is needed.

:func:`step_forward` / :func:`step_backward` run one block of queries at
global positions against keys at global positions (:func:`ring_step`), the
backward from given (merged) out and lse: the form of a ring step.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Callable, Optional

import torch

from .. import backends as bk
from .. import tuning as tn
from .._merge import merge_stack
from ..dilated import graphs
from ..kernels import merge as kmerge
from ..backends import _fa4_api
from ..backends import fa4 as bk_fa4
from ..distributed.plan import Call
from . import blocks
from . import plan as fp

KERNELS = ("auto", "fa4", "flex")

SPARSE_FIELDS = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx", "block_size")


def signature_problem(interface, block_sparsity, utils, version: str) -> Optional[str]:
    """Why these modules (``flash_attn.cute.interface``, ``.block_sparsity``,
    ``.utils``, or stand-ins) lack what this module calls; None if they have it."""
    missing = _fa4_api.mask_signature_problem(interface)
    fields = getattr(getattr(block_sparsity, "BlockSparseTensorsTorch", None), "_fields", ())
    if any(f not in fields for f in SPARSE_FIELDS):
        missing.append(f"block_sparsity.BlockSparseTensorsTorch lacks fields of {SPARSE_FIELDS}")
    if not callable(getattr(utils, "scalar_to_ssa", None)):
        missing.append("utils has no scalar_to_ssa")
    if not missing:
        return None
    return (f"{_fa4_api.DIST} {version}: {'; '.join(missing)}; longattn's FA4 masks were written for "
            f"{_fa4_api.DIST}=={_fa4_api.WRITTEN_FOR} ({_fa4_api.INSTALL_HINT})")


@functools.lru_cache(maxsize=None)
def _load():
    """(namespace of FA4's mask modules, None) or (None, why not)."""
    why = _fa4_api.problem()
    if why:
        return None, why
    try:
        import cutlass
        import cutlass.cute as cute
        from flash_attn.cute import block_sparsity, utils
    except Exception as e:  # noqa: BLE001 - a broken CuTe DSL install raises anything at import
        return None, f"{_fa4_api.DIST}'s mask modules failed to import ({type(e).__name__}: {e})"
    interface = _fa4_api._interface()  # the module _fa4_api loaded and checked
    why = signature_problem(interface, block_sparsity, utils, _fa4_api.installed_version())
    if why:
        return None, why
    ns = dict(cutlass=cutlass, cute=cute, interface=interface, sparse=block_sparsity.BlockSparseTensorsTorch,
              utils=utils)
    return type("FA4", (), ns), None


def _fa4():
    mod, why = _load()
    if mod is None:
        raise RuntimeError(why)
    return mod


class Fa4Masks:
    """What FA4 with a mask needs of a call; :meth:`capability` and
    :meth:`problem` are the two facts read from the machine (tests substitute them)."""

    dtypes = (torch.float16, torch.bfloat16)
    capabilities = (9, 10)

    def capability(self, device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def problem(self) -> Optional[str]:
        return _load()[1]

    def refusals(self, q, k, v, mask_mod, score_mod) -> list[str]:
        """Why FA4 cannot run this flex call (empty: it can)."""
        r = []
        if mask_mod is not None and getattr(mask_mod, "fa4", None) is None:
            r.append("mask_mod has no FA4 form (a function of your own, or an and_/or_ with one): "
                     "FlexAttention runs it")
        if score_mod is not None:
            r.append("score_mod is a Python function: FlexAttention runs it")
        if q.device.type != "cuda":
            return r + [f"FA4 needs CUDA, not {q.device.type}"]
        if q.dtype not in self.dtypes:
            r.append(f"FA4 needs fp16/bf16, not {q.dtype}")
        cap = self.capability(q.device)
        if cap[0] not in self.capabilities:
            r.append(f"compute capability {cap}: FA4's masks run here on sm_90 and sm_100 only")
        d, dv = q.shape[-1], v.shape[-1]
        if d != dv or d not in blocks.HEADDIMS:
            r.append(f"head dims {d}/{dv}: FA4's block sparsity takes equal head dims {blocks.HEADDIMS}")
        if r:
            return r
        why = self.problem()
        return [why] if why else []


KERNEL = Fa4Masks()


def explain(q, k, v, mask_mod=None, score_mod=None, kernel: str = "auto", machine: Fa4Masks = KERNEL) -> dict:
    """``{"kernel": what runs, "fa4": [why not FA4], "flex": []}`` for this call."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: choose one of {KERNELS}")
    why = machine.refusals(q, k, v, mask_mod, score_mod)
    if kernel == "fa4" and why:
        raise ValueError(f"kernel='fa4' cannot run this call: {'; '.join(why)}. Use kernel='auto' or 'flex'")
    run = "fa4" if kernel == "fa4" or (kernel == "auto" and not why) else "flex"
    return {"kernel": run, "fa4": why, "flex": []}


def choose(q, k, v, mask_mod, score_mod, kernel: str = "auto", machine: Fa4Masks = KERNEL) -> str:
    """The kernel a flex call runs: "fa4" or "flex" (the one decision)."""
    return explain(q, k, v, mask_mod, score_mod, kernel, machine)["kernel"]


# ---------------------------------------------------------------------------- the CuTe mask
class _CuteOps:
    """:func:`.blocks.mask_body`'s ops in CuTe DSL: int32 (1,) TensorSSA values."""

    def __init__(self, fa):
        self._fa = fa

    def const(self, c: int):
        return self._fa.utils.scalar_to_ssa(c, self._fa.cutlass.Int32)

    def load(self, t, *idx):
        at = idx[0][0] if len(idx) == 1 else tuple(i[0] for i in idx)
        return self._fa.utils.scalar_to_ssa(t[at], self._fa.cutlass.Int32)


_MASKS: dict = {}
"""FA4 mask_mods by generated code (:meth:`.blocks.Form.code_hash`): forms
that differ only in their tensors' contents share one, and FA4's compile
cache keys it by the same hash (``__cute_hash__``)."""


@functools.lru_cache(maxsize=None)
def _ops_source() -> str:
    return inspect.getsource(_CuteOps)


def cute_mask(f: blocks.Form) -> Callable:
    """FA4's ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` of a form."""
    h = hashlib.sha256((f.code_hash() + _ops_source()).encode()).hexdigest()
    if h not in _MASKS:
        _MASKS[h] = build_mask(f, _fa4())
        _MASKS[h].__cute_hash__ = h
    return _MASKS[h]


def build_mask(f: blocks.Form, fa) -> Callable:
    """The ``cute.jit`` mask_mod of a form with the modules in ``fa``
    (``cute``, ``cutlass``, ``utils`` with ``scalar_to_ssa``)."""
    body, _ = blocks.mask_body(f, _CuteOps(fa))

    @fa.cute.jit
    def mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        return body(batch, head, q_idx, kv_idx, aux_tensors)
    return mask_mod


# ---------------------------------------------------------------------------- plans and calls
@dataclasses.dataclass
class Step:
    """One FA4 call with a mask: the exact block table at ``block`` (query
    rows, keys), FA4's block-sparse tensors for forward and backward, the form
    and its aux tensors."""

    table: fp.BlockTable
    block: tuple[int, int]
    form: Optional[blocks.Form]
    aux: Optional[list]
    tensors: dict
    empty: bool
    """No query sees any key (read once, at planning: a read per call would wait for the GPU)."""
    mask: Optional[Callable] = None
    """FA4's mask_mod of ``form``, made on the first call."""
    replays: dict = dataclasses.field(default_factory=dict)
    """Each pass's recorded compiled calls per ("fwd" / "bwd", :func:`longattn.backends._fa4_api.replay_key`):
    a ``Replay``, or why it cannot replay (that key then takes FA4's own path)."""


def make_step(mask_mod, batch: int, heads: int, qpos: torch.Tensor, kpos: torch.Tensor, cap_major: int,
              f: Optional[blocks.Form] = None) -> Step:
    """The step of (queries at global ``qpos``) x (keys at global ``kpos``);
    ``f``: the form FA4 evaluates on local indices (default: the mask's own)."""
    block = blocks.sparse_block(cap_major, len(qpos))
    table = fp.block_table(mask_mod, batch, heads, qpos, kpos, block)
    f = getattr(mask_mod, "fa4", None) if f is None else f
    aux = (blocks.aux_tensors(f, qpos.device) or None) if f is not None else None
    return Step(table, block, f, aux, blocks.sparse_tensors(table), table.empty)


def ring_step(mask_mod, qpos: torch.Tensor, kpos: torch.Tensor, batch: int, heads: int, cap_major: int) -> Step:
    """A ring step's FA4 form: local queries at global positions ``qpos``
    against the visiting keys at ``kpos`` (int32, on q's device); the mask is
    the pattern's at those positions (the position tables are aux tensors, so
    every step of a ring shares one compiled kernel)."""
    f = None if mask_mod is None else blocks.form("at_positions", tensors=(qpos, kpos), parts=(mask_mod.fa4,))
    return make_step(mask_mod, batch, heads, qpos, kpos, cap_major, f)


def single_step(q, k, mask_mod) -> Step:
    """The step of a one-device call: every query against every key (cached
    with its executor by :func:`longattn.flex.pieces.single_executor`)."""
    dev = q.device
    qpos = torch.arange(q.shape[1], dtype=torch.int32, device=dev)
    kpos = torch.arange(k.shape[1], dtype=torch.int32, device=dev)
    return make_step(mask_mod, q.shape[0], q.shape[2], qpos, kpos, KERNEL.capability(dev)[0])


def _mask(step: Step):
    if step.mask is None and step.form is not None:
        step.mask = cute_mask(step.form)
    return step.mask


def _sparse(fa, step: Step, which: str):
    t = step.tensors[which]
    return fa.sparse(**t, block_size=step.block)


def steps_of(executor, depth: int = 3) -> list:
    """The :class:`Step` s an executor runs (:class:`RingStep`, :class:`SplitStep` and the pieces'
    executors that hold them, nested up to ``depth`` levels): where their replays are kept."""
    if isinstance(executor, Step):
        return [executor]
    inner = vars(executor).values() if hasattr(executor, "__dict__") and depth else ()
    return [s for x in inner for s in steps_of(x, depth - 1)]


def _pass(step: Step, which: str, tensors: dict, scale: float, tuning: tn.Fa4Tuning, record, own):
    """One pass of ``step`` on ``tensors`` (by name, as FA4 is handed them): its layout's replay, a
    recording on the layout's first call where :func:`longattn.backends.fa4.replays` allows, or FA4's own
    call (:func:`longattn.backends._fa4_api.replayed`), the replays kept per step."""
    key = (which, *_fa4_api.replay_key(*tensors.values(), scale=scale))
    return _fa4_api.replayed(step.replays, key, tensors, bk_fa4.replays(tensors["q"], tensors["k"], tuning), record,
                             own)


def step_forward(step: Step, q, k, v, scale: float, tuning: tn.Fa4Tuning = tn.FA4):
    """(out in q.dtype, lse float32 (B, H, Sq), natural log; -inf where a row sees no key).
    The first call of a layout records FA4's compiled kernel call and checks its replay; later calls
    of that layout replay it (:class:`longattn.backends._fa4_api.Replay`: the same kernel on the
    same block tables, without FA4's per-call Python). Inside a CUDA graph capture a recorded call
    replays, an unrecorded one takes FA4's own path. Calls longer than :func:`replays` allows take
    FA4's own path always."""
    def args():  # FA4's arguments, made only where FA4 is entered (a replay needs none of them)
        fa = _fa4()
        return (fa.interface, q, k, v, scale, _mask(step),
                _sparse(fa, step, "fwd") if step.form is not None else None, step.aux)
    return _pass(step, "fwd", dict(q=q, k=k, v=v), scale, tuning, lambda: _fa4_api.record_masked_forward(*args()),
                 lambda: _fa4_api.masked_forward(*args()))


def step_backward(step: Step, dout, q, k, v, out, lse, scale: float, dlse=None,
                  tuning: tn.Fa4Tuning = tn.FA4):
    """(dq, dk, dv) from the given, possibly merged, out and lse (and lse's gradient). Recorded on
    a layout's first call and replayed after, as :func:`step_forward` (FA4's preprocessing, main and
    conversion kernels, their buffers allocated per call)."""
    t = _fa4_api.backward_inputs(dout, q, k, v, out, lse, dlse)

    def args():
        fa = _fa4()
        return (fa.interface, t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], scale, _mask(step),
                _sparse(fa, step, "bwd") if step.form is not None else None, step.aux, t["dlse"])
    return _pass(step, "bwd", t, scale, tuning, lambda: _fa4_api.record_masked_backward(*args()),
                 lambda: _fa4_api.masked_backward(*args()))


PASS_GRAPHS = graphs.GraphCache(graphs.MAX_GRAPHS)
"""The one-device calls' passes replayed from CUDA graphs (``FlexFa4Tuning.graph_max_tokens``), keyed by
executor and pass."""


class Fa4Flex(torch.autograd.Function):
    """(out, lse) of a one-device call through its executor (:class:`RingStep`,
    :class:`longattn.flex.pieces.CarvedStep` or
    :class:`longattn.flex.pieces.DocumentsStep`), the backward from its own
    out and lse. ``graphed``: each pass replayed from a CUDA graph per shape
    (:data:`PASS_GRAPHS`; the caller checked :func:`longattn.dilated.graphs.usable`)."""

    @staticmethod
    def forward(ctx, q, k, v, run, graphed: bool = False):
        ctx.set_materialize_grads(False)  # an unused lse reaches the backward as None: FA4 skips its dlse path
        if graphed:
            out, lse = PASS_GRAPHS.run(("fwd", run), run.forward, (q, k, v))
        else:
            out, lse = run.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.run, ctx.graphed = run, graphed
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        if ctx.graphed:
            dq, dk, dv = PASS_GRAPHS.run(("bwd", ctx.run), ctx.run.backward, (dout, q, k, v, out, lse, dlse))
        else:
            dq, dk, dv = ctx.run.backward(dout, q, k, v, out, lse, dlse)
        return dq, dk, dv, None, None


def attend(q, k, v, mask_mod, scale: float, tuning: tn.FlexFa4Tuning = tn.FLEX_FA4):
    """(out, lse) of a one-device flex call through FA4; None where no query
    sees a key. Its passes replay from CUDA graphs where ``tuning.graph_max_tokens``
    takes its query tokens and :func:`longattn.dilated.graphs.usable` allows."""
    from . import pieces  # pieces builds on this module: imported at the call

    run = pieces.single_executor(q, k, mask_mod, scale, tuning)
    if run is None:
        return None
    graphed = graphs.replays(q, tuning.graph_max_tokens)
    return Fa4Flex.apply(q, k, v, run, graphed)


class RingStep:
    """A ring step's executor (``Call.run``) through FA4, the counterpart of
    :class:`longattn.flex.step.FlexStep`: ``forward(q, k, v)`` of the local
    queries against the visiting block, ``backward`` from the MERGED out and
    lse of all steps (FA4's backward takes them as given: no graph is kept,
    ``record`` returns None for it)."""

    def __init__(self, step: Step, scale: float, lq: int, lk: int):
        self.step, self.scale = step, scale
        self.calls = (Call(0, lq, 0, lk, bk.BlockSpec(scale)),)  # the ring sizes its accumulators from these

    def forward(self, q, k, v):
        with torch.no_grad():
            return step_forward(self.step, q, k, v, self.scale)

    def record(self, q, k, v):
        out, lse = self.forward(q, k, v)
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, dlse, graph=None):
        return step_backward(self.step, dout, q, k, v, out, lse, self.scale, dlse)


class SplitStep:
    """A piece whose one long side makes a chain of tiles in one direction,
    run in that direction on a view of the long side as ``c`` batch rows
    (batch 1), in the other as one call (``whole``). FA4 runs one program per
    query tile forward and per key tile backward, each over the tiles of the
    other side it sees:

    * ``axis="keys"``, few query rows against many keys: the forward is a few
      programs each over every key tile; it runs on view row j = key chunk j,
      the queries repeated, the partials merged by lse in float32. Its
      backward has a program per key tile already: one call;
    * ``axis="rows"``, many rows against few keys (the global keys): the
      backward is a few programs each over every row tile; it runs on view row
      j = row chunk j, the keys repeated, dK/dV summed in float32. Its
      forward: one call.

    ``split`` holds the chunks' tables (batch c) and the form at positions
    with the split side's (c, n) table. Same results as one call.

    Equivalent PyTorch (keys, forward)::

        o, l = zip(*(attend(q, k[:, j*m:(j+1)*m], v[:, j*m:(j+1)*m]) for j in range(c)))
        lse = torch.logsumexp(torch.stack(l), 0)  # longattn._merge.merge_stack
        out = sum(oj * (lj - lse).exp().transpose(1, 2)[..., None] for oj, lj in zip(o, l))
    """

    def __init__(self, whole: Step, split: Step, scale: float, c: int, axis: str, lq: int, lk: int):
        self.whole, self.split, self.scale, self.c, self.axis = whole, split, scale, c, axis
        self.calls = (Call(0, lq, 0, lk, bk.BlockSpec(scale)),)

    def _rep(self, x):
        # expand(...).contiguous() runs PyTorch's strided elementwise copy (0.14 ms for a rank's two on an H100,
        # flex_exchange_stack_2xh100_51fd8be.json); a concatenation of contiguous tensors takes its batched copy
        return torch.cat([x] * self.c) if x.is_contiguous() else x.expand(self.c, *x.shape[1:]).contiguous()

    def _chunks(self, x):
        return x.reshape(self.c, x.shape[1] // self.c, *x.shape[2:])

    def forward(self, q, k, v):
        with torch.no_grad():
            if self.axis == "rows":
                return step_forward(self.whole, q, k, v, self.scale)
            o, l_ = step_forward(self.split, self._rep(q), self._chunks(k), self._chunks(v), self.scale)
            # the c partials at once (a chain of pairwise merges costs a few launches per chunk)
            out, lse = merge_stack(o, l_.transpose(1, 2))  # (n, H, D), (n, H)
            out, lse = out[None], lse.t().contiguous()[None]
            return out.to(q.dtype), lse

    def record(self, q, k, v):
        out, lse = self.forward(q, k, v)
        return out, lse, None

    def forward_into(self, q, rows, rows_rep, k, v, out, lse) -> None:
        """Batch 1: the rows ``rows`` (int64, on q's device) of q
        against every key, written into ``out[:, rows]`` and ``lse[:, :, rows]``
        (``rows_rep``: ``rows`` repeated c times, so one gather builds the c
        views' queries): ``out[:, rows], lse[:, :, rows] = self.forward(q[:,
        rows], k, v)``; on axis "keys" in a gather, the FA4 call and one merge
        launch (a one-device call carved: :class:`longattn.flex.pieces.CarvedStep`,
        whose calls are short enough for the host's launches to count)."""
        with torch.no_grad():
            if self.axis == "rows":  # its forward is one call (the views cut the backward's chains)
                out[:, rows], lse[:, :, rows] = step_forward(self.whole, q[:, rows], k, v, self.scale)
                return
            qr = q[0, rows_rep].view(self.c, len(rows), *q.shape[2:])
            o, l_ = step_forward(self.split, qr, self._chunks(k), self._chunks(v), self.scale)
            if kmerge.usable(o):
                kmerge.stack_into(out[0], lse[0], o, l_, rows)
            else:
                mo, ml = merge_stack(o, l_.transpose(1, 2))
                out[0, rows], lse[0, :, rows] = mo.to(out.dtype), ml.t()

    def backward_into(self, dout, q, k, v, keys, keys_rep, out, lse, dlse, dq, dk, dv) -> None:
        """Batch 1: every row against the keys ``keys`` (int64),
        from the given out, lse and dlse: ``dq += `` their dQ, ``dk[:, keys]``,
        ``dv[:, keys]`` <- their dK, dV summed over the views in float32
        (``keys_rep``: ``keys`` repeated c times, one gather each for the views'
        K and V): :meth:`backward` of ``k[:, keys], v[:, keys]`` and those
        writes; on axis "rows" in fewer launches."""
        if self.axis == "keys":  # its backward is one call (the views cut the forward's chains)
            gq, dk[:, keys], dv[:, keys] = step_backward(self.whole, dout, q, k[:, keys], v[:, keys], out, lse,
                                                         self.scale, dlse)
            dq.add_(gq)
            return
        rows = lambda x: x[0].reshape(x.shape[1], self.c, -1).transpose(0, 1).contiguous()  # (1, H, L) -> (c, H, m)
        kr, vr = (x[0, keys_rep].view(self.c, len(keys), *x.shape[2:]) for x in (k, v))
        chunks = self._chunks
        g = step_backward(self.split, chunks(dout), chunks(q), kr, vr, chunks(out), rows(lse), self.scale,
                          None if dlse is None else rows(dlse))
        dq.add_(g[0].reshape(dq.shape))
        for dst, part in ((dk, g[1]), (dv, g[2])):
            if kmerge.usable(part):
                kmerge.sum_rows_into(dst[0], part, keys)
            else:
                dst[0, keys] = part.sum(0, dtype=torch.float32).to(dst.dtype)

    def backward(self, dout, q, k, v, out, lse, dlse, graph=None):
        if self.axis == "keys":
            return step_backward(self.whole, dout, q, k, v, out, lse, self.scale, dlse)
        chunks, rep = self._chunks, self._rep
        rows = lambda x: x[0].reshape(x.shape[1], self.c, -1).transpose(0, 1).contiguous()  # (1, H, L) -> (c, H, m)
        g = step_backward(self.split, chunks(dout), chunks(q), rep(k), rep(v), chunks(out), rows(lse), self.scale,
                          None if dlse is None else rows(dlse))
        # summed in float32 by the reduction itself (no float32 copy of the c views' gradients first)
        return (g[0].reshape(q.shape), g[1].sum(0, keepdim=True, dtype=torch.float32).to(k.dtype),
                g[2].sum(0, keepdim=True, dtype=torch.float32).to(v.dtype))


def ring_executor(mask_mod, qpos: torch.Tensor, kpos: torch.Tensor, batch: int, heads: int,
                  scale: float) -> Optional[RingStep]:
    """The FA4 executor of one ring step (queries at global ``qpos``, the
    visiting keys at ``kpos``, on the GPU); None where no query sees a key."""
    step = ring_step(mask_mod, qpos, kpos, batch, heads, KERNEL.capability(qpos.device)[0])
    return None if step.empty else RingStep(step, scale, len(qpos), len(kpos))
