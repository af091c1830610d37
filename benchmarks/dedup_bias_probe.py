"""Can cuDNN compute every pair of LongNet's union once, its multiplicities as a score bias?

    python benchmarks/dedup_bias_probe.py

The ``dedup`` schedule (docs/performance.md 3.5) skips branch i's pairs
inside the previous branch's segment (the two diagonal halves of each
2048-row square for i >= 1) and counts each remaining pair min(levels(q),
levels(k)) times. A multiplicity a is the score bias ln(a), which cuDNN's
SDPA takes as ``attn_bias``; the merge by lse and the backward from the merged
lse are then unchanged. So the views path could run: branch 0's squares whole
with a bias, each later branch's off-diagonal 1024-row blocks with a bias
(causal: the lower-left block alone, non-causal: both), 76% of the pairs.

This times, on one GPU in bf16, cuDNN on the parts of one LongNet pass at
128K tokens (H=16): 64 x 16 stacked 2048-row squares with and without a
(1, H, 2048, 2048) bias broadcast over the squares, and the off-diagonal
1024 x 1024 blocks with a (1, H, 1024, 1024) bias; it checks the biased
calls against a float32 weighted softmax. Predicted pass time from the
parts: plain = squares x (1 + 15/16) (branch i has 1/2**i of branch 0's
squares), dedup = biased squares + 15/16 x biased blocks.
Writes $OUT/dedup_bias_probe.json; a table last. ``--profile``: instead,
the kernels one biased and one plain call launch (torch.profiler), to see
where the bias's time goes (a copy of the broadcast bias, or cuDNN itself).
"""
import json
import math
import os
import sys

import torch
import triton

from longattn.bench.measure import environment, write_json

dev = torch.device("cuda")
bench = lambda f: triton.testing.do_bench(f, warmup=3, rep=60, return_mode="median")
H, M, NSQ = 16, 2048, 64
LATER = {0: (2, 4, 8, 16), 1: (4, 8, 16)}  # the later rates of branch 0 (rate 1) and branch 1 (rate 2)


def levels(pos: torch.Tensor, h: int, rates) -> torch.Tensor:
    return 1 + sum(((pos - h) % r == 0).long() for r in rates)


def bias(branch: int, q_half: int, k_half: int, n: int, dtype) -> torch.Tensor:
    """(1, H, n, n) ln(multiplicity): branch 0 whole (n = M), or branch 1's block of
    class halves (q_half, k_half) (n = M / 2), rows at positions c + r * t."""
    r = 1 if branch == 0 else 2
    out = torch.empty(1, H, n, n, device=dev, dtype=torch.float32)
    t = torch.arange(n, device=dev)
    for h in range(H):
        c = h % r
        lq = levels(c + r * (t + q_half * n), h, LATER[branch])
        lk = levels(c + r * (t + k_half * n), h, LATER[branch])
        out[0, h] = torch.minimum(lq[:, None], lk[None, :]).float().log()
    return out.to(dtype)


def call(q, k, v, b, causal, grad=None):
    """cuDNN through aten, (N, S, H, D) in; out, lse (and the gradients given grad)."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    bb = None if b is None else b.expand(q.shape[0], -1, -1, -1)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(qt, kt, vt, bb, True, 0.0, causal, False)
    out, lse = res[0], res[1]
    if grad is None:
        return out, lse
    g = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad.transpose(1, 2), qt, kt, vt, out, lse, None, None, bb, None, None, q.shape[1], k.shape[1], 0.0, causal,
        scale=1.0 / math.sqrt(q.shape[-1]))
    return out, lse, g


def check(d, causal, biased=True):
    """(Biased) cuDNN against a float32 (weighted) softmax on 2 squares of branch 0: relative errors
    (unbiased: the bar, cuDNN's own bf16 error)."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, M, H, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    b = bias(0, 0, 0, M, torch.bfloat16) if biased else None
    out, lse, g = call(q, k, v, b, causal, do)
    qf, kf, vf, dof = (x.float().requires_grad_() for x in (q, k, v, do))
    s = torch.einsum("nqhd,nkhd->nhqk", qf, kf) / math.sqrt(d)
    if biased:
        s = s + bias(0, 0, 0, M, torch.float32)
    if causal:
        s = s.masked_fill(torch.ones(M, M, device=dev, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = s.logsumexp(-1)
    ref = torch.einsum("nhqk,nkhd->nqhd", s.softmax(-1), vf)
    gr = torch.autograd.grad(ref, (qf, kf, vf), dof)
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    return {"out": rel(out.transpose(1, 2), ref), "lse": rel(lse.reshape(ref_lse.shape), ref_lse),
            "dq": rel(g[0].transpose(1, 2), gr[0]), "dk": rel(g[1].transpose(1, 2), gr[1]),
            "dv": rel(g[2].transpose(1, 2), gr[2])}


def timed(n, mq, d, causal, b):
    q, k, v, do = (torch.randn(n, mq, H, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    out, lse = call(q, k, v, b, causal)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    bb = None if b is None else b.expand(n, -1, -1, -1)
    fwd = lambda: call(q, k, v, b, causal)
    bwd = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do.transpose(1, 2), qt, kt, vt, out, lse, None, None, bb, None, None, mq, mq, 0.0, causal,
        scale=1.0 / math.sqrt(d))
    pairs = n * H * mq * mq * (0.5 if causal else 1.0)
    t_f, t_b = bench(fwd), bench(bwd)
    return {"fwd_ms": t_f, "bwd_ms": t_b, "fwd_tflops": 4 * pairs * d / t_f / 1e9,
            "bwd_tflops": 10 * pairs * d / t_b / 1e9}


def profile():
    """Kernels (name, calls, CUDA ms) of one plain and one biased fwd+bwd on branch 0's squares, D=128 causal."""
    out = {}
    for name, b in (("plain", None), ("biased", bias(0, 0, 0, M, torch.bfloat16))):
        q, k, v, do = (torch.randn(NSQ, M, H, 128, device=dev, dtype=torch.bfloat16) for _ in range(4))
        for _ in range(2):  # the second call is the one kept: the first builds cuDNN's graph
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                call(q, k, v, b, True, do)
                torch.cuda.synchronize()
        evs = prof.key_averages()
        out[name] = sorted(([e.key[:120], e.count, e.device_time_total / 1e3] for e in evs if e.device_time_total > 0),
                           key=lambda x: -x[2])[:12]
    return out


if "--profile" in sys.argv:
    res = {"env": environment(dev), "command": "python benchmarks/dedup_bias_probe.py --profile", "kernels": profile()}
    write_json(os.path.join(os.environ.get("OUT", "."), "dedup_bias_profile.json"), res)
    for name, ks in res["kernels"].items():
        print(f"{name}:")
        for k_, n, ms in ks:
            print(f"  {ms:8.3f} ms  x{n}  {k_}")
    sys.exit(0)

rows = []
for d in (128, 64):
    for causal in (True, False):
        r = dict(d=d, causal=causal)
        try:
            r["check_plain"] = check(d, causal, False)
            r["check"] = check(d, causal)
            r["squares"] = timed(NSQ, M, d, causal, None)
            r["squares_bias"] = timed(NSQ, M, d, causal, bias(0, 0, 0, M, torch.bfloat16))
            # branch 1's off-diagonal blocks (a branch's later blocks: the same shape and bias pattern)
            nblk = NSQ if causal else 2 * NSQ
            r["blocks_bias"] = timed(nblk, M // 2, d, False, bias(1, 1, 0, M // 2, torch.bfloat16))
            r["blocks"] = timed(nblk, M // 2, d, False, None)
            plain = r["squares"]
            for p in ("fwd", "bwd"):
                t_plain = plain[f"{p}_ms"] * (1 + 15 / 16)
                t_dedup = r["squares_bias"][f"{p}_ms"] + 15 / 16 * r["blocks_bias"][f"{p}_ms"]
                r[f"{p}_dedup_over_plain"] = t_dedup / t_plain
        except Exception as e:  # a refusal is recorded, not hidden
            r["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(r)
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)

write_json(os.path.join(os.environ.get("OUT", "."), "dedup_bias_probe.json"),
           {"env": environment(dev), "command": "python benchmarks/dedup_bias_probe.py", "rows": rows})
print("| D | causal | squares fwd / bwd TF/s | biased | blocks biased (plain) | pass dedup / plain fwd, bwd | max rel err |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f"| {r['d']} | {r['causal']} | {r['error'][:120]} |")
        continue
    f = lambda x: f"{x['fwd_tflops']:.0f} / {x['bwd_tflops']:.0f}"
    print(f"| {r['d']} | {r['causal']} | {f(r['squares'])} | {f(r['squares_bias'])} | {f(r['blocks_bias'])} "
          f"({f(r['blocks'])}) | {r['fwd_dedup_over_plain']:.2f}, {r['bwd_dedup_over_plain']:.2f} | "
          f"{max(r['check'].values()):.4f} ({max(r['check_plain'].values()):.4f}) |")
