"""`dist`: one device against N ranks on the same global problem (torchrun;
NCCL on GPUs, gloo on CPU).

Rows: our ring (contiguous and zigzag layouts), torch's context_parallel at
its best (``torch_cp``: native GQA, head-tail balancing for causal, the faster
rotate method of the run, the SDPA backend recorded; CUDA only);
for dilated configs our dilated attention over ranks; for varlen configs
``ring_attention_varlen`` in both layouts against ``attention_varlen`` (auto)
on one device; Ulysses (``ulysses``: all-to-all head parallelism over every
rank) and the Ulysses x ring hybrid (``hybrid:UxR`` zigzag, ``hybrid-contiguous:UxR``:
U consecutive ulysses ranks per ring position, R ring positions; ``--mesh UxR``
names the mesh of a bare ``hybrid``), dense and packed documents; for varlen configs
``packed-balanced`` (documents held whole where they fit, ``longattn.packed_attention``); for flex
configs (a ``longattn.masks`` pattern) ``ring_flex_attention`` in both layouts
(``flex-ring``: zigzag, ``flex-ring-contiguous``) and torch's context_parallel
running FlexAttention (``torch-cp-flex``, CUDA only). T_single is
measured on rank 0 in the same run (``longattn.attention``,
``longattn.dilated_attention`` or ``attention_varlen``, backend auto; for flex
configs torch's compiled FlexAttention, ``longattn.flex_attention`` on CPU). A row
that cannot run here is recorded as unsupported with its reason, before any
of it runs. Efficiency = W * T_single / (p * T_p) where W is the work of the parallel
problem over the one-device one: 1 in strong scaling (the same global
problem); in weak scaling (global seqlen = p * config seqlen, one device at
the config seqlen) W = FLOPs ratio, p^2 for dense attention, ~p for dilated.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from typing import Optional

import torch
import torch.distributed as dist

import longattn

from . import measure
from . import tables as T
from .configs import Config
from .single import _failure, _log, bench_impl, device_and_dtype
from .impls import IMPLS, fwd_flops, varlen_cu_seqlens
# parse_mesh, with_mesh: part of dist's interface (the CLI, tests)
from .cp_rows import CP_IMPLS, _cp_call, _cp_reason, packed_model, parse_mesh, with_mesh  # noqa: F401
from .torch_cp import FLEX_DIST_IMPLS, flex_dist_build, flex_dist_reason, run_torch_cp, torch_cp_reason
from ..distributed import transport as _transport

RING_IMPLS = ("ring-contiguous", "ring-zigzag", "torch-cp")
DIST_IMPLS = RING_IMPLS + CP_IMPLS


LAUNCH_HINT = ("Start it with torchrun, one process per rank (NCCL on GPUs, gloo on CPU), e.g.\n"
               "  torchrun --nproc_per_node=2 -m longattn.bench dist --config dense_32k_causal\n"
               "  torchrun --nproc_per_node=2 -m longattn.bench dist --config tiny      # CPU, gloo")


def launched() -> bool:
    """Started by torchrun (or a process group is already up)."""
    return dist.is_initialized() or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def _init(one_rank: bool = False):
    """(rank, world size, device): joins torchrun's process group. ``one_rank``:
    outside torchrun (no WORLD_SIZE) run as rank 0 of 1 instead of failing."""
    if not one_rank and not launched():
        raise RuntimeError(f"bench dist runs over several processes. {LAUNCH_HINT}")
    if not dist.is_initialized() and (not one_rank or "WORLD_SIZE" in os.environ):
        # on CUDA both backends: tensors on the GPU go through NCCL, the argument
        # checks' small CPU tensors through gloo without a device sync
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, dev


def _reason(cfg: Config, impl: str, dev) -> Optional[str]:
    if cfg.kind == "flex":
        return flex_dist_reason(cfg, impl, dev)
    if impl.partition(":")[0] in FLEX_DIST_IMPLS:
        return f"{impl} runs flex configs (kind flex: `python -m longattn.bench list`) only"
    if cfg.kind == "dilated" and impl.partition("+")[0] != "ring-contiguous":
        return "dilated configs run as dilated-over-ranks (ring-contiguous: contiguous shards) only"
    if impl == "torch-cp":
        return torch_cp_reason(cfg, dev)
    if impl.partition("+")[0].partition(":")[0] in CP_IMPLS:
        return _cp_reason(cfg, impl)
    if impl.partition("+")[0] not in ("ring-contiguous", "ring-zigzag"):
        return (f"unknown implementation; dist runs {', '.join(DIST_IMPLS)} (ring-*+TRANSPORT picks a transport; "
                f"hybrid:UxR a mesh)")
    return None


def _inputs(cfg: Config, seqlen: int, dev, dt, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(cfg.batch, seqlen, cfg.heads, cfg.head_dim, device=dev, dtype=dt, generator=g)
    k = torch.randn(cfg.batch, seqlen, cfg.hkv, cfg.head_dim, device=dev, dtype=dt, generator=g)
    v = torch.randn(cfg.batch, seqlen, cfg.hkv, cfg.head_dim, device=dev, dtype=dt, generator=g)
    return q, k, v


def _label(what: str) -> Optional[str]:
    """Progress lines from rank 0 only."""
    return what if dist.get_rank() == 0 else None


def _time_pair(fwd, step, dev, warmup, iters, batched, label="[dist]"):
    """(fwd ms, fwd+bwd ms, peak bytes fwd, fwd+bwd, host ms of one fwd, fwd+bwd call);
    ``batched``: see measure.time_ms."""
    with torch.no_grad():
        t = measure.time_ms(fwd, dev, warmup=warmup, iters=iters, batched=batched, agree=_agree,
                            label=_label(f"{label} fwd"))
        tf, hf = t["median_ms"], t["host_ms"]
        mf = measure.peak_memory_bytes(fwd, dev)
    tb = mb = hb = None
    if step is not None:
        t = measure.time_ms(step, dev, warmup=warmup, iters=iters, batched=batched, agree=_agree,
                            label=_label(f"{label} fwd+bwd"))
        tb, hb = t["median_ms"], t["host_ms"]
        mb = measure.peak_memory_bytes(step, dev)
    return tf, tb, mf, mb, hf, hb


def _ours(cfg, impl, make, dev, warmup, iters, backward, batched, label):
    impl, _, transport = impl.partition("+")
    with _transport.use_transport(transport or "auto"):
        _transport.release_slots()
        tf, tb, mf, mb, hf, hb = _ours_timed(cfg, impl, make, dev, warmup, iters, backward, batched, label)
        # exchange slots in symmetric memory live outside the allocator's counters
        held = _transport.symmetric_bytes()
    return tf, tb, mf + held, None if mb is None else mb + held, hf, hb


def _ours_timed(cfg, impl, make, dev, warmup, iters, backward, batched, label):
    q, k, v = make()
    fn, (ql, kl, vl) = _call_and_shards(cfg, impl, q, k, v, dev)
    del q, k, v
    return _timed_call(fn, ql, kl, vl, dev, warmup, iters, backward, batched, label)


def _call_and_shards(cfg, impl, q, k, v, dev):
    """(fn, this rank's shards of the global q, k, v) of a row other than ``torch-cp``."""
    if cfg.kind == "flex":
        return flex_dist_build(cfg, impl, q, k, v)
    if impl.partition(":")[0] in CP_IMPLS:
        return _cp_call(cfg, impl, q, k, v, dev)
    layout = "zigzag" if impl == "ring-zigzag" else "contiguous"
    if cfg.kind == "varlen":
        # packed documents: global cu_seqlens over batch*seqlen tokens, each rank's tokens from shard_varlen
        cu = varlen_cu_seqlens(cfg.with_overrides(seqlen=q.shape[1]), dev)
        fn = lambda q_, k_, v_: longattn.ring_attention_varlen(q_, k_, v_, cu, layout=layout, causal=cfg.causal,
                                                                window_size=cfg.window)
        return fn, [longattn.shard_varlen(x.flatten(0, 1), cu, layout=layout)[0] for x in (q, k, v)]
    if cfg.kind == "dilated":
        fn = lambda q_, k_, v_: longattn.dilated_attention(q_, k_, v_, segment_lengths=cfg.segment_lengths,
                                                            dilation_rates=cfg.dilation_rates, causal=cfg.causal,
                                                            group=dist.group.WORLD)
    else:
        fn = lambda q_, k_, v_: longattn.ring_attention(q_, k_, v_, causal=cfg.causal, window_size=cfg.window,
                                                         layout=layout)
    return fn, [longattn.shard(x, layout=layout) for x in (q, k, v)]


def _timed_call(fn, ql, kl, vl, dev, warmup, iters, backward, batched, label):
    """fn on the local shards: forward alone and forward + backward (see _time_pair)."""
    fwd = lambda: fn(ql, kl, vl)
    step = None
    if backward:
        qg, kg, vg = (x.detach().requires_grad_() for x in (ql, kl, vl))
        dout = torch.randn_like(ql)

        def step():
            fn(qg, kg, vg).backward(dout)
            qg.grad = kg.grad = vg.grad = None
    return _time_pair(fwd, step, dev, warmup, iters, batched, label)


def _torch_cp(cfg, make, dev, warmup, iters, backward, batched, label):
    return run_torch_cp(cfg, make, dev, _time_pair, _allmax, warmup=warmup, iters=iters, backward=backward,
                        batched=batched, label=label)


def _agree(reps: int) -> int:
    """Every rank runs the same number of calls per sample (each holds collectives)."""
    return int(_allmax(reps))


def _allmax(x):
    t = torch.tensor([float("nan") if x is None else float(x)], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    vals = [o.item() for o in out]
    return None if any(v != v for v in vals) else max(vals)


def _from_rank0(x):
    t = torch.tensor([float("nan") if x is None else float(x)], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.broadcast(t, 0)
    return None if t.item() != t.item() else t.item()


def _fmt_ms(v) -> str:
    return "–" if v is None else f"{v:.3g} ms"


def _fmt_eff(v) -> str:
    return "–" if v is None else f"{v:.2f}"


@dataclasses.dataclass(frozen=True)
class _Run:
    """One `dist` run's settings, the same for every row."""

    rank: int
    world: int
    dev: torch.device
    weak: bool
    backward: bool
    warmup: int
    iters: int
    batched: bool


def _free(dev) -> None:
    """Drop what one row left behind: its cached blocks are not the next row's to keep."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _one_device_impl(cfg: Config, dev) -> str:
    """The `run` implementation T_single is measured with."""
    if cfg.kind == "flex":
        # the fastest one-GPU form of the pattern: FA4 with its mask where it runs (1.3-1.5x torch's compiled
        # FlexAttention fwd+bwd at 32K, run_flex_fa4_h100_e714914.json), else torch's compiled FlexAttention;
        # neither has a CPU path, where our (eager) flex_attention stands in
        if dev.type != "cuda":
            return "longattn-flex"
        return "longattn-flex-fa4" if IMPLS["longattn-flex-fa4"].reason(cfg, dev) is None else "torch-flex"
    return {"dilated": "longattn-dilated", "varlen": "longattn-varlen"}.get(cfg.kind, "longattn")


def _default_impls(cfg: Config) -> tuple[str, ...]:
    return {"dilated": ("ring-contiguous",), "varlen": ("ring-zigzag", "ring-contiguous"),
            "flex": FLEX_DIST_IMPLS}.get(cfg.kind, RING_IMPLS)


def _single_row(cfg: Config, single_cfg: Config, base: dict, dt, run: _Run) -> tuple[dict, dict]:
    """On rank 0: (bench_impl's row of ``single_cfg`` on one device, the result row made from it)."""
    single_impl = _one_device_impl(cfg, run.dev)
    tag = f"[dist] {cfg.name} one device ({single_impl}, S={single_cfg.seqlen})"
    _log(f"{tag} ...")
    single = bench_impl(single_cfg, single_impl, run.dev, dt, backward=run.backward, warmup=run.warmup,
                        iters=run.iters, timing="batched" if run.batched else "warmup", label=tag, bwd_alone=False)
    _log(f"{tag}: {single['status']}, fwd {_fmt_ms(single.get('fwd_ms'))}, "
         f"fwd+bwd {_fmt_ms(single.get('fwd_bwd_ms'))}")
    _free(run.dev)
    row = dict(base, impl=f"single:{single_impl}", world_size=1, seqlen=single_cfg.seqlen,
               status=single["status"], reason=single.get("reason"), fwd_ms=single.get("fwd_ms"),
               fwd_bwd_ms=single.get("fwd_bwd_ms"), fwd_host_ms=single.get("fwd_host_ms"),
               fwd_bwd_host_ms=single.get("fwd_bwd_host_ms"),
               peak_mem_bytes=single.get("fwd_bwd_peak_mem_bytes") or single.get("fwd_peak_mem_bytes"))
    if single.get("bwd_status"):  # forward timed, backward not (e.g. out of memory): the efficiency says why
        row.update(bwd_status=single["bwd_status"], bwd_reason=single.get("bwd_reason"))
    return single, row


def _measure(cfg: Config, impl: str, seqlen: int, dt, run: _Run, tag: str):
    """(this rank's (tf, tb, mf, mb, hf, hb), None, what the row records of
    how it ran), or (Nones, the failure, {})."""
    # The global inputs are made inside the timed helpers and dropped once
    # sharded: held here they would sit beside the run (3 x 16 GiB at 4M tokens).
    make = lambda: _inputs(cfg, seqlen, run.dev, dt)
    args = (make, run.dev, run.warmup, run.iters, run.backward, run.batched, tag)
    info = {}
    try:
        if impl == "torch-cp":
            measured, info = _torch_cp(cfg, *args)
            info = dict(torch_cp=info)
        else:
            measured = _ours(cfg, impl, *args)
            if impl == "packed-balanced":
                info = dict(model=packed_model(cfg, seqlen, run.world, dt.itemsize))
        err = None
    except Exception as e:  # noqa: BLE001 - recorded
        measured, err = (None,) * 6, _failure(e)
    _free(run.dev)
    return measured, err, info


def _merge_ranks(row: dict, measured, err: Optional[str], t1: tuple, world: int) -> None:
    """Fill ``row`` from every rank's figures (the slowest time, the largest
    peak); a failure on any rank fails the row on every rank. ``t1``: (T_single
    fwd, fwd+bwd, work of the parallel problem over the one-device one)."""
    if _allmax(1.0 if err else 0.0):
        row.update(status="failed", reason=err or "failed on another rank")
        return
    tf, tb, mf, mb, hf, hb = measured
    tf, tb, mf, mb = _allmax(tf), _allmax(tb), _allmax(mf), _allmax(mb)
    row.update(fwd_ms=tf, fwd_bwd_ms=tb, peak_mem_fwd_bytes=mf, peak_mem_fwd_bwd_bytes=mb,
               fwd_host_ms=_allmax(hf), fwd_bwd_host_ms=_allmax(hb))
    t1f, t1b, work = t1
    if t1f:
        row["efficiency_fwd"] = work * t1f / (world * tf)
        row["speedup_fwd"] = work * t1f / tf
    if t1b and tb:
        row["efficiency_fwd_bwd"] = work * t1b / (world * tb)
        row["speedup_fwd_bwd"] = work * t1b / tb
    # per rank; the key's name is the one earlier result files use
    row["fwd_tflops_per_gpu"] = row["fwd_flops"] / (tf * 1e-3) / 1e12 / world


def _log_row(tag: str, row: dict) -> None:
    """A row's progress line, from rank 0 only."""
    if dist.get_rank() != 0:
        return
    if row["status"] != "ok":
        _log(f"{tag}: {row['status']}: {row.get('reason')}")
    else:
        _log(f"{tag}: ok, fwd {_fmt_ms(row.get('fwd_ms'))}, fwd+bwd {_fmt_ms(row.get('fwd_bwd_ms'))}, "
             f"efficiency fwd {_fmt_eff(row.get('efficiency_fwd'))}, "
             f"fwd+bwd {_fmt_eff(row.get('efficiency_fwd_bwd'))}")


def _impl_row(cfg: Config, impl: str, base: dict, dt, t1: tuple, run: _Run) -> dict:
    """One implementation's row: unsupported with its reason (decided from the
    config and device alone, so the same on every rank), or timed on every rank."""
    why = _reason(cfg, impl, run.dev)
    name = "dilated-over-ranks" if cfg.kind == "dilated" and not why else impl
    row = dict(base, impl=name, status="ok")
    tag = f"[dist] {cfg.name} {name} ({run.world} ranks)"
    if why:
        row.update(status="unsupported", reason=why)
        _log_row(tag, row)
        return row
    if run.rank == 0:
        _log(f"{tag} ...")
    measured, err, info = _measure(cfg, impl, base["seqlen"], dt, run, tag)
    row.update(info)
    _merge_ranks(row, measured, err, t1, run.world)
    _log_row(tag, row)
    return row


def _config_rows(cfg: Config, impls, run: _Run) -> list[dict]:
    """T_single (rank 0) and every implementation's row of one config."""
    _, dt = device_and_dtype(cfg, run.dev.type)
    s_global = cfg.seqlen * run.world if run.weak else cfg.seqlen
    gcfg = cfg.with_overrides(seqlen=s_global)
    base = dict(config=cfg.name, shape=gcfg.describe(), world_size=run.world, seqlen=s_global, weak=run.weak,
                causal=cfg.causal, fwd_flops=fwd_flops(gcfg))
    # T_single on rank 0: the same global problem (weak mode: the per-rank problem)
    single_cfg = cfg if run.weak else gcfg
    rows, single = [], {}
    if run.rank == 0:
        single, row = _single_row(cfg, single_cfg, base, dt, run)
        rows.append(row)
    dist.barrier()
    # work of the parallel problem over the single-device one (1 in strong scaling)
    t1 = (_from_rank0(single.get("fwd_ms")), _from_rank0(single.get("fwd_bwd_ms")),
          fwd_flops(gcfg) / fwd_flops(single_cfg))
    rows += [_impl_row(cfg, impl, base, dt, t1, run) for impl in impls or _default_impls(cfg)]
    return rows


def run_dist(cfgs, impls=None, *, weak=False, backward=True, warmup=3, iters=10, json_path=None,
             timing="cold") -> dict:
    """``timing``: "cold" (an idle GPU at each call's start: host time to the first
    kernel counts) or "batched" (calls back to back, host ahead), see ``measure.time_ms``;
    T_single, ours and torch's are timed the same way."""
    if timing not in ("cold", "batched"):
        raise ValueError(f"timing must be 'cold' or 'batched', got {timing!r}")
    rank, world, dev = _init()
    env = measure.environment(dev)
    env["world_size"] = world
    env["timing"] = timing if dev.type == "cuda" else "cold"  # batching is for GPU streams
    run = _Run(rank, world, dev, weak, backward, warmup, iters, batched=timing == "batched")
    results = []
    for cfg in cfgs:
        results += _config_rows(cfg, impls, run)
        if json_path and rank == 0:  # partial results survive a run cut short
            measure.write_json(json_path, dict(kind="dist", env=env, results=results, partial=True))
    return dict(kind="dist", env=env, results=results)


def format_table(results) -> str:
    """Markdown table of the rows that ran (or failed); unsupported rows are
    listed once below it with their reasons."""
    lines = ["| config | impl | ranks | seqlen | fwd ms | fwd+bwd ms | eff fwd | eff fwd+bwd | peak MiB/rank "
             "| status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    eff = lambda v: "–" if v is None else f"{v:.3f}"
    for r in results:
        if r["status"] == "unsupported":
            continue
        mem = r.get("peak_mem_fwd_bwd_bytes") or r.get("peak_mem_fwd_bytes") or r.get("peak_mem_bytes")
        lines.append(f"| {r['config']} | {T.impl_label(r)} | {r['world_size']} | {r['seqlen']} | "
                     f"{T.num(r.get('fwd_ms'))} | {T.num(r.get('fwd_bwd_ms'))} | {eff(r.get('efficiency_fwd'))} | "
                     f"{eff(r.get('efficiency_fwd_bwd'))} | {T.num(mem and mem / 2**20)} | "
                     f"{r['status']}{(': ' + r['reason']) if r.get('reason') else ''}"
                     f"{'; bwd ' + r['bwd_status'] + ': ' + (r.get('bwd_reason') or '') if r.get('bwd_status') else ''} |")
    lines += T.not_run(results)
    lines += ["", "eff: efficiency = work x T(one device) / (ranks x T(ranks)); work = 1 for the same global "
              "problem (strong scaling), the FLOPs ratio with --weak."]
    return "\n".join(lines)
