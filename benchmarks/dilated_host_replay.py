"""Host time of a dilated pass replayed from its CUDA graph (LongNet, 8K tokens,
causal, 16 heads, D=128, bf16): wall time per call issued back to back (the
GPU runs behind), then cProfile of 50 calls, forward and backward, heaviest
functions first.

    python benchmarks/dilated_host_replay.py
"""
import cProfile, pstats, time, torch, longattn
dev = torch.device("cuda")
SEGS, RATES = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
q, k, v = (torch.randn(1, 8192, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=SEGS, dilation_rates=RATES, causal=True)
for _ in range(4):
    torch.autograd.grad(f(), (q, k, v), do)
torch.cuda.synchronize()
o = f()
def bwd(n):
    for _ in range(n):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
def fwd(n):
    for _ in range(n):
        f()
for name, fn in (("bwd", bwd), ("fwd", fwd)):
    fn(5); torch.cuda.synchronize()
    t = time.perf_counter(); fn(50); h = (time.perf_counter() - t) / 50 * 1e3; torch.cuda.synchronize()
    print(f"== {name}: host {h:.3f} ms per call")
    pr = cProfile.Profile(); pr.enable(); fn(50); pr.disable(); torch.cuda.synchronize()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(22)
