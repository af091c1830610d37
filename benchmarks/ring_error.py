"""Numerical error of ring attention against world size, bf16 on GPUs.

torchrun --nproc_per_node=N benchmarks/ring_error.py
Global bf16 inputs (same on every rank), float64 reference of the whole
sequence on each rank's GPU; the ring result is unsharded and compared:
out, lse, dq, dk, dv. The bar is PyTorch's own bf16 SDPA (cuDNN) on one GPU
against the same reference. Rank 0 appends a JSON line to $OUT/ring_error.jsonl.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import longattn  # noqa: E402
from reference import attention_ref, rel_err  # noqa: E402

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
dev = "cuda"
S, H, D = 8192, 8, 128
rows = []
for layout, causal, hkv in (("zigzag", True, 8), ("contiguous", False, 8), ("zigzag", True, 2)):
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, S, h, D, device=dev, generator=g).bfloat16() for h in (H, hkv, hkv))
    do = torch.randn(1, S, H, D, device=dev, generator=g).bfloat16()
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = attention_ref(qr, kr, vr, causal=causal)
    ro.backward(do.double())
    ql, kl, vl = (longattn.shard(x, layout=layout).requires_grad_() for x in (q, k, v))
    out, lse = longattn.ring_attention(ql, kl, vl, causal=causal, layout=layout, return_lse=True)
    out.backward(longattn.shard(do, layout=layout))
    us = lambda x, dim=1: longattn.unshard(x.detach(), layout=layout, seq_dim=dim)
    errs = dict(out=rel_err(us(out), ro), lse=rel_err(us(lse, 2), rl), dq=rel_err(us(ql.grad), qr.grad),
                dk=rel_err(us(kl.grad), kr.grad), dv=rel_err(us(vl.grad), vr.grad))
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        so = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), is_causal=causal,
            enable_gqa=hkv != H).transpose(1, 2)
    so.backward(do)
    bar = dict(out=rel_err(so, ro), dq=rel_err(qs.grad, qr.grad), dk=rel_err(ks.grad, kr.grad),
               dv=rel_err(vs.grad, vr.grad))
    rows.append(dict(world=world, layout=layout, causal=causal, heads=H, kv_heads=hkv, seqlen=S, ring_bf16=errs,
                     sdpa_bf16_single_gpu=bar, worst_ratio=max(errs[n] / bar[n] for n in bar)))
    del qr, kr, vr, ro, rl
    torch.cuda.empty_cache()
# Packed documents: ring_attention_varlen (one flash-varlen launch per step on
# GPU) against the float64 block-diagonal reference; the bar is attention_varlen
# (flash) in bf16 on one GPU.
from test_varlen import varlen_ref  # noqa: E402

for layout in ("zigzag", "contiguous"):
    lens = [300, 900, 1500, 2400, 700, 64, 33]
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(int(cu[-1]), h, D, device=dev, generator=g).bfloat16() for h in (H, 2, 2))
    do = torch.randn(int(cu[-1]), H, D, device=dev, generator=g).bfloat16()
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ro, rl = varlen_ref(qr, kr, vr, cu.cpu(), True, (-1, -1))
    ro.backward(do.double())
    sh = lambda x: longattn.shard_varlen(x, cu, layout=layout)[0]
    ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
    out = longattn.ring_attention_varlen(ql, kl, vl, cu, layout=layout, causal=True)
    out.backward(sh(do))
    us = lambda x: longattn.unshard_varlen(x.detach(), cu, layout=layout)
    errs = dict(out=rel_err(us(out), ro), dq=rel_err(us(ql.grad), qr.grad), dk=rel_err(us(kl.grad), kr.grad),
                dv=rel_err(us(vl.grad), vr.grad))
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    so = longattn.attention_varlen(qs, ks, vs, cu, causal=True, backend="flash")
    so.backward(do)
    bar = dict(out=rel_err(so, ro), dq=rel_err(qs.grad, qr.grad), dk=rel_err(ks.grad, kr.grad),
               dv=rel_err(vs.grad, vr.grad))
    rows.append(dict(world=world, layout=f"varlen-{layout}", causal=True, heads=H, kv_heads=2, seqlen=int(cu[-1]),
                     docs=lens, ring_bf16=errs, varlen_flash_bf16_single_gpu=bar,
                     worst_ratio=max(errs[n] / bar[n] for n in bar)))
    del qr, kr, vr, ro, rl
    torch.cuda.empty_cache()

if rank == 0:
    with open(os.path.join(os.environ.get("OUT", "."), "ring_error.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        print(f"world {world} {r['layout']:10s} causal={r['causal']!s:5s} hkv={r['kv_heads']} ring "
              + " ".join(f"{k}={v:.1e}" for k, v in r["ring_bf16"].items()) + f" | worst/sdpa {r['worst_ratio']:.2f}")
dist.barrier()
dist.destroy_process_group()
