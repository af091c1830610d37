"""python -m longattn.bench [list|run|dist|scale|report] ...

With no command: run the default small configs on whatever device is here
(CPU included) and print a table.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from . import configs as C


def _overrides(a) -> dict:
    return dict(seqlen=a.seqlen, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, batch=a.batch,
                dtype=a.dtype, causal=a.causal)


def _add_overrides(p):
    g = p.add_argument_group("overrides")
    g.add_argument("--seqlen", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--batch", type=int)
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None)


def _configs(names, a):
    return [C.get(n).with_overrides(**_overrides(a)) for n in names]


def _emit(payload, a, table):
    if a.json:
        from .measure import write_json

        write_json(a.json, payload)
        print(f"wrote {a.json}", file=sys.stderr)
    print(table)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m longattn.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("list", help="named configs and their shapes")
    pr = sub.add_parser("run", help="single device: our ops against the alternatives")
    pr.add_argument("--config", nargs="+", required=True)
    pr.add_argument("--impl", nargs="+", help="implementations (default: all that apply)")
    pr.add_argument("--json")
    pr.add_argument("--no-backward", action="store_true")
    pr.add_argument("--timing", choices=["warmup", "profiler", "batched"], default="warmup",
                    help="warmup: one cold call per sample (host time to the first kernel counts); profiler: "
                         "also top kernels; batched: calls back to back, time per call (host ahead, as in training)")
    pr.add_argument("--warmup", type=int, default=3)
    pr.add_argument("--iters", type=int, default=10)
    pr.add_argument("--device")
    _add_overrides(pr)
    pd = sub.add_parser("dist", help="under torchrun: 1 GPU vs N GPUs, efficiency, memory per GPU")
    pd.add_argument("--config", nargs="+", required=True)
    pd.add_argument("--impl", nargs="+")
    pd.add_argument("--weak", action="store_true", help="global seqlen = N x config seqlen")
    pd.add_argument("--json")
    pd.add_argument("--no-backward", action="store_true")
    pd.add_argument("--warmup", type=int, default=3)
    pd.add_argument("--iters", type=int, default=10)
    pd.add_argument("--timing", choices=["cold", "batched"], default="cold",
                    help="cold: one call per sample, host time to the first kernel counts; batched: calls back to "
                         "back, time per call (host ahead of the GPU)")
    _add_overrides(pd)
    ps = sub.add_parser("scale", help="double the seqlen until out of memory")
    ps.add_argument("--config", required=True)
    ps.add_argument("--impl", nargs="+", required=True)
    ps.add_argument("--max-seqlen", type=int, default=1 << 24)
    ps.add_argument("--json")
    ps.add_argument("--no-backward", action="store_true")
    ps.add_argument("--device")
    _add_overrides(ps)
    pp = sub.add_parser("report", help="markdown summary and PNG plots from result JSONs")
    pp.add_argument("paths", nargs="+")
    pp.add_argument("--out", default=None, help="folder for report.md and plots (default: beside the first JSON)")
    a = p.parse_args(argv)

    if a.cmd == "list":
        print("| name | kind | shape | note |\n|---|---|---|---|")
        for c in C.CONFIGS.values():
            print(f"| {c.name} | {c.kind} | {c.describe()} | {c.note} |")
        return 0
    if a.cmd is None:
        from .single import format_table, run

        names = ["small", "longnet_32k"] if torch.cuda.is_available() else ["tiny", "dilated_tiny"]
        res = run([C.get(n) for n in names], iters=5 if not torch.cuda.is_available() else 20)
        print(f"# {res['env']['device']}, torch {res['env']['torch']}\n")
        print(format_table(res["results"]))
        return 0
    if a.cmd == "run":
        from .single import format_table, run

        res = run(_configs(a.config, a), a.impl, device=a.device, backward=not a.no_backward, warmup=a.warmup,
                  iters=a.iters, timing=a.timing)
        _emit(res, a, format_table(res["results"]))
        return 0
    if a.cmd == "scale":
        from .single import format_table, scale

        cfg = _configs([a.config], a)[0]
        res = scale(cfg, a.impl, device=a.device, backward=not a.no_backward, max_seqlen=a.max_seqlen)
        _emit(res, a, format_table(res["results"]) + f"\n\nlongest: {res['longest_seqlen']}")
        return 0
    if a.cmd == "dist":
        import torch.distributed as dist

        from .dist import format_table, run_dist

        res = run_dist(_configs(a.config, a), a.impl, weak=a.weak, backward=not a.no_backward, warmup=a.warmup,
                       iters=a.iters, json_path=a.json, timing=a.timing)
        if dist.get_rank() == 0:
            _emit(res, a, format_table(res["results"]))
        dist.barrier()  # no rank tears down while a peer still talks to it
        dist.destroy_process_group()
        return 0
    if a.cmd == "report":
        from .report import load, markdown, plots

        docs = load(a.paths)
        out = a.out or os.path.dirname(os.path.abspath(a.paths[0]))
        md = markdown(docs)
        pngs = plots(docs, out)
        md += "\n" + "\n".join(f"![{os.path.basename(x)}]({os.path.basename(x)})" for x in pngs) + "\n"
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "report.md"), "w") as f:
            f.write(md)
        print(md)
        print(f"wrote {os.path.join(out, 'report.md')} and {len(pngs)} plot(s)", file=sys.stderr)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
