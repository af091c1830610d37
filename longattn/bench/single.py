"""`run` and `scale`: single-device benchmarks."""
from __future__ import annotations

import gc
import sys
from typing import Optional, Sequence

import torch

from . import measure
from .configs import Config
from .impls import IMPLS, fwd_flops, impls_for

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_and_dtype(cfg: Config, device: Optional[str] = None):
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = DTYPES[cfg.dtype]
    if dev.type == "cpu" and dt == torch.bfloat16:
        dt = torch.float32  # CPU kernels and the Triton interpreter have no fast bf16 path
    return dev, dt


def make_inputs(cfg: Config, dev, dt, requires_grad: bool, seed: int = 0):
    g = torch.Generator(device=dev).manual_seed(seed)
    shape_q = (cfg.batch, cfg.seqlen, cfg.heads, cfg.head_dim)
    shape_kv = (cfg.batch, cfg.seqlen, cfg.hkv, cfg.head_dim)
    q = torch.randn(shape_q, device=dev, dtype=dt, generator=g)
    k = torch.randn(shape_kv, device=dev, dtype=dt, generator=g)
    v = torch.randn(shape_kv, device=dev, dtype=dt, generator=g)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _failure(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "OOM"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def bench_impl(cfg: Config, impl_name: str, dev, dt, *, backward: bool = True, warmup: int = 3, iters: int = 10,
               timing: str = "warmup", reference=None) -> dict:
    """Time one implementation on one config. Never raises: failures are recorded."""
    impl = IMPLS[impl_name]
    row = dict(config=cfg.name, impl=impl_name, shape=cfg.describe(), dtype=str(dt).replace("torch.", ""),
               batch=cfg.batch, seqlen=cfg.seqlen, heads=cfg.heads, kv_heads=cfg.hkv, head_dim=cfg.head_dim,
               causal=cfg.causal, status="ok")
    why = impl.reason(cfg, dev)
    if why:
        row.update(status="unsupported", reason=why)
        return row
    # FLOPs of the pairs this implementation computes (head-split computes 1/n of LongNet's)
    flops = fwd_flops(cfg) * impl.pair_fraction(cfg)
    row["fwd_flops"] = flops
    try:
        fn = impl.build(cfg, dev)
        q, k, v = make_inputs(cfg, dev, dt, requires_grad=False)
        with torch.no_grad():
            out = fn(q, k, v)
            if reference is not None and impl.comparable:
                row["rel_diff_vs_ref"] = float((out.float() - reference.float()).norm() / reference.float().norm())
            del out
            t = measure.time_ms(lambda: fn(q, k, v), dev, warmup=warmup, iters=iters, batched=timing == "batched")
            row["fwd_ms"] = t["median_ms"]
            row["fwd_runs"] = t["runs"]
            row["timing"], row["fwd_host_ms"] = t["timing"], t["host_ms"]
            row["fwd_peak_mem_bytes"] = measure.peak_memory_bytes(lambda: fn(q, k, v), dev)
            if timing == "profiler":
                row["fwd_top_kernels"] = measure.profile_top_kernels(lambda: fn(q, k, v), dev)
        row["fwd_tflops"] = flops / (row["fwd_ms"] * 1e-3) / 1e12
        row["fwd_tokens_per_s"] = cfg.batch * cfg.seqlen / (row["fwd_ms"] * 1e-3)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        row.update(status="failed", reason=_failure(e))
        return row
    finally:
        gc.collect()
    if not backward:
        return row
    try:
        del q, k, v
        q, k, v = make_inputs(cfg, dev, dt, requires_grad=True)
        dout = torch.randn(q.shape, device=dev, dtype=dt)

        def step():
            out = fn(q, k, v)
            out.backward(dout)
            q.grad = k.grad = v.grad = None

        t = measure.time_ms(step, dev, warmup=warmup, iters=iters, batched=timing == "batched")
        row["fwd_bwd_ms"] = t["median_ms"]
        row["fwd_bwd_host_ms"] = t["host_ms"]
        row["bwd_ms"] = max(t["median_ms"] - row["fwd_ms"], 0.0)
        row["fwd_bwd_peak_mem_bytes"] = measure.peak_memory_bytes(step, dev)
        row["bwd_tflops"] = 2.5 * flops / (row["bwd_ms"] * 1e-3) / 1e12 if row["bwd_ms"] > 0 else None
        row["fwd_bwd_tokens_per_s"] = cfg.batch * cfg.seqlen / (row["fwd_bwd_ms"] * 1e-3)
        if timing == "profiler":
            row["fwd_bwd_top_kernels"] = measure.profile_top_kernels(step, dev)
    except Exception as e:  # noqa: BLE001
        row.update(bwd_status="failed", bwd_reason=_failure(e))
    finally:
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return row


def reference_output(cfg: Config, dev, dt):
    """Output of our exact op, used to check every other implementation agrees
    (the head-split baseline computes a different function and shows it)."""
    import longattn

    q, k, v = make_inputs(cfg, dev, dt, requires_grad=False)
    with torch.no_grad():
        try:
            if cfg.kind == "dilated":
                return longattn.dilated_attention(q, k, v, segment_lengths=cfg.segment_lengths,
                                                  dilation_rates=cfg.dilation_rates, causal=cfg.causal)
            if cfg.kind == "dense":
                return longattn.attention(q, k, v, causal=cfg.causal, window_size=cfg.window)
        except Exception:  # noqa: BLE001
            return None
    return None


def run(cfgs: Sequence[Config], impls: Optional[Sequence[str]] = None, *, device=None, backward=True,
        warmup=3, iters=10, timing="warmup", check=True) -> dict:
    results = []
    env = None
    for cfg in cfgs:
        dev, dt = device_and_dtype(cfg, device)
        if env is None:
            env = dict(measure.environment(dev), timing="batched" if timing == "batched" and dev.type == "cuda" else "cold")
        names = [i.name for i in impls_for(cfg)] if not impls else [n for n in impls if cfg.kind in IMPLS[n].kinds
                                                                    or (cfg.window != (-1, -1) and "window" in IMPLS[n].kinds)]
        ref = reference_output(cfg, dev, dt) if check and cfg.seqlen * cfg.batch <= (1 << 17) else None
        for n in names:
            _log(f"[run] {cfg.name} {n} ...")
            row = bench_impl(cfg, n, dev, dt, backward=backward, warmup=warmup, iters=iters, timing=timing,
                             reference=ref)
            _log(f"[run] {cfg.name} {n}: {row['status']} " + (f"fwd {row['fwd_ms']:.3f} ms" if "fwd_ms" in row else
                                                              row.get("reason", "")))
            results.append(row)
        del ref
    return dict(kind="run", env=env, results=results)


def scale(cfg: Config, impls: Sequence[str], *, device=None, backward=True, start: Optional[int] = None,
          max_seqlen: int = 1 << 24, warmup=2, iters=5) -> dict:
    """Double the sequence length until out of memory (or max_seqlen)."""
    results = []
    dev, dt = device_and_dtype(cfg, device)
    env = measure.environment(dev)
    longest = {}
    for n in impls:
        s = start or cfg.seqlen
        while s <= max_seqlen:
            c = cfg.with_overrides(seqlen=s)
            _log(f"[scale] {n} seqlen={s} ...")
            row = bench_impl(c, n, dev, dt, backward=backward, warmup=warmup, iters=iters)
            results.append(row)
            _log(f"[scale] {n} seqlen={s}: {row['status']} {row.get('reason', '')}")
            if row["status"] != "ok" or row.get("bwd_status") == "failed":
                break
            longest[n] = s
            s *= 2
    return dict(kind="scale", env=env, config=cfg.name, longest_seqlen=longest, results=results)


def format_table(results: list[dict]) -> str:
    cols = [("config", "config", "{}"), ("impl", "impl", "{}"), ("seqlen", "seqlen", "{}"), ("fwd ms", "fwd_ms", "{:.3f}"),
            ("bwd ms", "bwd_ms", "{:.3f}"), ("fwd TF/s", "fwd_tflops", "{:.1f}"), ("bwd TF/s", "bwd_tflops", "{:.1f}"),
            ("tok/s fwd", "fwd_tokens_per_s", "{:.3g}"), ("fwd MiB", "fwd_peak_mem_bytes", "mib"),
            ("fwd+bwd MiB", "fwd_bwd_peak_mem_bytes", "mib"), ("rel diff", "rel_diff_vs_ref", "{:.1e}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " | status |", "|" + "---|" * (len(cols) + 1)]
    for r in results:
        cells = []
        for _, key, fmt in cols:
            v = r.get(key)
            if v is None:
                cells.append("–")
            elif fmt == "mib":
                cells.append(f"{v / 2**20:.1f}")
            else:
                cells.append(fmt.format(v))
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        if r.get("bwd_status"):
            status += f"; bwd {r['bwd_status']}: {r.get('bwd_reason', '')}"
        lines.append("| " + " | ".join(cells) + f" | {status} |")
    return "\n".join(lines)
