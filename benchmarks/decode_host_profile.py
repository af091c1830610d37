"""Host time of each piece of a decode step (one query, ``--context``
cached tokens, 32q/8kv, D=128, bf16): mean wall time per call over many
calls issued back to back. Time what the host spends issuing, with a cache
short enough (``--context 4096``) that the GPU keeps up: at 128K a step's
kernels outlast its host work, the launch queue fills and the host waits.

The pieces of a ``KVCache`` step (``append`` then ``attend``, replayed from a
CUDA graph) and what they are made of, beside SDPA's step (the new token's
K/V written into a head-major cache, then cuDNN).

    python benchmarks/decode_host_profile.py [--json out.json]
"""
import argparse
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import longattn
from longattn import tuning
from longattn.bench.measure import environment, result_path
from longattn.decode.engine import dense_engine, split_kv_args, split_kv_refusals
from longattn.kernels import decode as kd

p = argparse.ArgumentParser()
p.add_argument("--context", type=int, default=131072)
p.add_argument("--reps", type=int, default=500)
p.add_argument("--json")
a = p.parse_args()
dev = torch.device("cuda")
b, n, h, hkv, d = 1, a.context, 32, 8, 128
g = torch.Generator(device=dev).manual_seed(0)
kc, vc = (torch.randn(b, n, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
q = torch.randn(b, 1, h, d, device=dev, dtype=torch.bfloat16, generator=g)
kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
res = {}


def T(name, f, reps=a.reps):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    res[name] = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()


with torch.no_grad():
    cache = longattn.KVCache.from_prefill(kc, vc, reserve=8 * a.reps + 64)
    steps = cache._steps
    T("KVCache.attend(q, k_new=, v_new=) (a step)", lambda: cache.attend(q, k_new=kn, v_new=vn))
    T("KVCache append + attend (two calls)", lambda: (cache.append(kn, vn), cache.attend(q)))
    T("KVCache.append", lambda: cache.append(kn, vn))
    T("KVCache.attend", lambda: cache.attend(q))
    scale = d ** -0.5
    lens = cache.layout.local[0]
    T("  dense_engine", lambda: dense_engine(q, cache.k, cache.v, "auto", False, cache.tuning, graph_steps=True,
                                              keys=max(lens)))
    T("    split_kv_refusals", lambda: split_kv_refusals(q, cache.k, cache.v, "auto", cache.tuning))
    T("  StepGraphs.attend", lambda: steps.attend(q, cache.k, cache.v, lens, scale, cache.tuning, False))
    # the graph of a loop's step (one token appended since the last: its key ends with 1)
    graph = next(gr for key, gr in steps.replays.graphs.items() if key[0][-1] == 1)
    T("    Graph call (inputs in, replay, outputs cloned)", lambda: graph([q]))
    T("      inputs in (Graph._load)", lambda: graph._load([q]))
    T("      replay", graph.graph.replay)
    T("      outputs cloned", lambda: tuple(o.clone() for o in graph.outputs))
    T("    hash(DecodeTuning)", lambda: hash(cache.tuning))
    T("  StepGraphs.advance (a host count; the step adds it on the GPU)", lambda: steps.advance(0))
    pos = n - 1
    at = (slice(None), slice(pos, pos + 1))
    T("  k[:, p:p+1] = k_new; v[...] (setitem x2)", lambda: (cache.k.__setitem__(at, kn), cache.v.__setitem__(at, vn)))
    T("  narrow + copy_ x2", lambda: (cache.k.narrow(1, pos, 1).copy_(kn), cache.v.narrow(1, pos, 1).copy_(vn)))
    T("  _foreach_copy_ of two narrow views", lambda: torch._foreach_copy_(
        [cache.k.narrow(1, pos, 1), cache.v.narrow(1, pos, 1)], [kn, vn]))
    args = split_kv_args(q, tuning.DECODE)
    T("kd.decode (eager launch, host lens)", lambda: kd.decode(q, kc, vc, [n], True, scale, **args))

    kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    qt, knt, vnt = q.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2)

    def sdpa_step():
        kt[:, :, pos:pos + 1] = knt
        vt[:, :, pos:pos + 1] = vnt
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, enable_gqa=True)

    def sdpa_only():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(qt, kt, vt, enable_gqa=True)
    T("SDPA cuDNN step (two setitems + sdpa)", sdpa_step)
    T("  sdpa cuDNN (with sdpa_kernel)", sdpa_only)

env = environment(dev, command=" ".join(["python", "benchmarks/decode_host_profile.py", *__import__("sys").argv[1:]]))
if a.json:
    with open(result_path(a.json), "w") as f:
        json.dump(dict(kind="decode_host_profile", env=env, context=n,
                       results=[dict(piece=k, host_us=v) for k, v in res.items()]), f, indent=1)
for k, v in res.items():
    print(f"{k:55s} {v:8.1f} us")
