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
    python benchmarks/flex_carve_timing.py --seqlen 4096 8192 --json OUT.json --plot OUT.png flex_bsparse_32k

``--seqlen`` runs the configs' pattern at other lengths (rows named
``CONFIG@SEQLEN``): where the host's time per call outweighs the GPU's.
``--plot PNG`` draws cold fwd+bwd ms against the length, one panel per
pattern, one line per variant (the planned executor eagerly, graphed,
``flex_attention``, torch's), from this run or, with ``--from``, from saved
result files (no GPU needed):

    python benchmarks/flex_carve_timing.py --from A.json B.json --plot OUT.png
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


PLANNED = ("carved", "as planned")
"""The planned executor's variant name: "carved" where it carves, else "as planned"."""


def plot(results: dict, path: str) -> None:
    """Cold fwd+bwd ms against the length, a panel per pattern, a line per variant (``results``: rows named
    CONFIG or CONFIG@SEQLEN, as written to the JSON)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict = {}  # pattern -> variant -> {length: ms}
    for row, variants in results.items():
        base, _, n = row.partition("@")
        length = int(n) if n else CONFIGS[base].seqlen
        for v, m in variants.items():
            label = "planned, eager" if v in PLANNED else v
            if label in ("planned, eager", "graphed", "flex_attention", "torch-flex"):
                curves.setdefault(base, {}).setdefault(label, {})[length] = m["cold"]["gpu_ms"]
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4.2), squeeze=False)
    for ax, (base, lines) in zip(axes[0], sorted(curves.items())):
        for label, pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers on the log axes, not powers
            axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.set_title(base.replace("_32k", ""))
        ax.set_xlabel("tokens")
        ax.set_ylabel("fwd+bwd ms, cold")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqlen", type=int, nargs="+", help="run each config's pattern at these lengths")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="a PNG of cold fwd+bwd ms against the length")
    ap.add_argument("--from", dest="files", nargs="+", help="plot these result files instead of running")
    a = ap.parse_args()
    if a.files:
        if not a.plot:
            ap.error("--from needs --plot")
        res = {}
        for f in a.files:
            with open(f) as fh:
                res.update(json.load(fh)["results"])
        plot(res, a.plot)
        return
    if not a.configs:
        ap.error("name one or more configs (or --from FILES --plot PNG)")
    dev = torch.device("cuda")
    res = {}
    cfgs = [CONFIGS[n] if s is None else dataclasses.replace(CONFIGS[n], name=f"{n}@{s}", seqlen=s)
            for n in a.configs for s in (a.seqlen or [None])]
    for cfg in cfgs:
        name = cfg.name
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
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()
