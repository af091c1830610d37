"""Timing, memory and environment capture: the honest parts of the suite.

* Time: CUDA events around each call after warm-up, the median of many runs
  (CPU: perf_counter medians). Inputs are made before timing, never inside.
  "cold" timing (default) includes the host's time to the first kernel;
  "batched" timing runs calls back to back (host ahead, GPU never idle).
* Memory: peak allocated during the call minus what was allocated before it.
  CUDA: the caching allocator's ``max_memory_allocated``. CPU: the profiler's
  allocation events, summed in order (so the number is real there too).
* A measurement that fails is recorded with its reason, never filled in.
* Work that takes a while says so on stderr (``Progress``): a line per step
  once a few seconds have passed since the last, so a Triton-interpreter run or
  a first call that autotunes is never silent for minutes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

import torch


class Progress:
    """Progress lines on stderr for one piece of work (``label``): ``step(what)``
    after each step prints ``label: what (t s)`` when ``every_s`` seconds have
    passed since the last line (or since the start), so fast work prints
    nothing and slow work prints a line per step. ``label=None`` is silent
    (e.g. on ranks other than 0)."""

    def __init__(self, label: Optional[str], every_s: float = 5.0):
        self.label, self.every_s = label, every_s
        self.t0 = self.last = time.perf_counter()

    def step(self, what: str) -> None:
        if self.label is None:
            return
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            print(f"{self.label}: {what} ({now - self.t0:.0f} s)", file=sys.stderr, flush=True)
            self.last = now


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 10,
            min_time_s: float = 0.0, batched: bool = False, agree: Optional[Callable[[int], int]] = None,
            label: Optional[str] = None, setup: Optional[Callable[[], object]] = None) -> dict:
    """Median and spread of ``fn``'s wall time in ms, CUDA events on GPU.

    Default ("cold"): one call between the events, the GPU idle when the start
    event is recorded, so the time includes the host's work until the first
    kernel starts (and any point where the GPU waits for the host): what one
    isolated call costs.

    ``batched=True`` (CUDA only): several calls back to back between the events
    (enough for 10 ms of work, 3 to 10), time per call, each sample led by one
    more call issued before its start event: every timed call follows another
    on a busy GPU, as in a training or generation loop's steady state (the
    host runs ahead while the GPU works; where the host is slower than the
    GPU the GPU waits and the time is the host's pace), and no sample counts
    a start from an idle GPU. (A GPU spin-wait queued before each call hides
    host time too, but it rests the chip: a chain of matrix products then ran
    7-17% faster per product than back to back on an H200,
    benchmarks/cold_start_probe.py, so that is not used.) ``agree`` maps this
    process's batch size to one every rank uses (calls with collectives).
    ``host_ms`` (the host time of one call, measured in warm-up) is returned
    either way. ``label``: progress lines on stderr for slow calls (``Progress``).
    ``setup`` (cold timing only): run before each call, untimed, the GPU idle
    again before the start event (what a call consumes, e.g. a fresh forward's
    graph for a backward that cannot run twice).
    """
    if setup is not None and batched:
        raise ValueError("time_ms: setup= runs between calls, so it needs cold timing (batched=False)")
    prog = Progress(label)
    host = []
    for i in range(warmup):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        prog.step(f"warm-up call {i + 1}/{warmup}" + (" (a first call may autotune or compile)" if i == 0 else ""))
    sync(device)
    host_ms = host[-1] if host else None
    cuda = device.type == "cuda"
    reps = 1
    if batched and cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        reps = min(10, max(3, math.ceil(10.0 / max(a.elapsed_time(b), 1e-3))))
    if agree is not None:
        reps = agree(reps)
    times = []
    t_end = time.perf_counter() + min_time_s
    while len(times) < iters or time.perf_counter() < t_end:
        if setup is not None:
            setup()
            sync(device)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if reps > 1:
                fn()  # the lead call: the start event is queued behind it
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / reps)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        prog.step(f"timed sample {len(times)}/{iters}")
        if len(times) >= 1000:
            break
    times.sort()
    return dict(median_ms=statistics.median(times), min_ms=times[0], max_ms=times[-1], runs=len(times),
                host_ms=host_ms, timing="batched" if reps > 1 else "cold", calls_per_sample=reps)


# What the profiler's C++ side writes to fd 2 at every start and stop (Kineto's
# "USDT: ... profiler_start" lines) and a warning about blocks allocated before
# it started: noise in a results table, dropped; anything else is passed on.
_PROFILER_NOISE = re.compile(r"USDT:.*profiler_(start|stop)|allocated before the profiling started")


@contextlib.contextmanager
def _quiet_profiler():
    """Hold what is written to fd 2 while the profiler runs and pass on all but
    the profiler's own status lines (they come from C++, so Python's
    ``sys.stderr`` cannot filter them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [ln for ln in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_NOISE.search(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        res = fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del res
        return int(peak)
    from torch.profiler import ProfilerActivity, profile

    with _quiet_profiler(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        res = fn()
        del res
    events = sorted((e for e in prof.events() if getattr(e, "cpu_memory_usage", 0)),
                    key=lambda e: e.time_range.start)
    cur = peak = 0
    for e in events:
        cur += e.cpu_memory_usage
        peak = max(peak, cur)
    return int(peak)


def profile_top_kernels(fn: Callable[[], object], device: torch.device, top: int = 10) -> list[dict]:
    """The profiler mode of ``--timing profiler``: the kernels that take the time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with _quiet_profiler(), profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:top]:
        rows.append(dict(name=e.key[:90], calls=e.count, total_ms=getattr(e, key, 0) / 1e3))
    return rows


def host_profile(fn: Callable[[], object], calls: int, device: torch.device,
                 orders: tuple = (("tottime", 45), ("cumulative", 45))) -> dict:
    """cProfile of ``calls`` calls of ``fn`` queued back to back (the host's
    time by function; the GPU's work waited for after the profile stops):
    {order: the ``pstats`` listing of its first ``rows`` lines}."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync(device)
    res = {}
    for order, rows in orders:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(rows)
        res[order] = text.getvalue()
    return res


def git_commit() -> Optional[str]:
    """HEAD (with -dirty), or $LONGATTN_COMMIT where the tree was copied without .git."""
    if os.environ.get("LONGATTN_COMMIT"):
        return os.environ["LONGATTN_COMMIT"]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if out.returncode:
            return None
        # dirty: a tracked file changed, or a file git does not track sits in the package (it runs too)
        status = lambda *a: subprocess.run(["git", "status", "--porcelain", *a], cwd=here, capture_output=True,
                                           text=True, timeout=5).stdout.strip()
        dirty = status("--untracked-files=no") or status("--untracked-files=normal", "--", os.path.dirname(here))
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:
        return None


def short_commit(commit: Optional[str] = None) -> str:
    """abc1234 or abc1234-dirty (the code that runs), "nocommit" when unknown."""
    commit = git_commit() if commit is None else commit
    if not commit:
        return "nocommit"
    head, _, dirty = commit.partition("-")
    return head[:7] + ("-" + dirty if dirty else "")


def result_path(path: str) -> str:
    """``path`` with ``{commit}`` replaced by ``short_commit()``."""
    return path.replace("{commit}", short_commit()) if "{commit}" in path else path


def environment(device: torch.device, command: Optional[str] = None) -> dict:
    """What a result was measured on and how to run it again. ``command``: the
    command line (None: ``python -m longattn.bench`` with this process's
    arguments; scripts pass their own); the LONGATTN_* settings in the
    environment are put before it."""
    if command is None:
        command = " ".join([os.path.basename(sys.executable), "-m", "longattn.bench", *sys.argv[1:]])
    env = dict(torch=torch.__version__, python=platform.python_version(), platform=platform.platform(),
               commit=git_commit(), command=command, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    # settings that change what runs (transport, thresholds, forced backends) belong to the command
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("LONGATTN_") and k != "LONGATTN_COMMIT"}
    if knobs:
        env["command"] = " ".join(f"{k}={v}" for k, v in knobs.items()) + " " + env["command"]
    if device.type == "cuda":
        env.update(device=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), gpus=torch.cuda.device_count())
    else:
        env.update(device=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    # FlashAttention-4 changes what auto runs on Hopper: a result says whether it was there
    from importlib import metadata

    try:
        env["flash_attn_4"] = metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        env["flash_attn_4"] = None
    return env


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    csv_path = os.path.splitext(path)[0] + ".csv"
    rows = payload.get("results", [])
    # a table only of rows (a script's per-config dict of nested results stays JSON alone)
    if rows and isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
        keys = sorted({k for r in rows for k, v in r.items() if not isinstance(v, (dict, list))})
        with open(csv_path, "w") as f:
            f.write(",".join(keys) + "\n")
            for r in rows:
                f.write(",".join("" if r.get(k) is None else str(r.get(k)).replace(",", ";") for k in keys) + "\n")
