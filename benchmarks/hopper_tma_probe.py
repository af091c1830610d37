"""Does a Hopper-style Triton forward (tensor descriptors, pipelined key loop,
optional warp specialisation) run 2048-row squares at cuDNN's rate?

    python benchmarks/hopper_tma_probe.py [--head-dims 128 64] [--block-m 128 256] [--stages 2 3 4] ...

The targets of causal dilated attention need a kernel faster than cuDNN on
the squares every LongNet branch is made of (docs/performance.md 3.3: cuDNN
reaches 1.07 / 0.73 x dense causal, our pointer-arithmetic Triton kernel
0.70 / 0.50). Before building the one-launch-per-pass kernel on a new inner
loop, this measures the inner loop alone: a forward over one dilated branch
(segment w, rate r; r = 1 is plain stacked squares) whose rows are read
through tensor descriptors. A branch's class c of rate r is a 2-D view of the
(B, S, H, D) tensor with rows (b*S + seg*w)/r + i and columns (c*H + h)*D +
[0, D): one descriptor per tensor serves every (segment, class, head).

Rows compared, bf16, same process, CUDA-event medians (triton.testing.do_bench):
cuDNN and our current Triton kernel on the same squares held contiguous, and
the descriptor kernel over a grid of tiles, stages and warp specialisation,
on contiguous squares (r = 1) and on one strided LongNet branch at 128K
(w = 32768, r = 16: 2048-row classes; useful TF/s count the S/r rows per head a
rate-r branch selects). Every descriptor row is checked
against cuDNN's output and lse. Writes $OUT/hopper_tma_probe.json; a table last.

tests/test_bench.py runs the kernel under TRITON_INTERPRET=1 on CPU against
the tests' float64 reference.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, l_i, m_i, q, k, v, offs_m, start_n, offs_n, qk_scale, MASKED: tl.constexpr):
    qk = tl.dot(q, k.T) * qk_scale
    if MASKED:
        qk = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _tma_fwd(desc_q, desc_k, desc_v, desc_o, LSE, H, S, W, R, M, qk_scale,
             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
             STAGES: tl.constexpr, WS: tl.constexpr):
    """Program (query block, batch*head, segment) of one branch (W, R): rows
    i of class c = h % R of segment seg are row (b*S + seg*W)/R + i of the
    descriptors, column (c*H + h)*D. M = W // R rows per class."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first: a short tail wave
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    seg = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    c = h % R
    row0 = (b * S + seg * W) // R
    col = (c * H + h) * D
    i0 = pid_m * BLOCK_M
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([row0 + i0, col])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = M
    if CAUSAL:
        hi = i0  # unmasked blocks; the diagonal block(s) below
    for start_n in tl.range(0, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, col])
        v = desc_v.load([row0 + start_n, col])
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, k, v, offs_m, start_n, offs_n, qk_scale, False)
    if CAUSAL:
        for start_n in tl.range(i0, i0 + BLOCK_M, BLOCK_N):
            k = desc_k.load([row0 + start_n, col])
            v = desc_v.load([row0 + start_n, col])
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, k, v, offs_m, start_n, offs_n, qk_scale, True)
    desc_o.store([row0 + i0, col], (acc / l_i[:, None]).to(desc_o.dtype))
    lse = (m_i + tl.math.log2(l_i)) / 1.4426950408889634
    pos = seg * W + c + offs_m.to(tl.int64) * R
    tl.store(LSE + pid_bh.to(tl.int64) * S + pos, lse)


def tma_forward(q, k, v, w, r, causal, cfg):
    """One branch (w, r) of dilated attention, q/k/v (B, S, H, D) contiguous;
    returns out (rows outside the branch untouched: zeros) and lse (B, H, S)."""
    b, s, h, d = q.shape
    assert s % w == 0 and w % r == 0 and (w // r) % cfg["BLOCK_M"] == 0
    out = torch.zeros_like(q)
    lse = torch.full((b, h, s), float("-inf"), device=q.device, dtype=torch.float32)
    rows, cols = b * s // r, r * h * d
    desc = lambda x, blk: TensorDescriptor(x, [rows, cols], [cols, 1], [blk, d])
    dq, do_ = desc(q, cfg["BLOCK_M"]), desc(out, cfg["BLOCK_M"])
    dk, dv = desc(k, cfg["BLOCK_N"]), desc(v, cfg["BLOCK_N"])
    m = w // r
    grid = (m // cfg["BLOCK_M"], b * h, s // w)
    _tma_fwd[grid](dq, dk, dv, do_, lse, h, s, w, r, m, d ** -0.5 * LOG2E, D=d, BLOCK_M=cfg["BLOCK_M"],
                   BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, STAGES=cfg["num_stages"], WS=cfg["ws"],
                   num_warps=cfg["num_warps"])
    return out, lse


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-m", type=int, nargs="+", default=[128])
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--ws", type=int, nargs="+", default=[0, 1], help="warp specialisation off (0) / on (1)")
    ap.add_argument("--rates", type=int, nargs="+", default=[1, 16], help="1: squares; 16: w = 32768 at 128K")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    args = ap.parse_args()

    import longattn
    from longattn.bench.measure import environment

    dev = torch.device("cuda")
    bench = lambda f: triton.testing.do_bench(f, warmup=5, rep=80, return_mode="median")
    H, S = 16, 131072
    tiles = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=st, ws=bool(ws))
             for bm, bn, nw, st, ws in itertools.product(args.block_m, args.block_n, args.warps, args.stages, args.ws)]
    rows = []
    cmd = "python benchmarks/hopper_tma_probe.py " + " ".join(sys.argv[1:])
    path = os.path.join(os.environ.get("OUT", "."), "hopper_tma_probe.json")

    def save():  # after every row: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump({"env": environment(dev, cmd), "rows": rows}, f, indent=1)

    for d, causal in itertools.product(args.head_dims, (True, False)):
        # every row of every head sees 2048 keys; a rate-r branch selects S / r rows per head
        flops = lambda r: 4 * S // r * H * 2048 * d * (0.5 if causal else 1.0)
        sq = [torch.randn(S // 2048, 2048, H, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        full = [x.reshape(1, S, H, d).contiguous() for x in sq]
        # the strided branch: w = 32768, r = 16, 2048 rows per class; its dense equivalent from the squares
        for name, fn in (("cudnn squares", lambda: longattn.attention(*sq, causal=causal, backend="cudnn")),
                         ("triton squares (current)", lambda: longattn.attention(*sq, causal=causal,
                                                                                 backend="triton"))):
            t = bench(fn)
            rows.append(dict(d=d, causal=causal, kernel=name, r=1, ms=t, tflops=flops(1) / t / 1e9))
        ref_o, ref_l = longattn.attention(*sq, causal=causal, backend="cudnn", return_lse=True)
        for cfg, r in itertools.product(tiles, args.rates):
            w = 2048 * r
            x = sq if r == 1 else full
            row = dict(d=d, causal=causal, kernel="descriptors", r=r, w=w, **cfg)
            try:
                o, l = tma_forward(*x, w, r, causal, cfg)
                if r == 1:
                    row["max_err_vs_cudnn"] = (o.float() - ref_o.float()).abs().max().item()
                    row["max_lse_err_vs_cudnn"] = (l - ref_l).abs().max().item()
                t = bench(lambda: tma_forward(*x, w, r, causal, cfg))
                row.update(ms=t, tflops=flops(r) / t / 1e9)
            except Exception as e:  # a tile the compiler refuses: recorded
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            save()
            print(json.dumps(row), flush=True)
        del sq, full
        torch.cuda.empty_cache()
    save()
    print("| D | causal | kernel | r | tile (M, N, warps, stages, ws) | ms | TF/s | x cuDNN squares |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(x["tflops"] for x in rows if x["d"] == r["d"] and x["causal"] == r["causal"]
                    and x["kernel"] == "cudnn squares")
        tile = (f"{r['BLOCK_M']}, {r['BLOCK_N']}, {r['num_warps']}, {r['num_stages']}, {r['ws']}"
                if "BLOCK_M" in r else "-")
        if "error" in r:
            print(f"| {r['d']} | {r['causal']} | {r['kernel']} | {r['r']} | {tile} | {r['error'][:60]} |")
        else:
            print(f"| {r['d']} | {r['causal']} | {r['kernel']} | {r['r']} | {tile} | {r['ms']:.3f} | "
                  f"{r['tflops']:.0f} | {r['tflops'] / base:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
