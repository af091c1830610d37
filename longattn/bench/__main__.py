"""python -m longattn.bench [list|run|dist|scale|decode|hf-train|report] ...

With no command: run the default small configs on whatever device is here
(CPU included) and print a table. `COMMAND --help` describes each command.
A --json path may hold {commit}: it becomes the commit of the code that runs
(with -dirty for a tree with uncommitted changes), e.g. --json dist_2xh200_{commit}.json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from . import configs as C


def _overrides(a) -> dict:
    return dict(seqlen=a.seqlen, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, batch=a.batch,
                dtype=a.dtype, causal=a.causal, pattern_args=a.pattern_args)


def _numbers(text: str) -> tuple:
    """'8192,128' -> (8192, 128); '0.5' -> (0.5,)."""
    try:
        return tuple(float(x) if any(c in x for c in ".e") else int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers separated by commas, e.g. 8192,128") from None


def _add_overrides(p):
    g = p.add_argument_group("overrides (change the named configs' shapes)")
    g.add_argument("--seqlen", type=int, help="sequence length (tokens per batch element)")
    g.add_argument("--heads", type=int, help="query heads")
    g.add_argument("--kv-heads", type=int, help="key/value heads (GQA/MQA; a divisor of --heads)")
    g.add_argument("--head-dim", type=int, help="head dimension")
    g.add_argument("--batch", type=int, help="batch size")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="input dtype (CPU runs use fp32 for bf16)")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None, help="causal mask on or off")
    g.add_argument("--pattern-args", type=_numbers, help="a flex config's pattern parameters, comma-separated: "
                   "local_global window,global tokens (e.g. 8192,128); causal_document the document lengths; "
                   "prefix_lm the prefix's fraction; block_sparse block,band,density,seed")


def _configs(names, a):
    return [C.get(n).with_overrides(**_overrides(a)) for n in names]


def _emit(payload, a, table):
    if a.json:
        from .measure import write_json

        write_json(a.json, payload)
        print(f"wrote {a.json}", file=sys.stderr)
    print(table)


def _json_path(a) -> None:
    """--json's {commit} filled in, once, before the run (every rank the same name)."""
    if getattr(a, "json", None):
        from .measure import result_path

        a.json = result_path(a.json)


def _impl_list() -> str:
    from .impls import IMPLS

    lines = ["implementations (--impl; by default all that apply to each config's kind):"]
    for i in IMPLS.values():
        lines.append(f"  {i.name:26s} [{', '.join(i.kinds)}] {i.note}")
    return "\n".join(lines)


_CONFIG_HELP = "named configs (`python -m longattn.bench list` shows them)"
_JSON_HELP = "write the results to this JSON file (and a CSV beside it)"
_ITERS_HELP = "timed calls per measurement (the median is reported)"
_WARMUP_HELP = "untimed calls before timing (the first compiles, autotunes, fills caches)"


def _parser() -> argparse.ArgumentParser:
    from .dist import DIST_IMPLS, LAUNCH_HINT
    from .torch_cp import FLEX_DIST_IMPLS

    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m longattn.bench", description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("list", help="named configs and their shapes")
    pr = sub.add_parser("run", help="single device: our ops against the alternatives", epilog=_impl_list(),
                        formatter_class=raw)
    pr.add_argument("--config", nargs="+", required=True, help=_CONFIG_HELP)
    pr.add_argument("--impl", nargs="+", help="implementations to time (listed below; default: all that apply)")
    pr.add_argument("--json", help=_JSON_HELP)
    pr.add_argument("--no-backward", action="store_true", help="time the forward only")
    pr.add_argument("--timing", choices=["warmup", "profiler", "batched"], default="warmup",
                    help="warmup: one cold call per sample (host time to the first kernel counts); profiler: "
                         "also top kernels; batched: calls back to back, time per call (host ahead, as in training)")
    pr.add_argument("--warmup", type=int, default=3, help=_WARMUP_HELP + " (default 3)")
    pr.add_argument("--iters", type=int, default=10, help=_ITERS_HELP + " (default 10)")
    pr.add_argument("--device", help="torch device, e.g. cuda:1 or cpu (default: cuda when present, else cpu)")
    _add_overrides(pr)
    pd = sub.add_parser("dist", help="under torchrun: one device vs N ranks, efficiency, memory per rank",
                        epilog=f"implementations (--impl): {', '.join(DIST_IMPLS)}; dilated configs run "
                               "dilated-over-ranks (ring-contiguous); flex configs run "
                               f"{', '.join(FLEX_DIST_IMPLS)}. Examples on CPU (gloo):\n"
                               "  torchrun --nproc_per_node=2 -m longattn.bench dist --config tiny\n"
                               "  torchrun --nproc_per_node=4 -m longattn.bench dist --config tiny "
                               "--impl ring-zigzag ulysses hybrid --mesh 2x2\n" + LAUNCH_HINT,
                        formatter_class=raw)
    pd.add_argument("--config", nargs="+", required=True, help=_CONFIG_HELP)
    pd.add_argument("--impl", nargs="+", help=f"from {', '.join(DIST_IMPLS)}; flex configs: "
                                              f"{', '.join(FLEX_DIST_IMPLS)} (default: the ring's and torch's; "
                                              f"flex-exchange:FIELD=VALUE,... runs the exchange under those "
                                              f"longattn.tuning.FlexExchangeTuning fields, e.g. join_halo=1)")
    pd.add_argument("--mesh", help="UxR: the hybrid's mesh, U ulysses ranks (consecutive, one node) x R ring ranks; "
                                   "or name it per impl, hybrid:UxR")
    pd.add_argument("--weak", action="store_true", help="global seqlen = N x config seqlen")
    pd.add_argument("--json", help=_JSON_HELP + "; rank 0 writes it after each config")
    pd.add_argument("--no-backward", action="store_true", help="time the forward only")
    pd.add_argument("--warmup", type=int, default=3, help=_WARMUP_HELP + " (default 3)")
    pd.add_argument("--iters", type=int, default=10, help=_ITERS_HELP + " (default 10)")
    pd.add_argument("--timing", choices=["cold", "batched"], default="cold",
                    help="cold: one call per sample, host time to the first kernel counts; batched: calls back to "
                         "back, time per call (host ahead of the GPU; CPU runs are cold)")
    _add_overrides(pd)
    ps = sub.add_parser("scale", help="double the seqlen until out of memory", epilog=_impl_list(),
                        formatter_class=raw)
    ps.add_argument("--config", required=True, help="one named config (its seqlen is the start)")
    ps.add_argument("--impl", nargs="+", required=True, help="implementations to scale (listed below)")
    ps.add_argument("--max-seqlen", type=int, default=1 << 24, help="stop after this length (default 16M)")
    ps.add_argument("--json", help=_JSON_HELP)
    ps.add_argument("--no-backward", action="store_true", help="time the forward only")
    ps.add_argument("--device", help="torch device (default: cuda when present, else cpu)")
    _add_overrides(ps)
    # their own parsers (`decode --help`, `hf-train --help`); listed here so that --help names them
    sub.add_parser("decode", add_help=False, help="long-context inference: prefill, KVCache, one token per step "
                                                   "(`decode --help`)")
    sub.add_parser("hf-train", add_help=False, help="a transformers training step (Llama, Gemma 2, GPT-OSS, "
                                                     "Llama 4) under each attention implementation "
                                                     "(`hf-train --help`)")
    pp = sub.add_parser("report", help="markdown summary and PNG plots from result JSONs; --readme: README's "
                                       "numbers table")
    pp.add_argument("paths", nargs="+", help="result JSON files of run, scale, dist, decode or hf-train")
    pp.add_argument("--out", default=None, help="folder for report.md and plots (default: beside the first JSON)")
    pp.add_argument("--readme", metavar="README", help="rewrite README's numbers table (between its "
                                                        "<!-- numbers --> markers) from these files instead")
    return p


def _dist_impls(p, a):
    from .dist import with_mesh

    try:
        return with_mesh(a.impl, a.mesh)
    except ValueError as e:
        p.error(str(e))


def _check_impls(p, a) -> None:
    """Unknown `run`/`scale` implementations are a usage error, before anything runs."""
    from .impls import IMPLS

    unknown = [n for n in a.impl if n not in IMPLS]
    if unknown:
        p.error(f"unknown implementation(s) {', '.join(unknown)}; `{a.cmd} --help` lists them")


def _cmd_list(p, a, cfgs) -> int:
    print("| name | kind | shape | note |\n|---|---|---|---|")
    for c in C.CONFIGS.values():
        print(f"| {c.name} | {c.kind} | {c.describe()} | {c.note} |")
    return 0


def _cmd_default(p, a, cfgs) -> int:
    from .single import format_table, run

    cuda = torch.cuda.is_available()
    names = ["small", "longnet_32k"] if cuda else ["tiny", "dilated_tiny"]
    # CPU: one warm-up call fills the caches (nothing autotunes or compiles there)
    res = run([C.get(n) for n in names], warmup=3 if cuda else 1, iters=20 if cuda else 5)
    print(f"# {res['env']['device']}, torch {res['env']['torch']}\n")
    print(format_table(res["results"]))
    return 0


def _cmd_run(p, a, cfgs) -> int:
    from .single import format_table, run

    res = run(cfgs, a.impl, device=a.device, backward=not a.no_backward, warmup=a.warmup,
              iters=a.iters, timing=a.timing)
    _emit(res, a, format_table(res["results"]))
    return 0


def _cmd_scale(p, a, cfgs) -> int:
    from .single import format_table, scale

    res = scale(cfgs[0], a.impl, device=a.device, backward=not a.no_backward, max_seqlen=a.max_seqlen)
    _emit(res, a, format_table(res["results"]) + f"\n\nlongest: {res['longest_seqlen']}")
    return 0


def _cmd_dist(p, a, cfgs) -> int:
    import torch.distributed as dist

    from .dist import LAUNCH_HINT, format_table, launched, run_dist

    if not launched():
        p.exit(2, f"{p.prog} dist: not started by torchrun (no RANK / WORLD_SIZE in the environment).\n"
                  f"{LAUNCH_HINT}\n")

    res = run_dist(cfgs, _dist_impls(p, a), weak=a.weak, backward=not a.no_backward, warmup=a.warmup,
                   iters=a.iters, json_path=a.json, timing=a.timing)
    if dist.get_rank() == 0:
        _emit(res, a, format_table(res["results"]))
    dist.barrier()  # no rank tears down while a peer still talks to it
    dist.destroy_process_group()
    return 0


def _cmd_report(p, a, cfgs) -> int:
    from .report import load, markdown, plots

    try:
        docs = load(a.paths)
    except ValueError as e:
        p.error(str(e))
    if a.readme:
        from .readme import update_readme

        changed = update_readme(a.readme, a.paths)
        print(f"{a.readme}: numbers table {'rewritten' if changed else 'already up to date'} from "
              f"{len(a.paths)} file(s)", file=sys.stderr)
        return 0
    out = a.out or os.path.dirname(os.path.abspath(a.paths[0]))
    md = markdown(docs)
    pngs, missing = plots(docs, out)
    if pngs is None:
        md += f"\nPlots: {missing[0]}\n"
        missing = []
        pngs = []
    md += "\n" + "\n".join(f"![{os.path.basename(x)}]({os.path.basename(x)})" for x in pngs) + "\n"
    if missing:
        md += "\nPlots these results cannot make yet:\n\n" + "\n".join(f"- {m}" for m in missing) + "\n"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {os.path.join(out, 'report.md')} and {len(pngs)} plot(s)"
          + (f"; {len(missing)} more need more runs (listed in report.md)" if missing else ""), file=sys.stderr)
    return 0


_COMMANDS = {None: _cmd_default, "list": _cmd_list, "run": _cmd_run, "scale": _cmd_scale, "dist": _cmd_dist,
             "report": _cmd_report}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["decode"]:  # long-context inference: its own parser (`decode --help`), longattn/bench/decode.py
        from .decode import main as decode_main

        return decode_main(argv[1:])
    if argv[:1] == ["hf-train"]:  # its own parser, longattn/bench/hf_train.py
        from .hf_train import main as hf_main

        hf_main(argv[1:])
        return 0
    p = _parser()
    a = p.parse_args(argv)
    _json_path(a)
    if a.cmd in ("run", "scale") and a.impl:
        _check_impls(p, a)
    cfgs = None
    if a.cmd in ("run", "scale", "dist"):
        try:
            cfgs = _configs(a.config if a.cmd != "scale" else [a.config], a)
        except ValueError as e:
            p.error(str(e))
    return _COMMANDS[a.cmd](p, a, cfgs)


if __name__ == "__main__":
    sys.exit(main())
