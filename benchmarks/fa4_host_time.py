"""Where the host time of a one-GPU flex call through FA4 goes: the call as
planned (``longattn.flex.pieces.single_executor``, forward + backward through
``fa4.Fa4Flex``, eager), issued while the GPU works through a 50 ms sleep
queued first, so the host never waits for it. Per config:

* ``issue_ms``: host time to issue one fwd+bwd (median of 10);
* ``gpu_ms``: GPU time of the same step after a sleep (host hidden), and
  ``cold_ms``: from an idle GPU, the host's time exposed (medians of 10);
* ``fa4_ms``: host time inside FA4's private entry points
  (``_flash_attn_fwd`` / ``_flash_attn_bwd``) per step, and ``compiled_ms``
  inside the compiled kernels' calls they make (every entry of their JIT
  caches wrapped with a timer); ``fa4_ms - compiled_ms`` is FA4's Python per
  step, what a cached call could at most save;
* ``replays``: each step's recorded passes (``longattn.backends._fa4_api.Replay``,
  which call the compiled kernels without entering FA4) or why a pass is not replayed;
* the top functions of one issue under cProfile, by own time.

    python benchmarks/fa4_host_time.py --json OUT.json flex_bsparse_32k flex_swg_32k
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch

from longattn.backends import _fa4_api
from longattn.bench import measure
from longattn.bench.configs import CONFIGS
from longattn.bench.patterns import flex_fa4_step
from longattn.flex import fa4

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from host_bound import _events  # noqa: E402


class Timed:
    """A callable that adds its wall time to ``acc[0]``."""

    def __init__(self, fn, acc):
        self.fn, self.acc = fn, acc

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.acc[0] += time.perf_counter() - t


def wrap_caches(interface, acc) -> int:
    """Wrap every compiled entry of FA4's JIT caches (on module functions) with :class:`Timed`."""
    n = 0
    for name in dir(interface):
        cache = getattr(getattr(interface, name, None), "compile_cache", None)
        store = getattr(cache, "cache", None)
        if isinstance(store, dict):
            for key, fn in list(store.items()):
                if not isinstance(fn, Timed):
                    store[key] = Timed(fn, acc)
                    n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    interface = _fa4_api._interface()
    out = {}
    for name in a.configs:
        run, step = flex_fa4_step(CONFIGS[name], dev)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        recorded = [(key[0], r if isinstance(r, str) else f"{type(r).__name__} of {len(r.calls)} calls")
                    for st in fa4.steps_of(run) for key, r in st.replays.items()]
        compiled = [0.0]
        wrapped = wrap_caches(interface, compiled)
        entry = [0.0]
        orig = {n: getattr(interface, n) for n in ("_flash_attn_fwd", "_flash_attn_bwd")}
        calls = [0]

        def timed_entry(fn):
            def f(*args, **kw):
                calls[0] += 1
                t = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    entry[0] += time.perf_counter() - t
            f.compile_cache = fn.compile_cache  # FA4 reads its cache through the module's name
            return f

        issue, fa4_ms, comp_ms, ncalls = [], [], [], []
        for n, fn in orig.items():
            setattr(interface, n, timed_entry(fn))
        try:
            for _ in range(10):
                torch.cuda._sleep(int(1e8))  # ~50 ms: longer than any host issue measured
                entry[0] = compiled[0] = 0.0
                calls[0] = 0
                t = time.perf_counter()
                step()
                issue.append((time.perf_counter() - t) * 1e3)
                fa4_ms.append(entry[0] * 1e3)
                comp_ms.append(compiled[0] * 1e3)
                ncalls.append(calls[0])
                torch.cuda.synchronize()
            torch.cuda._sleep(int(1e8))
            prof = cProfile.Profile()
            prof.enable()
            step()
            prof.disable()
            torch.cuda.synchronize()
        finally:
            for n, fn in orig.items():
                setattr(interface, n, fn)
        st = pstats.Stats(prof)
        top = sorted(((fn, s[2] * 1e3, s[3] * 1e3, s[1]) for fn, s in st.stats.items()), key=lambda r: -r[1])[:20]
        top = [{"fn": f"{f[0].split('site-packages/')[-1]}:{f[1]}({f[2]})", "tottime_ms": t, "cumtime_ms": c,
                "calls": n} for f, t, c, n in top]
        gpu = _events(step, n=10, sleep_cycles=int(2e7))["gpu_ms"]
        cold = _events(step, n=10)["gpu_ms"]
        med = statistics.median_high
        res = {"executor": type(run).__name__, "replays": recorded, "fa4_calls_per_step": med(ncalls),
               "compiled_entries": wrapped, "issue_ms": med(issue), "fa4_ms": med(fa4_ms), "compiled_ms": med(comp_ms),
               "gpu_ms": gpu, "cold_ms": cold, "top_own_time": top}
        out[name] = res
        print(f"{name} ({res['executor']}, {res['fa4_calls_per_step']} FA4 calls): issue {res['issue_ms']:.3f} ms, "
              f"in FA4 {res['fa4_ms']:.3f} (compiled calls {res['compiled_ms']:.3f}), gpu {res['gpu_ms']:.3f}, "
              f"cold {res['cold_ms']:.3f}", flush=True)
        print(f"    replays (pass, what): {recorded}")
        for r in top[:10]:
            print(f"    {r['tottime_ms']:7.3f} own {r['cumtime_ms']:7.3f} cum x{r['calls']:<4} {r['fn'][-90:]}")
    if a.json:
        measure.write_json(measure.result_path(a.json), {
            "kind": "fa4_host_time", "fa4": _fa4_api.installed_version(),
            "env": measure.environment(dev, " ".join(["python", "benchmarks/fa4_host_time.py", *a.configs])),
            "results": out})


if __name__ == "__main__":
    main()
