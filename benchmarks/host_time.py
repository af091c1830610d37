"""Host time of one call of each FA4 path at a small shape (S=2048, H=16,
D=128, bf16: the GPU finishes first, so the host sets the pace): FA4's own
interface (``_flash_attn_fwd`` / ``_flash_attn_bwd``), ``attention`` (FA4 and
cuDNN), ``attention_varlen`` (4 documents; with and without ``max_seqlen``) and
``flex_attention`` on FA4 (window + global tokens, block-sparse). Per path: the
mean host time of 40 calls queued back to back (forward, and forward +
backward where it has one; ``fwd_*`` is the call itself, FA4's backward for
``fa4_interface_bwd``), the same with the GPU's work waited for, and cProfile
of 10 calls (by own time and cumulative).

    python benchmarks/host_time.py --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import longattn
from longattn import masks
from longattn.bench import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the times and profiles here")
    a = ap.parse_args()
    from flash_attn.cute import interface as fa4  # flash-attn-4 is what this measures

    dev, bf = torch.device("cuda"), torch.bfloat16
    s, h, d = 2048, 16, 128
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=bf, requires_grad=True)
    q, k, v = mk(1, s, h, d), mk(1, s, h, d), mk(1, s, h, d)
    do = torch.randn(1, s, h, d, device=dev, dtype=bf)
    qv, kv, vv = mk(s, h, d), mk(s, h, d), mk(s, h, d)
    dov = torch.randn(s, h, d, device=dev, dtype=bf)
    cu = torch.tensor([0, 256, 1024, 1100, s], dtype=torch.int32, device=dev)
    scale = d ** -0.5
    qd, kd, vd = (x.detach() for x in (q, k, v))
    o0, l0 = fa4._flash_attn_fwd(qd, kd, vd, softmax_scale=scale, causal=True, return_lse=True)[:2]
    swg = masks.local_global(256, 64)
    layout = torch.rand(s // 128, s // 128, device=dev) < 0.1
    layout |= torch.eye(s // 128, dtype=torch.bool, device=dev)
    bsparse = masks.block_sparse(layout, 128)
    calls = {
        "fa4_interface_fwd": (lambda: fa4._flash_attn_fwd(qd, kd, vd, softmax_scale=scale, causal=True,
                                                          return_lse=True), None),
        "fa4_interface_bwd": (lambda: fa4._flash_attn_bwd(qd, kd, vd, o0, do, l0, softmax_scale=scale, causal=True),
                              None),
        "attention": (lambda: longattn.attention(q, k, v, causal=True), do),
        "attention_cudnn": (lambda: longattn.attention(q, k, v, causal=True, backend="cudnn"), do),
        "varlen": (lambda: longattn.attention_varlen(qv, kv, vv, cu, causal=True), dov),
        "varlen_max_seqlen": (lambda: longattn.attention_varlen(qv, kv, vv, cu, causal=True, max_seqlen=1024), dov),
        "flex_window_global": (lambda: longattn.flex_attention(q, k, v, mask_mod=swg), do),
        "flex_block_sparse": (lambda: longattn.flex_attention(q, k, v, mask_mod=bsparse), do),
    }
    res = {}
    for name, (f, grad) in calls.items():
        def fwd_bwd(f=f, grad=grad):
            out = f()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad)

        step = fwd_bwd if grad is not None else f
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        r = {}
        for what, fn in (("fwd", f), ("fwd_bwd", fwd_bwd)):
            if what == "fwd_bwd" and grad is None:
                continue
            n = 40
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            r[what + "_host_us"] = (t1 - t0) / n * 1e6
            r[what + "_with_gpu_us"] = (t2 - t0) / n * 1e6
        prof = measure.host_profile(step, 10, dev, (("tottime", 22), ("cumulative", 40)))
        r["profile_tottime"], r["profile_cum"] = prof["tottime"][-7000:], prof["cumulative"][-7000:]
        res[name] = r
        print(f"{name:20s} " + " ".join(f"{k}={x:.0f}" for k, x in r.items() if k.endswith("us")), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"kind": "host_time", "env": measure.environment(dev, "python benchmarks/host_time.py"),
                       "results": res}, fh, indent=1)


if __name__ == "__main__":
    main()
