"""Can dilated attention run cuDNN straight on strided views (no gathered copies)?

    python benchmarks/dilated_views_probe.py [--seqlens 32768 131072]

LongNet config (segments 2048..32768, rates 1..16), B=1, H=16, D=128, bf16.
Every part (branch w, r; offset class c; heads c::r) is a plain strided view
of the (B, S, H, D) tensors: (B*nseg, m, Hc, D) with row stride r*H*D. For
each seqlen this times, with CUDA-event medians (triton.testing.do_bench):

* ``triton``: the fused Triton kernels (``longattn.dilated_attention``), fwd and bwd;
* ``cudnn_views``: cuDNN's fused attention called once per part on the views
  (compute only: no merge), fwd and bwd; errors are recorded, not hidden;
* ``cudnn_contig``: the same calls on contiguous copies of the parts (what the
  gather path computes, without its copies and merges);
* ``dense``: cuDNN on the whole sequence (the issue's TF/s yardstick).

Useful TF/s count only the pairs dilated attention computes. One JSON line per
seqlen goes to $OUT/dilated_views_probe.jsonl; a table is printed last.
"""
import argparse
import json
import os

import torch
import triton

import longattn
from longattn import dilated as dl

p = argparse.ArgumentParser()
p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
args = p.parse_args()

dev = torch.device("cuda")
B, H, D = 1, 16, 128
SEGS, RATES = (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8, 16)
scale = D ** -0.5
bench = lambda f: triton.testing.do_bench(f, warmup=5, rep=100, return_mode="median")
cudnn_f = torch.ops.aten._scaled_dot_product_cudnn_attention
cudnn_b = torch.ops.aten._scaled_dot_product_cudnn_attention_backward


def views(x, part):
    """(B, S, H, D) -> (B*nseg, Hc, m, D) strided view of one part (SDPA layout)."""
    return part.q_view(x).flatten(0, 1).transpose(1, 2)


rows = []
for S in args.seqlens:
    q, k, v, do = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    parts = dl.schedule(S, SEGS, RATES, H)
    pairs = dl.pair_count(S, SEGS, RATES, H, False)
    fwd_fl, bwd_fl = 4 * pairs * D, 2.5 * 4 * pairs * D
    res = dict(seqlen=S, device=torch.cuda.get_device_name(), torch=torch.__version__,
               commit=os.environ.get("LONGATTN_COMMIT", "unknown"), parts=len(parts))

    # fused Triton
    f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES)
    res["triton_fwd_ms"] = bench(f)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o = longattn.dilated_attention(qg, kg, vg, segment_lengths=SEGS, dilation_rates=RATES)
    res["triton_bwd_ms"] = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True))
    out_full = o.detach()

    # cuDNN on views / on contiguous parts
    for mode in ("views", "contig"):
        try:
            pv = [tuple(views(x, pt) for x in (q, k, v, do, out_full)) for pt in parts]
            if mode == "contig":
                pv = [tuple(t.contiguous() for t in tup) for tup in pv]
            outs = [cudnn_f(a, b_, c, None, True, 0.0, False, False, scale=scale) for a, b_, c, _, _ in pv]
            if mode == "views":
                res["views_out_stride"] = list(outs[-1][0].stride())
                res["views_in_stride"] = list(pv[-1][0].stride())

            def fwd():
                for a, b_, c, _, _ in pv:
                    cudnn_f(a, b_, c, None, True, 0.0, False, False, scale=scale)

            res[f"cudnn_{mode}_fwd_ms"] = bench(fwd)
            # backward with the part's own out/lse (the cost of the call is what is measured)
            lses = [r[1] for r in outs]
            po = [r[0] for r in outs]

            def bwd():
                for (a, b_, c, g, _), oo, ll in zip(pv, po, lses):
                    m = a.shape[2]
                    cudnn_b(g, a, b_, c, oo, ll, None, None, None, None, None, m, m, 0.0, False, scale=scale)

            try:
                res[f"cudnn_{mode}_bwd_ms"] = bench(bwd)
            except Exception as e:  # noqa: BLE001 - recorded
                res[f"cudnn_{mode}_bwd_error"] = repr(e)[:300]
            # one part checked against the gathered computation
            a, b_, c, _, _ = pv[len(pv) // 2]
            ref = cudnn_f(a.contiguous(), b_.contiguous(), c.contiguous(), None, True, 0.0, False, False,
                          scale=scale)[0]
            got = cudnn_f(a, b_, c, None, True, 0.0, False, False, scale=scale)[0]
            res[f"cudnn_{mode}_max_abs_diff_vs_contig"] = (got.float() - ref.float()).abs().max().item()
            del pv, outs, po, lses
        except Exception as e:  # noqa: BLE001 - recorded
            res[f"cudnn_{mode}_error"] = repr(e)[:300]

    # dense cuDNN yardstick
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
    r = cudnn_f(qt, kt, vt, None, True, 0.0, False, False, scale=scale)
    res["dense_fwd_ms"] = bench(lambda: cudnn_f(qt, kt, vt, None, True, 0.0, False, False, scale=scale))
    res["dense_bwd_ms"] = bench(lambda: cudnn_b(dot, qt, kt, vt, r[0], r[1], None, None, None, None, None, S, S, 0.0,
                                                False, scale=scale))
    dfl = 4 * B * H * S * S * D
    res["dense_fwd_tflops"] = dfl / res["dense_fwd_ms"] / 1e9
    res["dense_bwd_tflops"] = 2.5 * dfl / res["dense_bwd_ms"] / 1e9
    for key in ("triton", "cudnn_views", "cudnn_contig"):
        for m, fl in (("fwd", fwd_fl), ("bwd", bwd_fl)):
            t = res.get(f"{key}_{m}_ms")
            if t:
                res[f"{key}_{m}_tflops"] = fl / t / 1e9
                res[f"{key}_{m}_x_dense"] = res[f"{key}_{m}_tflops"] / res[f"dense_{m}_tflops"]
    rows.append(res)
    del q, k, v, do, qg, kg, vg, o, out_full
    torch.cuda.empty_cache()

with open(os.path.join(os.environ.get("OUT", "."), "dilated_views_probe.jsonl"), "a") as fh:
    for r in rows:
        fh.write(json.dumps(r) + "\n")
print("| S | impl | fwd ms | bwd ms | useful TF/s fwd / bwd | x dense cuDNN fwd / bwd |")
for r in rows:
    print(f"| {r['seqlen']} | dense cuDNN | {r['dense_fwd_ms']:.2f} | {r['dense_bwd_ms']:.2f} | "
          f"{r['dense_fwd_tflops']:.0f} / {r['dense_bwd_tflops']:.0f} | 1 / 1 |")
    for key in ("triton", "cudnn_views", "cudnn_contig"):
        if f"{key}_fwd_ms" not in r:
            print(f"| {r['seqlen']} | {key} | error: {r.get(key + '_error', '')[:150]} |")
            continue
        print(f"| {r['seqlen']} | {key} | {r[f'{key}_fwd_ms']:.2f} | {r.get(f'{key}_bwd_ms', float('nan')):.2f} | "
              f"{r[f'{key}_fwd_tflops']:.0f} / {r.get(f'{key}_bwd_tflops', 0):.0f} | "
              f"{r[f'{key}_fwd_x_dense']:.2f} / {r.get(f'{key}_bwd_x_dense', 0):.2f} | "
              f"{r.get(key + '_bwd_error', '')[:100]}")
    print("  views strides in/out:", r.get("views_in_stride"), r.get("views_out_stride"),
          "diff vs contig:", r.get("cudnn_views_max_abs_diff_vs_contig"))
