"""Rows against a few keys every row sees (a shard's rows against the global
tokens' keys: the exchange's halo piece of window + global at 2 ranks), merged
into the own piece's (out, lse) and its dQ: the exchange's way (FA4 on the
rows, its backward on views of c row chunks, the keys repeated; an lse merge,
a dQ add, dK/dV summed) against fused Triton passes (one forward that merges
into out and lse in place; a backward whose row programs add their dQ into the
own piece's and whose key programs sum dK/dV over row splits).

Checks both against float64 first (outputs, lse, dQ, dK, dV), then times them
alternating: CUDA events, medians, ms per forward / backward.

    python benchmarks/few_keys_ab.py --rows 65536 --keys 128 --rounds 3 --json OUT.json
    TRITON_INTERPRET=1 python benchmarks/few_keys_ab.py --check-only --rows 96 --keys 24 --heads 2 --dim 16
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
import triton
import triton.language as tl

from longattn.kernels.attention_jit import _lse_merge

LN2 = math.log(2.0)


@triton.jit
def _rows_of(X, idx, n, stride, head_off, D: tl.constexpr):
    """Rows ``idx`` of one head of X (row stride ``stride``, the head at ``head_off``): (len(idx), D), zeros at
    and past row ``n``."""
    d = tl.arange(0, D)
    return tl.load(X + idx.to(tl.int64)[:, None] * stride + head_off + d[None, :], mask=(idx < n)[:, None], other=0.0)


@triton.jit
def _row_program(N, GROUP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr):
    """A row program's head, kv head, rows [BM] (block program_id(0)), their mask and int64 offsets, and the
    head-dim offsets."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    return h, h // GROUP, rows, rows < N, rows.to(tl.int64), tl.arange(0, D)


@triton.jit
def _fwd_merge(Q, K, V, O, L, scale_log2, N, G, sqn, sqh, skn, skh, son, soh, slh, sln, GROUP: tl.constexpr,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Rows [BM] of head h against every key; merged into (O, L) in place by lse."""
    h, kvh, rows, rm, r64, d = _row_program(N, GROUP, BM, D)
    q = _rows_of(Q, rows, N, sqn, h * sqh, D)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, G, BN):
        cols = start + tl.arange(0, BN)
        cm = cols < G
        k, v = _rows_of(K, cols, G, skn, kvh * skh, D), _rows_of(V, cols, G, skn, kvh * skh, D)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(cm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o_new = acc / l_i[:, None]
    l_new = (m_i + tl.log2(l_i)) * 0.6931471805599453
    o_ptr = O + r64[:, None] * son + h * soh + d[None, :]
    l_ptr = L + h * slh + r64 * sln
    res, lse = _lse_merge(tl.load(o_ptr, mask=rm[:, None], other=0.0), tl.load(l_ptr, mask=rm, other=float("-inf")),
                          o_new, l_new)
    tl.store(o_ptr, res.to(O.dtype.element_ty), mask=rm[:, None])
    tl.store(l_ptr, lse, mask=rm)


@triton.jit
def _bwd_rows(Q, K, V, O, DO, L, DQ, DELTA, PS, scale, scale_log2, N, G, sqn, sqh, skn, skh, slh, sln,
              GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STORE_PS: tl.constexpr):
    """dQ of rows [BM] of head h from the merged O and lse, added into DQ; their
    delta = rowsum(dO * O) kept for the key programs, or (STORE_PS) P and dS
    written to PS (2, H, N, G) for dK, dV as two batched GEMMs."""
    h, kvh, rows, rm, r64, d = _row_program(N, GROUP, BM, D)
    at = r64[:, None] * sqn + h * sqh + d[None, :]
    q, do = _rows_of(Q, rows, N, sqn, h * sqh, D), _rows_of(DO, rows, N, sqn, h * sqh, D)
    delta = tl.sum(do.to(tl.float32) * _rows_of(O, rows, N, sqn, h * sqh, D).to(tl.float32), 1)
    lse2 = tl.load(L + h * slh + r64 * sln, mask=rm, other=float("inf")) * 1.4426950408889634
    dq = tl.zeros([BM, D], tl.float32)
    for start in range(0, G, BN):
        cols = start + tl.arange(0, BN)
        cm = cols < G
        k, v = _rows_of(K, cols, G, skn, kvh * skh, D), _rows_of(V, cols, G, skn, kvh * skh, D)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse2[:, None])
        p = tl.where(cm[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
        if STORE_PS:
            at_ps = (h * N + r64[:, None]) * G + cols[None, :]
            keep = rm[:, None] & cm[None, :]
            tl.store(PS + at_ps, p.to(PS.dtype.element_ty), mask=keep)
            tl.store(PS + (tl.num_programs(1) * N).to(tl.int64) * G + at_ps, ds.to(PS.dtype.element_ty), mask=keep)
    old = tl.load(DQ + at, mask=rm[:, None], other=0.0).to(tl.float32)
    tl.store(DQ + at, (old + dq * scale).to(DQ.dtype.element_ty), mask=rm[:, None])
    tl.store(DELTA + h * N + r64, delta, mask=rm)


@triton.jit
def _bwd_keys(Q, K, V, DO, L, DELTA, DKP, DVP, scale, scale_log2, N, G, RPS, sqn, sqh, skn, skh, slh, sln,
              GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """dK, dV of keys [BN] from query head h over the rows of split s (RPS rows a split), float32 partials
    DKP/DVP (splits, H, G, D)."""
    pn, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // GROUP
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < G
    d = tl.arange(0, D)
    k, v = _rows_of(K, cols, G, skn, kvh * skh, D), _rows_of(V, cols, G, skn, kvh * skh, D)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    r0 = sp * RPS
    for start in range(r0, tl.minimum(r0 + RPS, N), BM):
        rows = start + tl.arange(0, BM)
        end = tl.minimum(r0 + RPS, N)
        rm = rows < end
        r64 = rows.to(tl.int64)
        q, do = _rows_of(Q, rows, end, sqn, h * sqh, D), _rows_of(DO, rows, end, sqn, h * sqh, D)
        lse2 = tl.load(L + h * slh + r64 * sln, mask=rm, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + h * N + r64, mask=rm, other=0.0)
        pt = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse2[None, :])  # (BN, BM)
        pt = tl.where(cm[:, None] & rm[None, :], pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q)
    base = (sp * tl.num_programs(1) + h).to(tl.int64) * G * D
    at = base + cols[:, None].to(tl.int64) * D + d[None, :]
    tl.store(DKP + at, dk * scale, mask=cm[:, None])
    tl.store(DVP + at, dv, mask=cm[:, None])


def fused_forward(q, k, v, out, lse, scale, bm=64, bn=64):
    """q (N, H, D), k/v (G, Hkv, D), out (N, H, D), lse (H, N): (out, lse) <- merge with q against k, v."""
    n, h, d = q.shape
    g, hkv = k.shape[0], k.shape[1]
    _fwd_merge[(triton.cdiv(n, bm), h)](q, k, v, out, lse, scale / LN2, n, g, q.stride(0), q.stride(1), k.stride(0),
                                        k.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                                        GROUP=h // hkv, D=d, BM=bm, BN=bn, num_warps=4)


def _bmm32(a, b):
    """a @ b batched, float32 out (cuBLAS accumulates bf16 inputs in float32)."""
    return torch.bmm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.bmm(a.float(), b.float())


def fused_backward(dout, q, k, v, out, lse, dq, scale, splits=16, bm=64, bn=64, marks=None):
    """dq += the rows' dQ against k, v (from the merged out and lse); returns (dk, dv) float32 (G, Hkv, D).
    splits 0: dK, dV as batched GEMMs over P and dS stored by the row programs. marks: a list that gets a CUDA
    event after each launch (the breakdown)."""
    n, h, d = q.shape
    g, hkv = k.shape[0], k.shape[1]
    mark = (lambda: marks.append(torch.cuda.Event(enable_timing=True)) or marks[-1].record()) if marks is not None \
        else (lambda: None)
    grp = lambda x: x.view(hkv, h // hkv, g, d).sum(1).transpose(0, 1)
    delta = torch.empty(h, n, dtype=torch.float32, device=q.device)
    ps = torch.empty(2, h, n, g, dtype=q.dtype, device=q.device) if splits == 0 else delta
    args = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), lse.stride(1))
    _bwd_rows[(triton.cdiv(n, bm), h)](q, k, v, out, dout, lse, dq, delta, ps, scale, scale / LN2, n, g, *args,
                                       GROUP=h // hkv, D=d, BM=bm, BN=bn, STORE_PS=splits == 0, num_warps=4)
    mark()
    if splits == 0:
        dv = _bmm32(ps[0].transpose(1, 2), dout.transpose(0, 1))
        mark()
        dk = _bmm32(ps[1].transpose(1, 2), q.transpose(0, 1)).mul_(scale)
        mark()
        return grp(dk), grp(dv)
    rps = triton.cdiv(triton.cdiv(n, splits), bm) * bm
    splits = triton.cdiv(n, rps)
    dkp = torch.empty(splits, h, g, d, dtype=torch.float32, device=q.device)
    dvp = torch.empty_like(dkp)
    _bwd_keys[(triton.cdiv(g, bn), h, splits)](q, k, v, dout, lse, delta, dkp, dvp, scale, scale / LN2, n, g, rps,
                                              *args, GROUP=h // hkv, D=d, BM=bm, BN=bn, num_warps=8)
    mark()
    return grp(dkp.sum(0)), grp(dvp.sum(0))


def exchange_way(q, k, v, out, lse, dout, dq, scale, chunks):
    """The exchange's calls on FA4 (the dense backend): forward one call and an lse merge; backward on c row
    chunks as batch rows with the keys repeated, dQ added, dK/dV summed in float32."""
    from longattn import backends as bk
    from longattn import _merge

    fa4 = bk.BACKENDS["fa4"]
    spec = bk.BlockSpec(scale)
    n, h, d = q.shape

    def fwd():
        o2, l2 = fa4.forward(q[None], k[None], v[None], spec)
        _merge.merge_into(out[None], lse.t()[None], o2, l2.transpose(1, 2), use_triton=True)

    def bwd():
        c = chunks
        rows = lambda x: x.view(c, n // c, *x.shape[1:])
        rep = lambda x: torch.cat([x[None]] * c)
        lr = lse.view(h, c, n // c).transpose(0, 1).contiguous()
        g = fa4.backward(rows(dout), rows(q), rep(k), rep(v), rows(out), lr, spec)
        dq.add_(g[0].view(dq.shape))
        return g[1].sum(0, dtype=torch.float32), g[2].sum(0, dtype=torch.float32)
    return fwd, bwd


def reference(q, k, v, out0, lse0, dout, scale):
    """float64: (out, lse) of the own piece (out0, lse0) merged with q against k, v, and the gradients of
    that piece's part (dq, dk, dv) from the merged out and lse."""
    qd, kd, vd = (x.double() for x in (q, k, v))
    h, hkv = q.shape[1], k.shape[1]
    kd, vd = (x.repeat_interleave(h // hkv, 1) for x in (kd, vd))
    s = torch.einsum("nhd,ghd->hng", qd, kd) * scale
    lse_g = torch.logsumexp(s, -1)
    o_g = torch.einsum("hng,ghd->nhd", torch.softmax(s, -1), vd)
    lse = torch.logaddexp(lse0.double(), lse_g)
    out = out0.double() * (lse0.double() - lse).exp().t()[..., None] + o_g * (lse_g - lse).exp().t()[..., None]
    p = (s - lse[..., None]).exp()
    dod = dout.double()
    dp = torch.einsum("nhd,ghd->hng", dod, vd)
    delta = (dod * out).sum(-1).t()
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hng,ghd->nhd", ds, kd) * scale
    dk = torch.einsum("hng,nhd->ghd", ds, qd) * scale
    dv = torch.einsum("hng,nhd->ghd", p, dod)
    fold = lambda x: x.view(x.shape[0], hkv, h // hkv, -1).sum(2)
    return out, lse, dq, fold(dk), fold(dv)


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(dev, n, g, h, hkv, d, dtype):
    gen = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dtype)
    q, k, v, out0, dout = mk(n, h, d), mk(g, hkv, d), mk(g, hkv, d), mk(n, h, d), mk(n, h, d)
    lse0 = torch.randn(h, n, device=dev, generator=gen) + 3
    lse0[:, :3] = float("-inf")  # rows the own piece left empty (its out is 0 there)
    out0[:3] = 0
    scale = d ** -0.5
    want = reference(q, k, v, out0, lse0, dout, scale)
    out, lse, dq = out0.clone(), lse0.clone(), torch.zeros_like(q)
    fused_forward(q, k, v, out, lse, scale)
    dk, dv = fused_backward(dout, q, k, v, out, lse, dq, scale)
    errs = {name: _rel(x, w) for name, x, w in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want)}
    dq2 = torch.zeros_like(q)
    dk2, dv2 = fused_backward(dout, q, k, v, out, lse, dq2, scale, splits=0)  # P and dS through GEMMs
    errs.update({name + " (GEMMs)": _rel(x, w) for name, x, w in zip(("dq", "dk", "dv"), (dq2, dk2, dv2), want[2:])})
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
    p.add_argument("--chunks", type=int, default=8, help="the exchange's row views (SplitStep's c)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiles", nargs="+", default=["64x64x16"],
                   help="fused variants as BMxBNxSPLITS (row tile, key tile, the key programs' row splits)")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    hkv = a.kv_heads or a.heads
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    errs = check(dev, min(a.rows, 4096), a.keys, a.heads, hkv, a.dim, dtype)
    print("fused against float64:", {k: f"{e:.1e}" for k, e in errs.items()}, flush=True)
    if a.check_only:
        return
    from longattn.bench.measure import environment
    from host_bound import _events  # the benchmarks' one event timer (this directory is on sys.path when run)

    gen = torch.Generator(device=dev).manual_seed(1)
    mk = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dtype)
    n, scale = a.rows, a.dim ** -0.5
    q, k, v, out0, dout = mk(n, a.heads, a.dim), mk(a.keys, hkv, a.dim), mk(a.keys, hkv, a.dim), \
        mk(n, a.heads, a.dim), mk(n, a.heads, a.dim)
    lse0 = torch.randn(a.heads, n, device=dev, generator=gen) + 3
    out, lse, dq = out0.clone(), lse0.clone(), torch.zeros_like(q)
    ex_fwd, ex_bwd = exchange_way(q, k, v, out, lse, dout, dq, scale, a.chunks)
    variants = {"exchange (FA4)": (ex_fwd, ex_bwd)}
    for t in a.tiles:
        bm, bn, sp = (int(x) for x in t.split("x"))
        variants[f"fused {t}"] = (lambda bm=bm, bn=bn: fused_forward(q, k, v, out, lse, scale, bm, bn),
                                  lambda bm=bm, bn=bn, sp=sp: fused_backward(dout, q, k, v, out, lse, dq, scale, sp,
                                                                             bm, bn))
    rows = []
    for name in list(variants):  # compile, record; a tile choice the GPU cannot run is reported and dropped
        try:
            for _ in range(2):
                variants[name][0]()
                variants[name][1]()
        except Exception as e:  # noqa: BLE001 - Triton's out-of-resources and compile errors alike
            print(f"{name}: dropped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            del variants[name]
    for r in range(a.rounds):
        for name, (f, b) in variants.items():
            row = dict(variant=name, round=r, fwd_ms=_events(f, a.iters)["gpu_ms"],
                       bwd_ms=_events(b, a.iters)["gpu_ms"])
            rows.append(row)
            print(f"{name:18s} r{r} fwd {row['fwd_ms']:.3f} bwd {row['bwd_ms']:.3f} ms", flush=True)
    parts = {}
    for name, (f, b) in variants.items():  # each launch's share: events after every launch, medians
        if not name.startswith("fused"):
            continue
        bm, bn, sp = (int(x) for x in name.split()[1].split("x"))
        ts = []
        for _ in range(a.iters):
            marks = [torch.cuda.Event(enable_timing=True)]
            marks[0].record()
            f()
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
            fused_backward(dout, q, k, v, out, lse, dq, scale, sp, bm, bn, marks=marks)
            torch.cuda.synchronize()
            ts.append([x.elapsed_time(y) for x, y in zip(marks, marks[1:])])
        labels = ["forward", "rows"] + (["dV GEMM", "dK GEMM"] if sp == 0 else ["keys"])
        parts[name] = {lab: statistics.median(t[i] for t in ts) for i, lab in enumerate(labels)}
        print(f"{name:18s} " + " ".join(f"{lab} {ms:.3f}" for lab, ms in parts[name].items()), flush=True)
    command = "python benchmarks/few_keys_ab.py " + " ".join(sys.argv[1:])
    if a.json:
        json.dump({"env": dict(environment(dev), command=command), "check": errs, "rows": rows, "launches": parts,
                   "shape": dict(rows=n, keys=a.keys, heads=a.heads, kv_heads=hkv, dim=a.dim, chunks=a.chunks)},
                  open(a.json, "w"), indent=1)
    for name in variants:
        rs = [x for x in rows if x["variant"] == name]
        print(f"{name:18s} fwd {min(x['fwd_ms'] for x in rs):.3f}-{max(x['fwd_ms'] for x in rs):.3f} "
              f"bwd {min(x['bwd_ms'] for x in rs):.3f}-{max(x['bwd_ms'] for x in rs):.3f} ms")


if __name__ == "__main__":
    main()
