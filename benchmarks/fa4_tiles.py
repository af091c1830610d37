"""FA4's kernel tiles on the calls longattn makes: its forward tile (``tile_mn``,
``mma_pv_is_rs``, ``intra_wg_overlap``, ``pack_gqa``: arguments of
``_flash_attn_fwd``) and its sm_90 backward's query tile (``m_block_size``,
fixed by FA4's ``_tile_size_bwd_sm90``, swapped here for the run), against
FA4's own choice and cuDNN, in one process, the variants alternating.

Each variant runs the whole op of a bench config (``longnet_128k``: the
dilated views engine's calls on strided views; ``dense_32k``;
``varlen_mix_32k``): forward ms and fwd+bwd ms (median of CUDA-event timings
per call, calls back to back), and its largest difference from FA4's own
choice (out and the three gradients, relative to their largest magnitude).

    python benchmarks/fa4_tiles.py --json OUT.json [--configs longnet_128k ...] [--precompile 8]

A config is a bench config's name or ``B:S:H:HKV:D[:causal]`` (a dense call of
that shape, bf16).

A variant is ``cudnn``, ``fa4`` (FA4's choice) or ``fa4:`` with ``+``-joined
parts: ``f128x176`` (forward tile m x n), ``rs0`` / ``ol0`` (no register-held P
/ no intra-warpgroup overlap), ``pack0`` / ``pack1`` (GQA unpacked / packed), ``b64`` (backward
query tile 64), ``ctl`` (nothing changed: a control). Each round runs the
variants in an order rotated by one. ``--precompile N`` compiles every FA4 variant first in N
processes sharing FA4's disk cache (CuTe DSL compiles take seconds each).
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")  # read when FA4 is imported

import torch  # noqa: E402

import longattn  # noqa: E402
from longattn.backends import _fa4_api  # noqa: E402
from longattn.bench import configs as C  # noqa: E402
from longattn.bench.measure import environment  # noqa: E402

# Per config: the variants beside cudnn and fa4 (FA4's tiles on sm_90: D=128 forward
# 128x128, backward 80x128 non-causal / 64x128 causal; D=64 forward 192x128, backward 128x128).
MATRIX = {
    "longnet_128k": ["f128x176", "f128x160", "f128x192", "f128x144", "f128x128+rs0", "b64"],
    "longnet_128k_causal": ["f128x176", "f128x160", "b80"],
    "longnet_128k_d64": ["f192x160", "f192x192", "f128x128", "f128x192"],
    "longnet_128k_d64_causal": ["f192x160", "f128x128"],
    "longnet_gqa_128k": ["f128x176", "pack0", "b64"],
    "longnet_gqa_128k_causal": ["f128x160", "pack0"],
    "dense_32k": ["f128x176", "f128x160", "f128x192", "b64"],
    "dense_32k_causal": ["f128x176", "f128x160"],
    "varlen_mix_32k": ["f128x176", "f128x160", "b80"],
}


def parse(variant: str) -> tuple[str, dict, dict]:
    """(backend, forward overrides, backward overrides) of a variant name."""
    if variant in ("cudnn", "fa4"):
        return variant, {}, {}
    fwd, bwd = {}, {}
    for part in variant.split("+"):
        if part.startswith("f"):
            m, n = part[1:].split("x")
            fwd["tile_mn"] = (int(m), int(n))
        elif part == "rs0":
            fwd["mma_pv_is_rs"] = False
        elif part == "ol0":
            fwd["intra_wg_overlap"] = False
        elif part in ("pack0", "pack1"):
            fwd["pack_gqa"] = part == "pack1"
        elif part == "ctl":
            pass  # FA4's choice again, under another name: the spread between two identical variants
        elif part.startswith("b"):
            bwd["m_block_size"] = int(part[1:])
        else:
            raise ValueError(f"variant part {part!r}")
    return "fa4", fwd, bwd


class Overrides:
    """FA4's forward arguments and sm_90 backward tile for the variant in force."""

    def __init__(self):
        self.fwd, self.bwd = {}, {}
        iface = _fa4_api._interface()
        orig_fwd, orig_tile = iface._flash_attn_fwd, iface._tile_size_bwd_sm90

        def fwd(*a, **kw):
            kw.update(self.fwd)
            return orig_fwd(*a, **kw)

        def tile_bwd(*a, **kw):
            cfg = orig_tile(*a, **kw)
            if "m_block_size" in self.bwd:
                m = self.bwd["m_block_size"]
                cfg = dataclasses.replace(cfg, m_block_size=m, dQ_swapAB=m % 64 != 0)
            return cfg

        fwd.compile_cache = orig_fwd.compile_cache  # FA4 reaches its cache through the module's name
        iface._flash_attn_fwd, iface._tile_size_bwd_sm90 = fwd, tile_bwd


def config(name: str):
    if ":" not in name:
        return C.get(name)
    b, s, h, hkv, d, *causal = name.split(":")
    return C.Config(name, int(b), int(s), int(h), int(d), kv_heads=int(hkv), causal=causal == ["causal"])


def inputs(cfg):
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = C.DTYPES[cfg.dtype]
    shape = (cfg.batch, cfg.seqlen) if cfg.kind != "varlen" else (cfg.batch * cfg.seqlen,)
    mk = lambda h: torch.randn(*shape, h, cfg.head_dim, device="cuda", dtype=dt, generator=g)
    q, k, v = mk(cfg.heads).requires_grad_(), mk(cfg.hkv).requires_grad_(), mk(cfg.hkv).requires_grad_()
    extra = {}
    if cfg.kind == "varlen":
        lens, total, i = [], cfg.batch * cfg.seqlen, 0
        while sum(lens) < total:
            lens.append(min(cfg.doc_lengths[i % len(cfg.doc_lengths)], total - sum(lens)))
            i += 1
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        extra = dict(cu_seqlens=cu, max_seqlen=max(lens))
    return q, k, v, mk(cfg.heads), extra


def op(cfg, backend, q, k, v, extra):
    if cfg.kind == "dilated":
        return longattn.dilated_attention(q, k, v, segment_lengths=cfg.segment_lengths,
                                          dilation_rates=cfg.dilation_rates, causal=cfg.causal, backend=backend)
    if cfg.kind == "varlen":
        return longattn.attention_varlen(q, k, v, extra["cu_seqlens"], max_seqlen=extra["max_seqlen"],
                                         causal=cfg.causal, backend=backend)
    return longattn.attention(q, k, v, causal=cfg.causal, backend=backend)


def timings(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def run_variant(ov, cfg, variant, tensors):
    backend, ov.fwd, ov.bwd = parse(variant)
    q, k, v, do, extra = tensors

    def fwd():
        with torch.no_grad():
            return op(cfg, backend, q, k, v, extra)

    def fwd_bwd():
        out = op(cfg, backend, q, k, v, extra)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    return fwd, fwd_bwd


def rel_diff(a, b) -> float:
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-6)).item()
               for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", default=list(MATRIX))
    p.add_argument("--variants", nargs="+", help="instead of the built-in matrix, for every config")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precompile", type=int, default=0)
    p.add_argument("--worker", help="i/n: compile this share of the variants and exit")
    p.add_argument("--json")
    a = p.parse_args()
    plan = [(c, v) for c in a.configs for v in ["cudnn", "fa4", *(a.variants or MATRIX.get(c, []))]]
    ov = Overrides()
    if a.worker:
        i, n = map(int, a.worker.split("/"))
        for c, v in [x for j, x in enumerate(y for y in plan if y[1] != "cudnn") if j % n == i]:
            cfg = config(c)
            try:
                run_variant(ov, cfg, v, inputs(cfg))[1]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a tile FA4 cannot build is reported by the timing run
                print(f"worker {i}: {c} {v} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    if a.precompile:
        args = [sys.executable, __file__, "--configs", *a.configs] + (["--variants", *a.variants] if a.variants else [])
        procs = [subprocess.Popen(args + ["--worker", f"{i}/{a.precompile}"]) for i in range(a.precompile)]
        for pr in procs:
            pr.wait()
    rows = []
    for c in a.configs:
        cfg = config(c)
        tensors = inputs(cfg)
        variants = [v for cc, v in plan if cc == c]
        fns, ref, acc = {}, None, {v: ([], []) for v in variants}
        for v in variants:
            try:
                fns[v] = run_variant(ov, cfg, v, tensors)
                res = fns[v][1]()
                torch.cuda.synchronize()
                if v == "fa4":
                    ref = [x.detach().clone() for x in res]
                acc[v] = acc[v] + ([x.detach().clone() for x in res],)
            except Exception as e:  # noqa: BLE001 - reported in the row
                rows.append(dict(config=c, variant=v, status="failed", reason=f"{type(e).__name__}: {str(e)[:300]}"))
                fns.pop(v, None)
        names = list(fns)
        for rnd in range(a.rounds):
            for v in names[rnd % len(names):] + names[:rnd % len(names)]:
                fwd, fwd_bwd = run_variant(ov, cfg, v, tensors)  # its overrides in force
                fwd(), fwd_bwd()  # warm
                acc[v][0].append(timings(fwd, a.iters))
                acc[v][1].append(timings(fwd_bwd, a.iters))
        for v in fns:
            f, fb = statistics.median(acc[v][0]), statistics.median(acc[v][1])
            rows.append(dict(config=c, variant=v, status="ok", fwd_ms=f, fwd_bwd_ms=fb, bwd_ms=fb - f,
                             fwd_rounds=acc[v][0], fwd_bwd_rounds=acc[v][1],
                             rel_diff_vs_fa4=None if ref is None else rel_diff(acc[v][2], ref)))
        print(f"{c}: " + ", ".join(f"{r['variant']} {r['fwd_ms']:.3f}/{r['fwd_bwd_ms']:.3f}" for r in rows
                                  if r["config"] == c and r["status"] == "ok"), flush=True)
        del tensors, fns, ref, acc
        torch.cuda.empty_cache()
    dev = torch.device("cuda")
    out = {"kind": "fa4_tiles", "env": environment(dev, " ".join(["python", "benchmarks/fa4_tiles.py", *sys.argv[1:]])),
           "device": torch.cuda.get_device_name(), "fa4": _fa4_api.installed_version(), "results": rows}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    print("| config | variant | fwd ms | fwd+bwd ms | x fa4 fwd / fwd+bwd | rel diff |")
    print("|---|---|---|---|---|---|")
    base = {r["config"]: r for r in rows if r["variant"] == "fa4" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['config']} | {r['variant']} | {r['reason'][:80]} | | | |")
            continue
        b = base.get(r["config"])
        ratio = f"{b['fwd_ms'] / r['fwd_ms']:.3f} / {b['fwd_bwd_ms'] / r['fwd_bwd_ms']:.3f}" if b else "-"
        d = "-" if r["rel_diff_vs_fa4"] is None else f"{r['rel_diff_vs_fa4']:.1e}"
        print(f"| {r['config']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {ratio} | {d} |")


if __name__ == "__main__":
    main()
