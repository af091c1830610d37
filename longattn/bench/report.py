"""`report`: a markdown summary and PNG plots from result JSON files."""
from __future__ import annotations

import json
import os
from collections import defaultdict


def load(paths):
    out = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        d["_path"] = p
        out.append(d)
    return out


def _mib(v):
    return "–" if v is None else f"{v / 2**20:.0f}"


def markdown(docs) -> str:
    from .dist import format_table as dist_table
    from .single import format_table as run_table

    parts = ["# longattn benchmark report", ""]
    for d in docs:
        env = d.get("env", {})
        parts.append(f"## {os.path.basename(d['_path'])} ({d.get('kind')})")
        parts.append(f"device: {env.get('device')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN "
                     f"{env.get('cudnn')}, Triton {env.get('triton')}, commit {env.get('commit')}")
        parts.append(f"command: `{env.get('command')}`")
        parts.append("")
        if d.get("kind") == "dist":
            parts.append(dist_table(d["results"]))
        else:
            parts.append(run_table(d["results"]))
            if d.get("kind") == "scale":
                parts.append("")
                parts.append(f"longest sequence that ran: {d.get('longest_seqlen')}")
        parts.append("")
    return "\n".join(parts)


def plots(docs, outdir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    written = []
    # time and memory against sequence length: one series per implementation
    # and shape family (heads, kv heads, head dim, causal); only real curves
    series = defaultdict(dict)
    for d in docs:
        if d.get("kind") not in ("run", "scale"):
            continue
        for r in d["results"]:
            if r.get("status") == "ok" and r.get("fwd_ms") is not None:
                key = (r["impl"], r.get("heads"), r.get("kv_heads"), r.get("head_dim"), r.get("causal"))
                series[key][r["seqlen"]] = r
    series = {k: v for k, v in series.items() if len(v) >= 2}
    if series:
        fig, axes = plt.subplots(1, 3, figsize=(17, 5))
        for (impl, h, hkv, hd, causal), pts in sorted(series.items(), key=lambda kv: str(kv[0])):
            xs = sorted(pts)
            lbl = f"{impl} H={h}{'/' + str(hkv) if hkv != h else ''} D={hd}{' causal' if causal else ''}"
            axes[0].plot(xs, [pts[x]["fwd_ms"] for x in xs], marker="o", label=lbl)
            xb = [x for x in xs if pts[x].get("fwd_bwd_ms") is not None]
            axes[1].plot(xb, [pts[x]["fwd_bwd_ms"] for x in xb], marker="o", label=lbl)
            xm = [x for x in xs if pts[x].get("fwd_bwd_peak_mem_bytes") is not None]
            axes[2].plot(xm, [pts[x]["fwd_bwd_peak_mem_bytes"] / 2**20 for x in xm], marker="o", label=lbl)
        for ax, yl in zip(axes, ("forward time (ms)", "forward+backward time (ms)",
                                 "peak extra memory, fwd+bwd (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_ylabel(yl)
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(outdir, "time_memory_vs_seqlen.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    # efficiency against GPUs
    eff = defaultdict(dict)
    for d in docs:
        if d.get("kind") != "dist":
            continue
        for r in d["results"]:
            if r.get("efficiency_fwd_bwd") is not None:  # only what the axis says
                eff[(r["config"], r["impl"])][r["world_size"]] = r["efficiency_fwd_bwd"]
    if eff:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        styles = {"ring-zigzag": "-", "ring-contiguous": ":", "torch-cp": "--", "dilated-over-ranks": "-."}
        for (cfg, impl), pts in sorted(eff.items()):
            ws = sorted(pts)
            ax.plot(ws, [pts[w] for w in ws], marker="o", ls=styles.get(impl, "-"), label=f"{cfg} {impl}")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("parallel efficiency (fwd+bwd)")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        p = os.path.join(outdir, "efficiency_vs_gpus.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written
