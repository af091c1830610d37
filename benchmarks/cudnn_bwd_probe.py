"""Why is the cuDNN backward slow through the aten op? Time variants at
S=16K, H=16, D=128 bf16 against SDPA's own autograd path."""
import torch
import triton

from longattn import backends as bk

dev = "cuda"
B, S, H, D = 1, 16384, 16, 128
q, k, v, do = (torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
scale = D ** -0.5
flops = 2.5 * 4 * B * H * S * S * D
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=200, return_mode="median")
res = torch.ops.aten._scaled_dot_product_cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         None, True, 0.0, False, False, scale=scale)
out, lse = res[0], res[1]
print("cudnn fwd out strides", out.shape, out.stride(), "lse", lse.shape, lse.stride(), lse.dtype,
      "seed", res[6], res[7])
variants = {
    "fwd-returned seed/offset, lse as returned": (res[6], res[7], lse),
    "None seed/offset, lse as returned": (None, None, lse),
    "zeros seed/offset": (torch.zeros((), dtype=torch.int64, device=dev),) * 2 + (lse,),
    "None, lse contiguous (B,H,S,1)": (None, None, lse.reshape(B, H, S, 1).contiguous()),
}
for name, (s0, s1, l) in variants.items():
    try:
        f = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out, l, s0, s1, None, None,
            None, S, S, 0.0, False, scale=scale)
        t = bench(f)
        print(f"{name:45s} {t:7.2f} ms {flops / t / 1e9:6.0f} TF/s")
    except Exception as e:  # noqa: BLE001
        print(f"{name:45s} FAIL {repr(e)[:200]}")
qg, kg, vg = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg)
t = bench(lambda: torch.autograd.grad(o, (qg, kg, vg), do.transpose(1, 2), retain_graph=True))
print(f"{'SDPA autograd cudnn':45s} {t:7.2f} ms {flops / t / 1e9:6.0f} TF/s  grad_fn={o.grad_fn}")
spec = bk.BlockSpec(scale)
o2, l2 = bk.BACKENDS["cudnn"].forward(q, k, v, spec)
for be in ("cudnn", "flash", "triton"):
    t = bench(lambda: bk.BACKENDS[be].backward(do, q, k, v, o2, l2, spec))
    print(f"{'longattn backend ' + be + ' backward':45s} {t:7.2f} ms {flops / t / 1e9:6.0f} TF/s")
