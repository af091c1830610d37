"""What the long chains of a pattern cost FA4 on one GPU: a key tile seen by
every query tile (global tokens' keys) is one backward program per head over
every query tile, a query tile that sees every key tile (global rows) one
forward program per head over every key tile. FA4's backward grid runs its
key tiles head by head, so the last head's chain starts near the end of the
pass and outlasts it.

Per config: the whole call (FA4 with the pattern's block sparsity), the same
call with those tiles cleared (``bulk``: what the rest costs), the cleared
tiles alone as one call and on c views of their long side
(``fa4.SplitStep``), and both together (``carved``: bulk + tiles, the rows
or gradients put back, dQ summed) with the bf16 difference to the whole
call. Tiles count as heavy where they see more than 8x the median count.
Forward times per query tile rows, backward per key tile column; CUDA
events, median of 15 back-to-back calls after 3.

    python benchmarks/flex_chains.py --json OUT.json flex_swg_32k flex_bsparse_32k flex_swg_128k
"""
from __future__ import annotations

import argparse
import sys

import torch

from longattn.bench import measure
from longattn.bench.configs import CONFIGS
from longattn.bench.patterns import flex_mask
from longattn.flex import blocks, fa4, pieces


def _time(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    xs = sorted(a.elapsed_time(b) for a, b in ev)
    return xs[len(xs) // 2]


def _cleared(whole, table, s, scale):
    st = whole.step
    return fa4.RingStep(fa4.Step(table, st.block, st.form, st.aux, blocks.sparse_tensors(table), False), scale, s, s)


def run(name: str, dev, cs=(1, 4, 8, 16)) -> dict:
    cfg = CONFIGS[name]
    s, h, d = cfg.seqlen, cfg.heads, cfg.head_dim
    mask = flex_mask(cfg, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, s, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
    pos = torch.arange(s, dtype=torch.int32, device=dev)
    scale, cap = d ** -0.5, torch.cuda.get_device_capability(dev)[0]
    whole = pieces.executor(mask, pos, pos, 1, h, scale, cap)
    tab = whole.step.table
    vis = (tab.partial | tab.full).flatten(0, 1).any(0)
    cols, rows = vis.sum(0), vis.sum(1)
    nq, nk = vis.shape
    r = {"config": name, "query_tiles": nq, "key_tiles": nk, "col_max": int(cols.max()),
         "col_median": float(cols.float().median()), "row_max": int(rows.max()),
         "row_median": float(rows.float().median())}
    out, lse = whole.forward(q, k, v)
    r["whole_fwd_ms"] = _time(lambda: whole.forward(q, k, v))
    r["whole_bwd_ms"] = _time(lambda: whole.backward(do, q, k, v, out, lse, None))
    gw = whole.backward(do, q, k, v, out, lse, None)
    heavy_cols = (cols > 8 * cols.float().median()).nonzero().flatten()
    heavy_rows = (rows > 8 * rows.float().median()).nonzero().flatten()
    r["heavy_cols"], r["heavy_rows"] = heavy_cols.tolist()[:20], heavy_rows.tolist()[:20]
    diff = lambda a, b: float((a.float() - b.float()).abs().max())
    if len(heavy_cols):
        krows = pieces.rows_of(heavy_cols, 128, s)
        bulk = _cleared(whole, pieces._cleared(tab, [(torch.arange(nq, device=dev), int(c), int(c) + 1)
                                                     for c in heavy_cols.tolist()]), s, scale)
        kh, vh = k[:, krows].contiguous(), v[:, krows].contiguous()
        r["bulk_bwd_ms"] = _time(lambda: bulk.backward(do, q, k, v, out, lse, None))
        for c in cs:
            part = pieces.executor(mask, pos, pos[krows], 1, h, scale, cap,
                                   split=None if c == 1 else (lambda *_, c=c: (c, "rows")))

            def carved():
                ga = part.backward(do, q, kh, vh, out, lse, None)
                gb = bulk.backward(do, q, k, v, out, lse, None)
                gb[1][:, krows], gb[2][:, krows] = ga[1], ga[2]
                return gb[0] + ga[0], gb[1], gb[2]
            r[f"cols_bwd_c{c}_ms"] = _time(lambda: part.backward(do, q, kh, vh, out, lse, None))
            r[f"carved_bwd_c{c}_ms"] = _time(carved)
            r[f"carved_bwd_c{c}_maxdiff"] = [diff(a, b) for a, b in zip(carved(), gw)]
    if len(heavy_rows):
        qrows = pieces.rows_of(heavy_rows, 128, s)
        bulk = _cleared(whole, pieces._cleared(tab, [(heavy_rows, 0, nk)]), s, scale)
        qh = q[:, qrows].contiguous()
        r["bulk_fwd_ms"] = _time(lambda: bulk.forward(q, k, v))
        for c in cs:
            part = pieces.executor(mask, pos[qrows], pos, 1, h, scale, cap,
                                   split=None if c == 1 else (lambda *_, c=c: (c, "keys")))

            def carved():
                o, l_ = bulk.forward(q, k, v)
                o[:, qrows], l_[:, :, qrows] = part.forward(qh, k, v)
                return o, l_
            r[f"rows_fwd_c{c}_ms"] = _time(lambda: part.forward(qh, k, v))
            r[f"carved_fwd_c{c}_ms"] = _time(carved)
            o2, l2 = carved()
            r[f"carved_fwd_c{c}_maxdiff"] = [diff(o2, out), diff(l2, lse)]
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+")
    p.add_argument("--json")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for name in a.configs:
        rows.append(run(name, dev))
        print(" ".join(f"{k}={round(x, 3) if isinstance(x, float) else x}" for k, x in rows[-1].items()), flush=True)
    if a.json:
        measure.write_json(a.json, {"kind": "flex_chains", "results": rows, "env": measure.environment(
            dev, " ".join(["python", "benchmarks/flex_chains.py", *sys.argv[1:]]))})


if __name__ == "__main__":
    main()
