"""`run` and `scale`: single-device benchmarks."""
from __future__ import annotations

import gc
import sys
from typing import Optional, Sequence

import torch

from . import measure
from . import tables as T
from .configs import DTYPES, Config
from .impls import IMPLS, fwd_flops, impls_for


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


REFERENCES = {"dense": "longattn.attention", "dilated": "longattn.dilated_attention",
              "varlen": "longattn.attention_varlen", "flex": "longattn.flex_attention"}
"""The reference each row's output is compared with: our op, backend auto, on the same inputs."""


def _row_head(cfg: Config, impl_name: str, dt) -> dict:
    """The fields every `run`/`scale` row carries, whatever became of it."""
    row = dict(config=cfg.name, impl=impl_name, shape=cfg.describe(), dtype=str(dt).replace("torch.", ""),
               batch=cfg.batch, seqlen=cfg.seqlen, heads=cfg.heads, kv_heads=cfg.hkv, head_dim=cfg.head_dim,
               causal=cfg.causal, status="ok")
    if IMPLS[impl_name].computes:
        row["computes"] = IMPLS[impl_name].computes
    return row


def _timer(dev, warmup: int, iters: int, batched: bool, label: Optional[str]):
    """``timed(call, what, setup=None)``: measure.time_ms with one row's
    settings; ``what`` names the pass in the progress lines (none when
    ``label`` is None)."""
    def timed(call, what, setup=None):
        return measure.time_ms(call, dev, warmup=warmup, iters=iters, batched=batched,
                               label=None if label is None else f"{label} {what}", setup=setup)
    timed.batched = batched
    return timed


def _time_forward(row: dict, fn, cfg: Config, dev, dt, timed, *, reference, comparable: bool,
                  profile: bool) -> None:
    """Forward alone, without autograd: the rel diff against ``reference``,
    the median time, peak memory (and the top kernels with ``profile``)."""
    q, k, v = make_inputs(cfg, dev, dt, requires_grad=False)
    call = lambda: fn(q, k, v)
    with torch.no_grad():
        out = call()
        if reference is not None and comparable:
            row["rel_diff_vs_ref"] = float((out.float() - reference.float()).norm() / reference.float().norm())
            row["reference"] = f"{REFERENCES[cfg.kind]} (auto)"
        del out
        t = timed(call, "fwd")
        row["fwd_ms"] = t["median_ms"]
        row["fwd_runs"] = t["runs"]
        row["timing"], row["fwd_host_ms"] = t["timing"], t["host_ms"]
        row["fwd_peak_mem_bytes"] = measure.peak_memory_bytes(call, dev)
        if profile:
            row["fwd_top_kernels"] = measure.profile_top_kernels(call, dev)
    row["fwd_tflops"] = row["fwd_flops"] / (row["fwd_ms"] * 1e-3) / 1e12
    row["fwd_tokens_per_s"] = cfg.batch * cfg.seqlen / (row["fwd_ms"] * 1e-3)


def _time_backward(row: dict, fn, cfg: Config, dev, dt, timed, *, profile: bool, bwd_alone: bool) -> None:
    """A training step (forward + backward), then the backward by itself; a
    failure is recorded in the row (``bwd_status`` / ``bwd_alone_reason``)."""
    try:
        q, k, v = make_inputs(cfg, dev, dt, requires_grad=True)
        dout = torch.randn(q.shape, device=dev, dtype=dt)

        def step():
            out = fn(q, k, v)
            out.backward(dout)
            q.grad = k.grad = v.grad = None

        t = timed(step, "fwd+bwd")
        row["fwd_bwd_ms"] = t["median_ms"]
        row["fwd_bwd_host_ms"] = t["host_ms"]
        row["fwd_bwd_peak_mem_bytes"] = measure.peak_memory_bytes(step, dev)
        row["fwd_bwd_tokens_per_s"] = cfg.batch * cfg.seqlen / (row["fwd_bwd_ms"] * 1e-3)
        if profile:
            row["fwd_bwd_top_kernels"] = measure.profile_top_kernels(step, dev)
    except Exception as e:  # noqa: BLE001
        row.update(bwd_status="failed", bwd_reason=_failure(e))
        return
    if bwd_alone:
        _time_backward_alone(row, fn, (q, k, v), dout, timed)


def _time_backward_alone(row: dict, fn, inputs, dout, timed) -> None:
    """The backward by itself: one forward's graph is kept and each timed call
    runs its backward again (``retain_graph``), so the time is measured, not a
    difference of two medians. A backward that cannot run twice (torch.compile's
    backward donates the buffers it saved) is timed after a fresh forward per
    sample instead, untimed, the GPU idle again before the backward starts
    (cold timing only; ``bwd_method`` says so)."""
    def clear():
        for x in inputs:
            x.grad = None

    try:
        graph = fn(*inputs)

        def bwd():
            graph.backward(dout, retain_graph=True)
            clear()

        t = timed(bwd, "bwd")
    except Exception as e:  # noqa: BLE001 - the fwd+bwd figures stand; only this one may be missing
        graph, kept = None, {}  # the kept graph's buffers go before the fresh forwards
        if timed.batched:  # a fresh forward between calls leaves the GPU idle: not back to back
            row["bwd_alone_reason"] = (f"its backward cannot run twice ({_failure(e)[:90]}...); a fresh forward "
                                       f"per sample needs cold timing (the default --timing)")
            return

        def forward():
            kept["graph"] = fn(*inputs)

        def bwd_once():
            kept.pop("graph").backward(dout)
            clear()

        try:
            t = timed(bwd_once, "bwd", setup=forward)
        except Exception as e2:  # noqa: BLE001
            row["bwd_alone_reason"] = f"{_failure(e)}; after a fresh forward: {_failure(e2)}"
            return
        row["bwd_method"], row["bwd_replay_reason"] = "after a fresh forward per sample", _failure(e)
    row["bwd_ms"] = t["median_ms"]
    row["bwd_host_ms"] = t["host_ms"]
    row["bwd_tflops"] = 2.5 * row["fwd_flops"] / (row["bwd_ms"] * 1e-3) / 1e12


def bench_impl(cfg: Config, impl_name: str, dev, dt, *, backward: bool = True, warmup: int = 3, iters: int = 10,
               timing: str = "warmup", reference=None, label: Optional[str] = None, bwd_alone: bool = True) -> dict:
    """Time one implementation on one config. Never raises: failures are recorded.

    Forward, forward+backward (a training step) and the backward alone are
    each timed: the backward by re-running one forward's graph
    (``retain_graph``), so its time is measured, not a difference of two
    medians (``bwd_alone=False`` skips that). ``label``: prefix of progress
    lines for slow work (None: silent).
    """
    impl = IMPLS[impl_name]
    row = _row_head(cfg, impl_name, dt)
    why = impl.reason(cfg, dev)
    if why:
        row.update(status="unsupported", reason=why)
        return row
    # FLOPs of the pairs this implementation computes (head-split computes 1/n of LongNet's)
    row["fwd_flops"] = fwd_flops(cfg) * impl.pair_fraction(cfg)
    timed = _timer(dev, warmup, iters, timing == "batched", label)
    profile = timing == "profiler"
    try:
        fn = impl.build(cfg, dev)
        _time_forward(row, fn, cfg, dev, dt, timed, reference=reference, comparable=impl.comparable,
                      profile=profile)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        row.update(status="failed", reason=_failure(e))
        return row
    finally:
        gc.collect()
    if not backward:
        return row
    if impl.backward_reason:
        row.update(bwd_status="unsupported", bwd_reason=impl.backward_reason)
        return row
    _time_backward(row, fn, cfg, dev, dt, timed, profile=profile, bwd_alone=bwd_alone)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def reference_output(cfg: Config, dev, dt):
    """Output of our exact op (backend auto, ``REFERENCES``), used to check
    every other implementation agrees (the head-split baseline computes a
    different function and shows it)."""
    import longattn

    from .impls import flex_mask, varlen_cu_seqlens

    q, k, v = make_inputs(cfg, dev, dt, requires_grad=False)
    with torch.no_grad():
        try:
            if cfg.kind == "dilated":
                return longattn.dilated_attention(q, k, v, segment_lengths=cfg.segment_lengths,
                                                  dilation_rates=cfg.dilation_rates, causal=cfg.causal)
            if cfg.kind == "varlen":
                b, s, h, d = q.shape
                cu = varlen_cu_seqlens(cfg, dev)
                o = longattn.attention_varlen(q.reshape(b * s, h, d), k.reshape(b * s, -1, d),
                                              v.reshape(b * s, -1, d), cu, causal=cfg.causal)
                return o.view(b, s, h, d)
            if cfg.kind == "flex":
                return longattn.flex_attention(q, k, v, mask_mod=flex_mask(cfg, dev))
            return longattn.attention(q, k, v, causal=cfg.causal, window_size=cfg.window)
        except Exception:  # noqa: BLE001 - rows then carry no rel diff
            return None


def _applies(cfg: Config, name: str) -> bool:
    kinds = IMPLS[name].kinds
    return cfg.kind in kinds or (cfg.window != (-1, -1) and "window" in kinds)


def _done(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason', '')}"
    s = f"ok, fwd {row['fwd_ms']:.3g} ms"
    if row.get("bwd_ms") is not None:
        s += f", bwd {row['bwd_ms']:.3g} ms"
    if row.get("bwd_status"):
        s += f", bwd {row['bwd_status']}: {row.get('bwd_reason', '')}"
    return s


def run(cfgs: Sequence[Config], impls: Optional[Sequence[str]] = None, *, device=None, backward=True,
        warmup=3, iters=10, timing="warmup", check=True) -> dict:
    if impls:
        unknown = [n for n in impls if n not in IMPLS]
        if unknown:
            raise ValueError(f"unknown implementation(s) {unknown}; choose from {sorted(IMPLS)}")
    results = []
    env = None
    plan = [(cfg, [i.name for i in impls_for(cfg)] if not impls else [n for n in impls if _applies(cfg, n)])
            for cfg in cfgs]
    total, done = sum(len(n) for _, n in plan), 0
    for cfg, names in plan:
        dev, dt = device_and_dtype(cfg, device)
        if env is None:
            batched_here = timing == "batched" and dev.type == "cuda"
            env = dict(measure.environment(dev), timing="batched" if batched_here else "cold")
        ref = None
        if check and names and cfg.seqlen * cfg.batch <= (1 << 17):
            _log(f"[run] {cfg.name}: reference output ({REFERENCES[cfg.kind]}, auto)")
            ref = reference_output(cfg, dev, dt)
        for n in names:
            done += 1
            tag = f"[run {done}/{total}] {cfg.name} {n}"
            _log(f"{tag} ...")
            row = bench_impl(cfg, n, dev, dt, backward=backward, warmup=warmup, iters=iters, timing=timing,
                             reference=ref, label=tag)
            _log(f"{tag}: {_done(row)}")
            results.append(row)
        del ref
    return dict(kind="run", env=env, results=results)


def scale(cfg: Config, impls: Sequence[str], *, device=None, backward=True, start: Optional[int] = None,
          max_seqlen: int = 1 << 24, warmup=2, iters=5) -> dict:
    """Double the sequence length until out of memory (or max_seqlen)."""
    unknown = [n for n in impls if n not in IMPLS]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; choose from {sorted(IMPLS)}")
    results = []
    dev, dt = device_and_dtype(cfg, device)
    env = measure.environment(dev)
    longest = {}
    for n in impls:
        s = start or cfg.seqlen
        while s <= max_seqlen:
            c = cfg.with_overrides(seqlen=s)
            tag = f"[scale] {n} seqlen={s}"
            _log(f"{tag} ...")
            row = bench_impl(c, n, dev, dt, backward=backward, warmup=warmup, iters=iters, label=tag)
            results.append(row)
            _log(f"{tag}: {_done(row)}")
            if row["status"] != "ok" or row.get("bwd_status") == "failed":
                break
            longest[n] = s
            s *= 2
    return dict(kind="scale", env=env, config=cfg.name, longest_seqlen=longest, results=results)


def bwd_measured(r: dict) -> bool:
    """Whether the row's backward was timed by itself (result files that carry
    ``bwd_host_ms``); older files hold fwd+bwd minus fwd, floored at 0."""
    return "bwd_host_ms" in r


def _computes(r: dict) -> Optional[str]:
    if "computes" in r:
        return r["computes"]
    impl = IMPLS.get(r["impl"])  # result files written before rows said so
    return impl.computes if impl else None


def format_table(results: list[dict]) -> str:
    """Markdown table of the rows that ran (or failed); unsupported rows are
    listed once below it with their reasons, then the footnotes."""
    shown = [r for r in results if r["status"] != "unsupported"]
    unit, f = T.flops_unit([r.get(k) for r in shown for k in ("fwd_tflops", "bwd_tflops")])
    rate = lambda v: None if v is None else v * f
    derived = [r for r in shown if r.get("bwd_ms") is not None and not bwd_measured(r)]

    def bwd(r, v):  # a derived backward (older files) is marked; a floored 0 is no figure
        if r not in derived:
            return T.num(v)
        return (T.num(v) if r["bwd_ms"] > 0 else "–") + "†"
    cols = [("config", lambda r: r["config"]), ("impl", lambda r: r["impl"]), ("seqlen", lambda r: str(r["seqlen"])),
            ("fwd ms", lambda r: T.num(r.get("fwd_ms"))), ("bwd ms", lambda r: bwd(r, r.get("bwd_ms"))),
            (f"fwd {unit}", lambda r: T.num(rate(r.get("fwd_tflops")))),
            (f"bwd {unit}", lambda r: bwd(r, rate(r.get("bwd_tflops")))),
            ("tok/s fwd", lambda r: "–" if r.get("fwd_tokens_per_s") is None else f"{r['fwd_tokens_per_s']:.3g}"),
            ("fwd MiB", lambda r: T.num(r.get("fwd_peak_mem_bytes") and r["fwd_peak_mem_bytes"] / 2**20)),
            ("fwd+bwd MiB", lambda r: T.num(r.get("fwd_bwd_peak_mem_bytes") and r["fwd_bwd_peak_mem_bytes"] / 2**20)),
            ("rel diff vs longattn (auto)", lambda r: ("–" if r.get("rel_diff_vs_ref") is None else
                                                        f"{r['rel_diff_vs_ref']:.1e}") + ("*" if _computes(r) else ""))]
    lines = ["| " + " | ".join(c[0] for c in cols) + " | status |", "|" + "---|" * (len(cols) + 1)]
    for r in shown:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
        if r.get("bwd_status"):
            status += f"; bwd {r['bwd_status']}: {r.get('bwd_reason', '')}"
        if r.get("bwd_alone_reason"):
            status += f"; bwd alone not timed: {r['bwd_alone_reason']}"
        if r.get("bwd_method"):
            status += f"; bwd alone timed {r['bwd_method']} (its backward cannot run twice)"
        lines.append("| " + " | ".join(fn(r) for _, fn in cols) + f" | {status} |")
    lines += T.not_run(results)
    notes = []
    if any(r.get("rel_diff_vs_ref") is not None for r in shown):
        refs = sorted({r.get("reference") or "longattn (auto)" for r in shown if r.get("rel_diff_vs_ref") is not None})
        notes.append(f"rel diff: ||out - ref|| / ||ref|| on the same inputs and dtype; ref = {', '.join(refs)}.")
    other = {}
    for r in shown:
        if _computes(r):
            other.setdefault(_computes(r), []).append(r)
    for what, rows in other.items():
        compared = any(r.get("rel_diff_vs_ref") is not None for r in rows)
        notes.append(f"* {', '.join(dict.fromkeys(r['impl'] for r in rows))}: computes another function, {what}"
                     + ("; its rel diff is the distance from ours, not an error." if compared else "."))
    if derived:
        notes.append("† backward not timed alone in this file: fwd+bwd median minus fwd median (– where that is "
                     "not positive); see the fwd+bwd time in the JSON.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)
