"""Host time of each piece of a decode step (one query, 128K cached tokens,
32q/8kv, D=128, bf16): mean wall time per call over 300 calls issued back to
back (the GPU runs behind; the host's cost of launching is what is timed).

    python benchmarks/decode_host_profile.py
"""
import time

import torch

import longattn
from longattn import tuning
from longattn.decode.engine import dense_part, split_kv_args
from longattn.kernels import decode as kd
dev = torch.device("cuda")
b, n, h, hkv, d = 1, 131072, 32, 8, 128
kc = torch.randn(b, n + 64, hkv, d, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16)
kn = torch.randn(b, 1, hkv, d, device=dev, dtype=torch.bfloat16)
res = {}
def T(name, f, reps=300):
    for _ in range(5): f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps): f()
    res[name] = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
T("get_device_properties", lambda: torch.cuda.get_device_properties(dev))
T("torch.empty", lambda: torch.empty(1024, device=dev))
T("slice copy kc[:, n:n+1] = kn", lambda: kc[:, n:n + 1].copy_(kn))
T("setitem kc[:, n:n+1] = kn", lambda: kc.__setitem__((slice(None), slice(n, n + 1)), kn))
args = split_kv_args(q, tuning.DECODE)  # the split kernel's tiles as dense_part launches them
T("kd.decode (split and merge in one launch, host lens)", lambda: kd.decode(q, kc, vc, [n], False, 0.1, **args))
T("dense_part triton", lambda: dense_part(q, kc, vc, [n], True, 0.1, "triton"))
T("dense_part flash", lambda: dense_part(q, kc, vc, [n], True, 0.1, "flash"))
k, v = kc[:, :n], vc[:, :n]
T("aten._flash_attention_forward", lambda: torch.ops.aten._flash_attention_forward(q, k, v, None, None, 1, n, 0.0, False, False, scale=0.1))
lse = torch.zeros(1, 32, 1, device=dev)
T("nan_to_num", lambda: torch.nan_to_num(lse, nan=float("nan"), posinf=float("-inf"), neginf=float("-inf")))
split, nsplit = kd.splits(n, 8, dev, args["programs_per_sm"], args["block_n"], args["min_split"])
op = torch.empty(8 * nsplit * 16, 128, device=dev); lp = torch.empty(8 * nsplit * 16, device=dev)
out = torch.empty_like(q); l2 = torch.empty(1, 32, 1, device=dev)
cnt = kd.counters(8, q)
T("split kernel launch only (merges in the launch)", lambda: kd._split_kernel[(nsplit, 8)](q, kc, vc, kc, vc, op, lp, out, l2, cnt, q, q, 0, n, kc.shape[1], *q.stride()[:3], *kc.stride()[:3], *vc.stride()[:3], *out.stride()[:3], l2.stride(0), l2.stride(1), 8, 1, split, nsplit, 0.1, G=4, D=128, D_PAD=128, BLOCK_M=16, ROWS=4, S_CHUNK=kd.merge_chunk(4, 128, args["num_warps"], dev), BLOCK_N=args["block_n"], CAUSAL=False, PER_ROW=False, IEEE=False, HEADS_FAST=args["heads_fastest"], DESC=False, TRACE=False, num_warps=args["num_warps"], num_stages=args["num_stages"]))
c = longattn.KVCache.from_prefill(kc[:, :n], vc[:, :n], reserve=2000)
T("KVCache.append", lambda: c.append(kn, kn), reps=500)
T("KVCache.attend (auto)", lambda: c.attend(q), reps=300)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    kd.decode(q, kc, vc, [n], False, 0.1, **args)
T("graph replay", g.replay)
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
kt = kc.transpose(1, 2); qt = q.transpose(1, 2)
def s():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, kt, enable_gqa=True)
T("sdpa flash (with sdpa_kernel ctx)", s)
for kk, vv in res.items(): print(f"{kk:45s} {vv:8.1f} us")
