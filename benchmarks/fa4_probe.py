"""FA4 beside cuDNN through ``longattn.attention``: forward and backward TFLOP/s
at 32K tokens, H=16, D=128, bf16, causal and not (one GPU, same run).

    python benchmarks/fa4_probe.py [--seqlen 32768] [--heads 16] [--kv-heads 16] [--dim 128 64] [--json PATH]

FLOPs as flash-attn counts them: 4*B*H*S^2*D forward (half for causal), 2.5x
that backward. Times are medians of CUDA-event timings after warm-up (the first
FA4 call compiles its kernels); backward = median(fwd+bwd) - median(fwd).
"""
import argparse
import statistics

import torch

import longattn
from longattn import backends as bk
from longattn.bench import measure as M


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(backend: str, s: int, h: int, hkv: int, d: int, causal: bool, iters: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda n: torch.randn(1, s, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(h).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(h)

    def fwd():
        return longattn.attention(q, k, v, causal=causal, backend=backend)

    def fwd_bwd():  # gradients returned, not accumulated into .grad (no extra adds in the timing)
        torch.autograd.grad(fwd(), (q, k, v), do)

    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    t_f = _median_ms(fwd, iters)
    t_fb = _median_ms(fwd_bwd, iters)
    flops = 4 * h * s * s * d / (2 if causal else 1)
    return t_f, t_fb - t_f, flops / t_f / 1e9, 2.5 * flops / (t_fb - t_f) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--dim", type=int, nargs="+", default=[128], help="head dims, one after the other in this process")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None, help="write the rows here ({commit} becomes the commit that ran)")
    a = p.parse_args()
    rows = []
    for dim in a.dim:
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cuDNN {torch.backends.cudnn.version()}  "
              f"S={a.seqlen} H={a.heads}/{a.kv_heads} D={dim} bf16")
        probe = torch.empty(1, a.seqlen, a.heads, dim, device="cuda", dtype=torch.bfloat16)
        kprobe = probe[:, :, :a.kv_heads]
        for causal in (False, True):
            spec = bk.BlockSpec(dim ** -0.5, causal)
            print(f"auto picks {bk.select_backend(probe, kprobe, spec).name} (causal={causal}); "
                  f"fa4 refusals: {bk.explain(probe, kprobe, spec)['fa4']}")
            for backend in ("cudnn", "fa4"):
                if bk.BACKENDS[backend].refusals(spec, probe, kprobe):
                    print(f"  {backend:6s} refuses: {bk.BACKENDS[backend].refusals(spec, probe, kprobe)}")
                    continue
                t_f, t_b, tf_f, tf_b = measure(backend, a.seqlen, a.heads, a.kv_heads, dim, causal, a.iters)
                print(f"  {'causal' if causal else 'full':6s} {backend:6s} fwd {t_f:7.2f} ms {tf_f:6.0f} TF/s   "
                      f"bwd {t_b:7.2f} ms {tf_b:6.0f} TF/s")
                rows.append(dict(backend=backend, causal=causal, seqlen=a.seqlen, heads=a.heads, kv_heads=a.kv_heads,
                                 dim=dim, fwd_ms=t_f, bwd_ms=t_b, fwd_tflops=tf_f, bwd_tflops=tf_b))
    if a.json:
        env = M.environment(torch.device("cuda"), command="python " + " ".join(__import__("sys").argv))
        path = a.json.replace("{commit}", str(env.get("commit")))
        M.write_json(path, dict(kind="fa4_probe", env=env, rows=rows))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
