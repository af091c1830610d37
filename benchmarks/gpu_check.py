"""Correctness of every backend and the Triton kernels on a GPU in bf16,
against float64 references, with PyTorch's own bf16 SDPA error as the bar.
Writes JSON to $OUT/gpu_check.json and prints a table."""
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import longattn  # noqa: E402
from reference import attention_ref, dilated_ref, grads_of, rel_err  # noqa: E402

dev = "cuda"
rows = []


def check(name, fn, ref_fn, inputs, dout, dlse=None, bar_fn=None):
    try:
        o, l, g = grads_of(fn, inputs, dout, dlse)
        ro, rl, rg = grads_of(ref_fn, [x.double() for x in inputs], dout, dlse)
        errs = [rel_err(o, ro)] + ([rel_err(l, rl)] if l is not None else [0.0]) + [rel_err(a, b) for a, b in zip(g, rg)]
        bar = None
        if bar_fn is not None:
            bo, bl, bg = grads_of(bar_fn, inputs, dout, None)
            bar = [rel_err(bo, ro)] + [rel_err(a, b) for a, b in zip(bg, rg)]
        rows.append(dict(name=name, errs=errs, sdpa_bf16=bar, ok=True))
    except Exception as e:
        rows.append(dict(name=name, ok=False, error=repr(e)[:400], tb=traceback.format_exc()[-1500:]))


def sdpa_bf16(causal):
    def f(q, k, v):
        g = q.shape[2] // k.shape[2]
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2),
            is_causal=causal).transpose(1, 2)
    return f


torch.manual_seed(0)
B, S, H, HKV, D = 2, 1024, 8, 2, 128
for dt in (torch.bfloat16,):
    q = torch.randn(B, S, H, D, device=dev, dtype=dt)
    k = torch.randn(B, S, HKV, D, device=dev, dtype=dt)
    v = torch.randn(B, S, HKV, D, device=dev, dtype=dt)
    do = torch.randn_like(q)
    dl = torch.randn(B, H, S, device=dev)
    for be in ("cudnn", "flash", "efficient", "triton", "math"):
        for causal in (False, True):
            check(f"attn {be} causal={causal}", lambda q, k, v: longattn.attention(q, k, v, causal=causal, backend=be, return_lse=True),
                  lambda q, k, v: attention_ref(q, k, v, causal=causal), [q, k, v], do, None, sdpa_bf16(causal))
        check(f"attn {be} dlse", lambda q, k, v: longattn.attention(q, k, v, backend=be, return_lse=True),
              lambda q, k, v: attention_ref(q, k, v), [q, k, v], do, dl)
    for be in ("flash", "triton"):
        check(f"attn {be} window(256,0)", lambda q, k, v: longattn.attention(q, k, v, causal=True, window_size=(256, 0), backend=be, return_lse=True),
              lambda q, k, v: attention_ref(q, k, v, causal=True, window=(256, 0)), [q, k, v], do)
    qs = q[:, :300]
    check("attn triton Sq!=Sk causal", lambda q, k, v: longattn.attention(q, k, v, causal=True, backend="triton", return_lse=True),
          lambda q, k, v: attention_ref(q, k, v, causal=True), [qs, k, v], do[:, :300])
    check("attn flash Sq!=Sk causal", lambda q, k, v: longattn.attention(q, k, v, causal=True, backend="flash", return_lse=True),
          lambda q, k, v: attention_ref(q, k, v, causal=True), [qs, k, v], do[:, :300])
    S2 = 3000
    q = torch.randn(1, S2, H, D, device=dev, dtype=dt)
    k = torch.randn(1, S2, HKV, D, device=dev, dtype=dt)
    v = torch.randn(1, S2, HKV, D, device=dev, dtype=dt)
    do = torch.randn_like(q)
    segs, rates = [256, 512, 1024, 4096], [1, 2, 4, 8]
    for be in ("triton", "cudnn", "flash"):
        for causal in (False, True):
            check(f"dilated {be} causal={causal}", lambda q, k, v: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=causal, backend=be, return_lse=True),
                  lambda q, k, v: dilated_ref(q, k, v, segs, rates, causal=causal), [q, k, v], do)
print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__), indent=None))
out = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(out, "gpu_check.json"), "w"), indent=1)
for r in rows:
    if r["ok"]:
        bar = "" if r["sdpa_bf16"] is None else " | sdpa " + " ".join(f"{e:.1e}" for e in r["sdpa_bf16"])
        print(f"{r['name']:36s} " + " ".join(f"{e:.1e}" for e in r["errs"]) + bar)
    else:
        print(f"{r['name']:36s} FAIL {r['error'][:300]}")
