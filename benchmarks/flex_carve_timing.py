"""Whether carving a one-GPU flex call pays in real calls, host included: the
call through ``fa4.Fa4Flex`` (forward + backward, as ``flex_attention`` runs
it) with its executor as planned (``carved``: the long chains' rows apart in
the forward and keys apart in the backward, :class:`longattn.flex.pieces.CarvedStep`),
with the keys apart only (``keys``), as one call (``whole``) and as planned
with its passes replayed from CUDA graphs (``graphed``), beside
torch's compiled FlexAttention; each timed cold (one call, GPU idle), batched
(5 back to back) and after a 20 ms GPU sleep queued first (the GPU's own
time, the host hidden), with the host's ms per call. The variants alternate
over ``--rounds`` rounds; medians over rounds. ``flex_chains.py`` times the
same executors without autograd, back to back only.

    python benchmarks/flex_carve_timing.py --json OUT.json flex_bsparse_32k flex_swg_32k
    python benchmarks/flex_carve_timing.py --seqlen 4096 --json OUT.json flex_bsparse_32k flex_doc_32k

``--seqlen`` runs the configs' pattern at another length (rows named
``CONFIG@SEQLEN``): where the host's time per call outweighs the GPU's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

from longattn.bench import measure
from longattn.bench.configs import CONFIGS
from longattn.bench.impls import IMPLS
from longattn.bench.single import make_inputs
from longattn.bench.patterns import flex_mask
from longattn.flex import fa4, pieces

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from host_bound import _events  # noqa: E402


def variants(q, k, mask, scale) -> dict:
    run = pieces.single_executor(q, k, mask, scale)
    out = {"carved" if isinstance(run, pieces.CarvedStep) else "as planned": run}
    if isinstance(run, pieces.CarvedStep):
        whole = fa4.RingStep(fa4.single_step(q, k, mask), scale, q.shape[1], k.shape[1])
        out["whole"] = whole
        if run.keys_run is not None:
            out["keys"] = pieces.CarvedStep(whole, None, None, run.bwd, run.keys, run.keys_run)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlen", type=int, help="run each config's pattern at this length")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = {}
    for name in a.configs:
        cfg = CONFIGS[name]
        if a.seqlen:
            name = f"{name}@{a.seqlen}"
            cfg = dataclasses.replace(cfg, name=name, seqlen=a.seqlen)
        q, k, v = make_inputs(cfg, dev, torch.bfloat16, True)
        do = torch.randn_like(q)
        scale = cfg.head_dim ** -0.5
        runs = variants(q, k, flex_mask(cfg, dev), scale)
        fns = {n: (lambda r=r: fa4.Fa4Flex.apply(q, k, v, r)[0]) for n, r in runs.items()}
        # the planned executor's passes replayed from CUDA graphs (FlexFa4Tuning.graph_max_tokens)
        fns["graphed"] = (lambda r=next(iter(runs.values())): fa4.Fa4Flex.apply(q, k, v, r, True)[0])
        fns["flex_attention"] = (lambda f=IMPLS["longattn-flex-fa4"].build(cfg, dev): f(q, k, v))
        fns["torch-flex"] = (lambda f=IMPLS["torch-flex"].build(cfg, dev): f(q, k, v))
        rows = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, f in fns.items():
                def step(f=f):
                    f().backward(do)
                    q.grad = k.grad = v.grad = None
                for _ in range(3):
                    step()
                rows[n].append({"cold": _events(step, n=10), "batched": _events(step, n=6, reps=5),
                                "after_sleep": _events(step, n=6, sleep_cycles=int(2e7))})
        res[name] = {}
        for n, rs in rows.items():
            med = {t: {m: statistics.median(r[t][m] for r in rs) for m in ("gpu_ms", "host_ms")}
                   for t in ("cold", "batched", "after_sleep")}
            res[name][n] = dict(med, rounds=rs)
            print(f"{name:18s} {n:11s} " + " ".join(f"{t} {med[t]['gpu_ms']:.3f} (host {med[t]['host_ms']:.3f})"
                                                      for t in med), flush=True)
    if a.json:
        with open(measure.result_path(a.json), "w") as fh:
            json.dump({"kind": "flex_carve_timing", "env": measure.environment(
                dev, " ".join(["python", "benchmarks/flex_carve_timing.py", *sys.argv[1:]])), "results": res}, fh,
                indent=1)


if __name__ == "__main__":
    main()
