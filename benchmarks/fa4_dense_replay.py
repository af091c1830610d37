"""Short dense FA4 calls with and without their compiled calls replayed
(``Fa4Tuning.replay_max_tokens``; ``longattn.backends._fa4_api.Replay``), the
backend's forward + backward from given out and lse as every op calls it,
alternating in one run:

* ``replayed``: the fa4 backend as ``auto`` runs it (a layout's second call
  records, later ones replay);
* ``fa4 own``: the same backend with ``replay_max_tokens=0`` (FA4's Python
  entry on every call);
* ``cudnn``: PyTorch's cuDNN attention (the next backend of ``auto``), where
  it takes the call.

Per variant and shape, medians over ``--iters`` samples, ms per fwd+bwd:
``cold`` (one call between CUDA events, the GPU idle before it),
``batched`` (10 calls back to back: the host's pace where it is behind),
``gpu`` (10 calls queued behind a 30 ms GPU sleep: the GPU's own time) and
``host`` (wall time to issue one call). A call whose batched time sits above
its GPU time waits for its host.

    python benchmarks/fa4_dense_replay.py --rounds 3 --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from longattn import backends as bk
from longattn import tuning
from longattn.backends._fa4_api import Replay
from longattn.backends.fa4 import FA4Backend
from longattn.bench.measure import environment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_bound import _events  # noqa: E402

# (name, batch, rows, heads, kv heads, causal, window): the bench's window_small and small, a Llama-8B-like
# GQA layer at 2K and 8K tokens
SHAPES = [("window_small 4x4K H12 w512", 4, 4096, 12, 12, True, (512, 0)),
          ("small 4x4K H12", 4, 4096, 12, 12, False, (-1, -1)),
          ("gqa 1x2K 32q/8kv causal", 1, 2048, 32, 8, True, (-1, -1)),
          ("gqa 1x8K 32q/8kv causal", 1, 8192, 32, 8, True, (-1, -1))]
BATCH = 10
SLEEP_CYCLES = int(6e7)  # about 30 ms of GPU sleep queued first: the calls' own GPU time


def _call(backend, q, k, v, do, spec):
    out, lse = backend.forward(q, k, v, spec)
    backend.backward(do, q, k, v, out, lse, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--json")
    a = p.parse_args()
    dev = torch.device("cuda")
    variants = {"replayed": bk.BACKENDS["fa4"], "fa4 own": FA4Backend(tuning=tuning.Fa4Tuning(replay_max_tokens=0)),
                "cudnn": bk.BACKENDS["cudnn"]}
    rows = []
    for name, b, s, h, hkv, causal, window in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        q, do = (torch.randn(b, s, h, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, 128, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        spec = bk.BlockSpec(128 ** -0.5, causal, window)
        live = {}
        for vname, backend in variants.items():
            why = backend.refusals(spec, q, k)
            if why:
                print(f"{name}: {vname} refuses ({why[0]})", file=sys.stderr)
                continue
            live[vname] = backend
            for _ in range(3):  # compiled; the replayed variant recorded on its second call
                _call(backend, q, k, v, do, spec)
        kept = [r for r in bk.BACKENDS["fa4"]._replays.values() if not isinstance(r, int)]
        print(f"{name}: the fa4 backend keeps {sum(isinstance(r, Replay) for r in kept)} replays; not recorded: "
              f"{[r for r in kept if isinstance(r, str)]}", flush=True)
        for r in range(a.rounds):
            for vname, backend in live.items():
                f = lambda: _call(backend, q, k, v, do, spec)
                cold = _events(f, a.iters)
                batched = _events(f, a.iters, reps=BATCH)["gpu_ms"]
                gpu = _events(f, a.iters, reps=BATCH, sleep_cycles=SLEEP_CYCLES)["gpu_ms"]
                cold, host = cold["gpu_ms"], cold["host_ms"]
                rows.append(dict(shape=name, batch=b, seqlen=s, heads=h, kv_heads=hkv, causal=causal,
                                 window=list(window), variant=vname, round=r, cold_ms=cold, batched_ms=batched,
                                 gpu_ms=gpu, host_ms=host))
                print(f"{name:28s} {vname:9s} r{r} cold {cold:6.3f} batched {batched:6.3f} gpu {gpu:6.3f} "
                      f"host {host:6.3f}", flush=True)
    command = "python benchmarks/fa4_dense_replay.py " + " ".join(sys.argv[1:])
    if a.json:
        json.dump({"env": dict(environment(dev), command=command), "rows": rows}, open(a.json, "w"), indent=1)
    print(f"\n{'shape':28s} {'variant':9s} | cold / batched / gpu / host ms (min-max over rounds)")
    for name, *_ in SHAPES:
        for vname in variants:
            rs = [r for r in rows if r["shape"] == name and r["variant"] == vname]
            if rs:
                span = lambda key: f"{min(r[key] for r in rs):.3f}-{max(r[key] for r in rs):.3f}"
                print(f"{name:28s} {vname:9s} | {span('cold_ms')} / {span('batched_ms')} / {span('gpu_ms')} / "
                      f"{span('host_ms')}")


if __name__ == "__main__":
    main()
