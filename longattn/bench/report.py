"""`report`: a markdown summary and PNG plots from result JSON files."""
from __future__ import annotations

import json
import os
from collections import defaultdict


KINDS = ("run", "scale", "dist", "decode", "hf_train")


def kind_of(d: dict) -> str:
    """The command that wrote a result: ``kind`` (run, scale, dist, decode) or
    ``benchmark`` (hf_train)."""
    return d.get("kind") or d.get("benchmark") or "unknown"


def load(paths):
    """The result files, each with ``_path``; a file no bench command wrote is a ValueError naming it."""
    out = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        if not isinstance(d, dict) or kind_of(d) not in KINDS or not isinstance(d.get("results"), list):
            raise ValueError(f"{p}: not a result of `python -m longattn.bench` ({', '.join(KINDS)}): "
                             "report reads the JSON files those commands write")
        d["_path"] = p
        out.append(d)
    return out


def hf_train_table(rows) -> str:
    lines = ["| model | attn | ranks | seqlen | docs | step ms | tokens/s per GPU | peak GiB | peak extra GiB | "
             "first loss | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('family', 'llama')} | {r['attn']} | {r.get('world')} | {r['seqlen']} | "
                     f"{r.get('docs')} | {r.get('step_ms_median') or '–'} | {r.get('tokens_per_s_per_gpu') or '–'} | "
                     f"{r.get('peak_mem_gib') or '–'} | {r.get('peak_extra_gib') or '–'} | "
                     f"{r.get('initial_loss') or '–'} | {r.get('error') or 'ok'} |")
    return "\n".join(lines)


def markdown(docs) -> str:
    from .decode import format_table as decode_table
    from .dist import format_table as dist_table
    from .single import format_table as run_table

    tables = {"dist": dist_table, "decode": decode_table, "hf_train": hf_train_table}
    parts = ["# longattn benchmark report", ""]
    for d in docs:
        env = d.get("env", {})
        parts.append(f"## {os.path.basename(d['_path'])} ({kind_of(d)})")
        parts.append(f"device: {env.get('device')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN "
                     f"{env.get('cudnn')}, Triton {env.get('triton')}, commit {env.get('commit')}")
        parts.append(f"command: `{env.get('command')}`")
        parts.append("")
        parts.append(tables.get(kind_of(d), run_table)(d["results"]))
        if kind_of(d) == "scale":
            parts.append("")
            parts.append(f"longest sequence that ran: {d.get('longest_seqlen')}")
        parts.append("")
    return "\n".join(parts)


def _stem(d) -> str:
    return os.path.splitext(os.path.basename(d["_path"]))[0]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _bars(ax, groups: list[str], series: dict[str, list], ylabel: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series (None: no bar)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (n - 1) / 2) * width for i, v in enumerate(vals) if v is not None]
        ax.bar(xs, [v for v in vals if v is not None], width, label=name)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _ok_rows(d, by: str, timed: str) -> dict:
    """The rows of result file ``d`` that ran (status ok, ``timed`` measured), grouped by their ``by`` value."""
    out = defaultdict(list)
    for r in d["results"]:
        if r.get("status") == "ok" and r.get(timed) is not None:
            out[r[by]].append(r)
    return out


def _impl_plots(docs, plt, save) -> None:
    """Per `run` file and config: time and FLOP/s of each implementation."""
    from . import tables as T
    from .single import bwd_measured

    for d in docs:
        if d.get("kind") != "run":
            continue
        for cfg, rows in _ok_rows(d, "config", "fwd_ms").items():
            impls = [r["impl"] for r in rows]
            unit, f = T.flops_unit([r.get(k) for r in rows for k in ("fwd_tflops", "bwd_tflops")])
            fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(rows) + 5), 4.5))
            # backward bars only where it was timed by itself (older files derived it)
            bwd = [r if bwd_measured(r) else {} for r in rows]
            _bars(axes[0], impls, {"forward": [r["fwd_ms"] for r in rows],
                                   "backward": [r.get("bwd_ms") for r in bwd],
                                   "forward+backward": [r.get("fwd_bwd_ms") for r in rows]}, "time (ms, median)")
            _bars(axes[1], impls, {"forward": [r.get("fwd_tflops") and r["fwd_tflops"] * f for r in rows],
                                   "backward": [r.get("bwd_tflops") and r["bwd_tflops"] * f for r in bwd]},
                  f"{unit} (useful pairs)")
            fig.suptitle(f"{cfg}: {rows[0].get('shape', '')}, ran in {rows[0].get('dtype')}", fontsize=9)
            save(fig, f"{_safe(_stem(d))}_{_safe(cfg)}_impls.png")


def _seqlen_series(docs) -> dict:
    """``{(impl, heads, kv heads, head dim, causal): {seqlen: row}}`` over the
    `run` and `scale` files: one series per implementation and shape family."""
    series = defaultdict(dict)
    for d in docs:
        if d.get("kind") not in ("run", "scale"):
            continue
        for r in d["results"]:
            if r.get("status") == "ok" and r.get("fwd_ms") is not None:
                key = (r["impl"], r.get("heads"), r.get("kv_heads"), r.get("head_dim"), r.get("causal"))
                series[key][r["seqlen"]] = r
    return series


def _seqlen_curves(docs, plt, save) -> list[str]:
    """Time and memory against sequence length, only real curves (two or more
    lengths); returns the missing-plot line when there are none."""
    series = _seqlen_series(docs)
    curves = {k: v for k, v in series.items() if len(v) >= 2}
    if not curves:
        if not series:
            return []
        return ["time and memory against sequence length: needs one implementation at two or more "
                "sequence lengths (`scale`, or `run` result files at different `--seqlen`)"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for (impl, h, hkv, hd, causal), pts in sorted(curves.items(), key=lambda kv: str(kv[0])):
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
    save(fig, "time_memory_vs_seqlen.png")
    return []


def _efficiency_bars(docs, plt, save) -> None:
    """Per `dist` file: the efficiency of each implementation at its number of ranks."""
    for d in docs:
        if d.get("kind") != "dist":
            continue
        rows = [r for r in d["results"] if r.get("efficiency_fwd") is not None]
        if not rows:
            continue
        groups = list(dict.fromkeys(f"{r['config']} ({r['world_size']} ranks)" for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(groups) * len(impls) + 4), 4.5))
        for ax, key, title in ((axes[0], "efficiency_fwd", "forward"), (axes[1], "efficiency_fwd_bwd",
                                                                         "forward+backward")):
            vals = {i: [next((r.get(key) for r in rows if r["impl"] == i
                              and f"{r['config']} ({r['world_size']} ranks)" == g), None) for g in groups]
                    for i in impls}
            _bars(ax, groups, vals, f"parallel efficiency, {title}")
            ax.axhline(1.0, color="grey", lw=0.5)
        save(fig, f"{_safe(_stem(d))}_efficiency.png")


def _decode_label(r) -> str:
    name = r["impl"] if r.get("backend") in (None, "", r["impl"].split("-")[-1]) else f"{r['impl']} ({r['backend']})"
    return name if (r.get("world") or 1) == 1 else f"{name}, {r['world']} ranks"


def _decode_plots(docs, plt, save) -> None:
    """Per `decode` file: ms per token and layer of each implementation, one
    panel per context length, fastest first (log axis: a backend that
    re-reads the whole cache per token sits two orders of magnitude out)."""
    for d in docs:
        if d.get("kind") != "decode":
            continue
        by_ctx = _ok_rows(d, "context", "step_ms")
        if not by_ctx:
            continue
        ctxs = sorted(by_ctx)
        most = max(len(v) for v in by_ctx.values())
        fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 0.32 * most + 1.8), squeeze=False)
        for ax, ctx in zip(axes[0], ctxs):
            rows = sorted(by_ctx[ctx], key=lambda r: r["step_ms"])
            ys = range(len(rows))
            colors = ["tab:blue" if r["impl"].startswith("longattn") else "tab:gray" for r in rows]
            ax.barh(list(ys), [r["step_ms"] for r in rows], color=colors)
            ax.set_yticks(list(ys))
            ax.set_yticklabels([_decode_label(r) for r in rows], fontsize=7)
            ax.invert_yaxis()
            ax.set_xscale("log")
            for y, r in zip(ys, rows):
                ax.text(r["step_ms"], y, f" {r['step_ms']:.3g}", va="center", fontsize=7)
            ax.set_xlabel("ms per token and layer (median)")
            ax.set_title(f"context {ctx // 1024}K", fontsize=9)
            ax.grid(True, axis="x", which="both", alpha=0.3)
        env, r0 = d.get("env", {}), by_ctx[ctxs[0]][0]
        timing = "back to back" if "--timing batched" in (env.get("command") or "") else "one step from an idle GPU"
        fig.suptitle(f"decode, {env.get('device')}: {r0.get('heads')}q/{r0.get('kv_heads')}kv heads, D={r0.get('head_dim')}, "
                     f"batch {r0.get('batch')}, {timing} (longattn in blue)", fontsize=9)
        save(fig, f"{_safe(_stem(d))}_decode.png", dpi=110)


def _short(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"


def _hf_train_plots(docs, plt, save) -> None:
    """Per `hf_train` file: each attention implementation's training step
    (ms, tokens/s per GPU) and peak memory; failed ones (out of memory) named."""
    for d in docs:
        if kind_of(d) != "hf_train":
            continue
        rows = [r for r in d["results"] if r.get("step_ms_median") is not None]
        if not rows:
            continue
        label = lambda r: r["attn"] if (r.get("world") or 1) == 1 else f"{r['attn']} ({r['world']} GPUs)"
        groups = [label(r) for r in rows]
        fig, axes = plt.subplots(1, 3, figsize=(max(10, 1.6 * len(rows) + 7), 4.2))
        for ax, key, name in ((axes[0], "step_ms_median", "step (ms, median)"),
                              (axes[1], "tokens_per_s_per_gpu", "tokens/s per GPU"),
                              (axes[2], "peak_mem_gib", "peak memory (GiB)")):
            _bars(ax, groups, {name: [r.get(key) for r in rows]}, name)
            ax.get_legend().remove()
            for bar in ax.patches:  # the values: neighbours often differ by a few percent
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), _short(bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        failed = [f"{r['attn']}: {str(r['error'])[:40]}" for r in d["results"] if r.get("step_ms_median") is None]
        r0 = rows[0]
        fig.suptitle(f"{r0.get('family') or d.get('family') or 'llama'}, {r0['seqlen'] // 1024}K tokens, "
                     f"{r0.get('docs') or 1} document(s), {d.get('env', {}).get('device')}"
                     + (f"; failed: {'; '.join(failed)}" if failed else ""), fontsize=9)
        save(fig, f"{_safe(_stem(d))}_steps.png")


def _efficiency_vs_ranks(docs, plt, save) -> list[str]:
    """Efficiency (fwd+bwd) against the number of ranks, one curve per config
    and implementation; returns the missing-plot line when no curve has two points."""
    eff = defaultdict(dict)
    for d in docs:
        if d.get("kind") != "dist":
            continue
        for r in d["results"]:
            if r.get("efficiency_fwd_bwd") is not None:  # only what the axis says
                eff[(r["config"], r["impl"])][r["world_size"]] = r["efficiency_fwd_bwd"]
    if not any(len(pts) >= 2 for pts in eff.values()):
        if not any(d.get("kind") == "dist" for d in docs):
            return []
        return ["efficiency against the number of ranks: needs `dist` results of one config at two or more "
                "world sizes (e.g. `torchrun --nproc_per_node=2` and `=4`)"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = {"ring-zigzag": "-", "ring-contiguous": ":", "torch-cp": "--", "dilated-over-ranks": "-."}
    for (cfg, impl), pts in sorted(eff.items()):
        ws = sorted(pts)
        ax.plot(ws, [pts[w] for w in ws], marker="o", ls=styles.get(impl, "-"), label=f"{cfg} {impl}")
    ax.set_xlabel("ranks")
    ax.set_ylabel("parallel efficiency (fwd+bwd)")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(True, alpha=0.3)
    save(fig, "efficiency_vs_gpus.png", dpi=110)  # file name as in earlier reports
    return []


def plots(docs, outdir: str):
    """Write the PNG plots these results support; returns (paths written,
    lines naming each plot that needs more runs and what it needs), or (None,
    [how to get plots]) without matplotlib.

    One run (``run``) gives, per config, time and FLOP/s per implementation;
    one ``dist`` run gives the parallel efficiency per implementation at its
    number of ranks; one ``decode`` run, per context, each implementation's
    time per token and layer; one ``hf_train`` run, each attention's
    training step and peak memory. Curves need more points: time and memory against the
    sequence length (one implementation at two or more lengths: ``scale``, or
    ``run`` files at different ``--seqlen``) and efficiency against the number
    of ranks (``dist`` at two or more world sizes)."""
    try:
        import matplotlib
    except ImportError:
        return None, ["none written: matplotlib is not installed (`pip install matplotlib`, then run report "
                      "again)"]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    written = []

    def save(fig, name, dpi=100):
        p = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(p, dpi=dpi)
        plt.close(fig)
        written.append(p)

    _impl_plots(docs, plt, save)
    _decode_plots(docs, plt, save)
    _hf_train_plots(docs, plt, save)
    missing = _seqlen_curves(docs, plt, save)
    _efficiency_bars(docs, plt, save)
    missing += _efficiency_vs_ranks(docs, plt, save)
    return written, missing
