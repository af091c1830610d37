"""Rows against a few keys every row sees (a shard's rows against the global
tokens' keys, the exchange's few-keys piece), merged into the own piece's
(out, lse) and its dQ: FA4 the way an FA4 halo piece runs them (one forward
call and an lse merge; the backward on views of c row chunks with the keys
repeated, the dQ added, dK/dV summed in float32) against
:mod:`longattn.kernels.few_keys` (a forward that merges into out and lse in
place; a backward whose row programs add their dQ into the own piece's, dK/dV
as two GEMMs over the stored P and dS).

Checks the kernels against float64 first (outputs, lse, dQ, dK, dV), then
times both alternating: CUDA events, medians, ms per forward / backward.

    python benchmarks/few_keys_ab.py --rows 65536 --keys 128 --rounds 3 --json OUT.json
    TRITON_INTERPRET=1 python benchmarks/few_keys_ab.py --check-only --rows 96 --keys 24 --heads 2 --dim 16
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from longattn.kernels import few_keys


def fa4_way(q, k, v, out, lse, dout, dq, scale, chunks):
    """(forward, backward) closures of FA4 (the dense backend) on the rows: forward one call and an lse merge;
    backward on c row chunks as batch rows with the keys repeated, dQ added, dK/dV summed in float32."""
    from longattn import _merge
    from longattn import backends as bk

    fa4 = bk.BACKENDS["fa4"]
    spec = bk.BlockSpec(scale)
    _, n, h, d = q.shape

    def fwd():
        o2, l2 = fa4.forward(q, k, v, spec)
        _merge.merge_into(out, lse.transpose(1, 2), o2, l2.transpose(1, 2), use_triton=True)

    def bwd():
        c = chunks
        rows = lambda x: x.view(c, n // c, *x.shape[2:])
        rep = lambda x: torch.cat([x] * c)
        lr = lse[0].view(h, c, n // c).transpose(0, 1).contiguous()
        g = fa4.backward(rows(dout), rows(q), rep(k), rep(v), rows(out), lr, spec)
        dq.add_(g[0].view(dq.shape))
        return g[1].sum(0, dtype=torch.float32), g[2].sum(0, dtype=torch.float32)
    return fwd, bwd


def reference(q, k, v, out0, lse0, dout, scale):
    """float64: (out, lse) of the own piece (out0, lse0) merged with q against k, v, and that piece's dq, dk, dv
    from the merged out and lse."""
    qd, kd, vd = (x.double() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kd, vd = (x.repeat_interleave(g, 2) for x in (kd, vd))
    s = torch.einsum("bnhd,bghd->bhng", qd, kd) * scale
    lse_g = torch.logsumexp(s, -1)
    o_g = torch.einsum("bhng,bghd->bnhd", torch.softmax(s, -1), vd)
    lse = torch.logaddexp(lse0.double(), lse_g)
    w = lambda a: torch.exp(a - lse).transpose(1, 2)[..., None]
    out = out0.double() * w(lse0.double()) + o_g * w(lse_g)
    p = (s - lse[..., None]).exp()
    dod = dout.double()
    ds = p * (torch.einsum("bnhd,bghd->bhng", dod, vd) - (dod * out).sum(-1).transpose(1, 2)[..., None])
    fold = lambda x: x.view(*x.shape[:2], k.shape[2], g, -1).sum(3)
    return (out, lse, torch.einsum("bhng,bghd->bnhd", ds, kd) * scale,
            fold(torch.einsum("bhng,bnhd->bghd", ds, qd) * scale), fold(torch.einsum("bhng,bnhd->bghd", p, dod)))


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(dev, n, g, h, hkv, d, dtype):
    gen = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dtype)
    q, k, v, out0, dout = mk(1, n, h, d), mk(1, g, hkv, d), mk(1, g, hkv, d), mk(1, n, h, d), mk(1, n, h, d)
    lse0 = torch.randn(1, h, n, device=dev, generator=gen) + 3
    lse0[:, :, :3] = float("-inf")  # rows the own piece left empty (its out is 0 there)
    out0[:, :3] = 0
    scale = d ** -0.5
    want = reference(q, k, v, out0, lse0, dout, scale)
    out, lse, dq = out0.clone(), lse0.clone(), torch.zeros_like(q)
    few_keys.forward_into(q, k, v, out, lse, scale)
    dk, dv = few_keys.backward_into(dout, q, k, v, out, lse, None, dq, scale)
    errs = {name: _rel(x, w) for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want)}
    # the backward read the rounded merged out; the reference's is exact: bf16 bounds the rest
    bar = 1e-4 if dtype == torch.float32 else 2e-2
    assert all(e < bar for e in errs.values()), errs
    return errs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--keys", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--chunks", type=int, default=8, help="FA4's row views (an FA4 halo piece's SplitStep c)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    hkv = a.kv_heads or a.heads
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    errs = check(dev, min(a.rows, 4096), a.keys, a.heads, hkv, a.dim, dtype)
    print("few_keys against float64:", {k: f"{e:.1e}" for k, e in errs.items()}, flush=True)
    if a.check_only:
        return
    from longattn.bench.measure import environment
    from host_bound import _events  # the benchmarks' one event timer (this directory is on sys.path when run)

    gen = torch.Generator(device=dev).manual_seed(1)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dtype)
    n, scale = a.rows, a.dim ** -0.5
    q, k, v, out0, dout = (mk(1, n, a.heads, a.dim), mk(1, a.keys, hkv, a.dim), mk(1, a.keys, hkv, a.dim),
                           mk(1, n, a.heads, a.dim), mk(1, n, a.heads, a.dim))
    lse0 = torch.randn(1, a.heads, n, device=dev, generator=gen) + 3
    out, lse, dq = out0.clone(), lse0.clone(), torch.zeros_like(q)
    variants = {"FA4": fa4_way(q, k, v, out, lse, dout, dq, scale, a.chunks),
                "few_keys": (lambda: few_keys.forward_into(q, k, v, out, lse, scale),
                             lambda: few_keys.backward_into(dout, q, k, v, out, lse, None, dq, scale))}
    for f, b in variants.values():  # compile, record
        for _ in range(2):
            f()
            b()
    rows = []
    for r in range(a.rounds):
        for name, (f, b) in variants.items():
            row = dict(variant=name, round=r, fwd_ms=_events(f, a.iters)["gpu_ms"],
                       bwd_ms=_events(b, a.iters)["gpu_ms"])
            rows.append(row)
            print(f"{name:9s} r{r} fwd {row['fwd_ms']:.3f} bwd {row['bwd_ms']:.3f} ms", flush=True)
    command = "python benchmarks/few_keys_ab.py " + " ".join(sys.argv[1:])
    if a.json:
        json.dump({"env": dict(environment(dev), command=command), "check": errs, "rows": rows,
                   "shape": dict(rows=n, keys=a.keys, heads=a.heads, kv_heads=hkv, dim=a.dim, chunks=a.chunks)},
                  open(a.json, "w"), indent=1)
    for name in variants:
        rs = [x for x in rows if x["variant"] == name]
        print(f"{name:9s} fwd {min(x['fwd_ms'] for x in rs):.3f}-{max(x['fwd_ms'] for x in rs):.3f} "
              f"bwd {min(x['bwd_ms'] for x in rs):.3f}-{max(x['bwd_ms'] for x in rs):.3f} ms")


if __name__ == "__main__":
    main()
