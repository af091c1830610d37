"""FA4's varlen kernels on a mixed-length pack under other document orders
and launch splits (kernel calls only, data permuted beforehand): given
order, longest first, reversed, the longest document in its own dense launch
(one stream and two), and the deterministic backward. Forward and backward
ms (median of 20 after 3 warm-up), TF/s by flash-attn's causal count.

    python benchmarks/varlen_order.py OUT.json
"""
import json, sys
import torch
from longattn.backends import _fa4_api as F
from longattn.bench import measure

def timeit(fn, n=20, w=3):
    return measure.time_ms(fn, torch.device("cuda"), warmup=w, iters=n)["median_ms"]

def run(lens, H, Hkv, D=128, label=""):
    dev, dt = "cuda", torch.bfloat16
    T = sum(lens)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt, generator=g)
    do = torch.randn_like(q)
    sc = D ** -0.5
    cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
    mx = max(lens)
    res = {}
    def one(cu_, mx_, q_=q, k_=k, v_=v, do_=do):
        o, l = F.forward(q_, k_, v_, sc, True, (-1, -1), cu_, mx_)
        return (lambda: F.forward(q_, k_, v_, sc, True, (-1, -1), cu_, mx_),
                lambda: F.backward(do_, q_, k_, v_, o, l, sc, True, (-1, -1), None, cu_, mx_))
    f, b = one(cu, mx)
    res["given"] = (timeit(f), timeit(b))
    # sorted longest first (data permuted beforehand: the kernel's time alone)
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    starts = cu.tolist()
    idx = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in order])
    qs, ks, vs, dos = q[idx], k[idx], v[idx], do[idx]
    cus = torch.tensor([0] + [lens[i] for i in order], device=dev).cumsum(0).to(torch.int32)
    f, b = one(cus, mx, qs, ks, vs, dos)
    res["sorted"] = (timeit(f), timeit(b))
    res["permute_cost"] = (timeit(lambda: (q[idx], k[idx], v[idx])), timeit(lambda: (do[idx], q.index_copy(0, idx, qs), k.index_copy(0, idx, ks), v.index_copy(0, idx, vs), q.index_copy(0, idx, qs))))
    # reversed order
    order_r = list(reversed(range(len(lens))))
    idx_r = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in order_r])
    cur = torch.tensor([0] + [lens[i] for i in order_r], device=dev).cumsum(0).to(torch.int32)
    f, b = one(cur, mx, q[idx_r], k[idx_r], v[idx_r], do[idx_r])
    res["reversed"] = (timeit(f), timeit(b))
    # the longest document in its own dense launch, the rest varlen (views; outputs concatenated)
    L = order[0]
    a, e = starts[L], starts[L + 1]
    rest = [i for i in range(len(lens)) if i != L]
    if L == len(lens) - 1:
        cur_ = cu[:-1]
        qd, kd, vd, dod = (x[None, a:e] for x in (q, k, v, do))
        qr, kr, vr, dor = (x[:a] for x in (q, k, v, do))
        od, ld = F.forward(qd, kd, vd, sc, True, (-1, -1))
        orr, lr = F.forward(qr, kr, vr, sc, True, (-1, -1), cur_, max(lens[i] for i in rest))
        def fs():
            o1, l1 = F.forward(qd, kd, vd, sc, True, (-1, -1))
            o2, l2 = F.forward(qr, kr, vr, sc, True, (-1, -1), cur_, max(lens[i] for i in rest))
            return torch.cat([o2, o1[0]]), torch.cat([l2, l1[0]], 1)
        def bs():
            g1 = F.backward(dod, qd, kd, vd, od, ld, sc, True, (-1, -1))
            g2 = F.backward(dor, qr, kr, vr, orr, lr, sc, True, (-1, -1), None, cur_, max(lens[i] for i in rest))
            return [torch.cat([x2, x1[0]]) for x1, x2 in zip(g1, g2)]
        res["split_longest"] = (timeit(fs), timeit(bs))
        side = torch.cuda.Stream()
        def bs2():
            cur_s = torch.cuda.current_stream()
            side.wait_stream(cur_s)
            with torch.cuda.stream(side):
                g1 = F.backward(dod, qd, kd, vd, od, ld, sc, True, (-1, -1))
            g2 = F.backward(dor, qr, kr, vr, orr, lr, sc, True, (-1, -1), None, cur_, max(lens[i] for i in rest))
            cur_s.wait_stream(side)
            return g1, g2
        def fs2():
            cur_s = torch.cuda.current_stream()
            side.wait_stream(cur_s)
            with torch.cuda.stream(side):
                r1 = F.forward(qd, kd, vd, sc, True, (-1, -1))
            r2 = F.forward(qr, kr, vr, sc, True, (-1, -1), cur_, max(lens[i] for i in rest))
            cur_s.wait_stream(side)
            return r1, r2
        res["split_longest_2streams_nocat"] = (timeit(fs2), timeit(bs2))
    # deterministic varlen bwd (its scheduler reverses blocks within a document, swizzles heads)
    o, l = F.forward(q, k, v, sc, True, (-1, -1), cu, mx)
    I = F._interface()
    res["given_bwd_deterministic"] = (None, timeit(lambda: I._flash_attn_bwd(q=q, k=k, v=v, out=o, dout=do, lse=l, softmax_scale=sc, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, deterministic=True)))
    fl = 4 * H * D * sum(x * x for x in lens) / 2
    out = {"label": label, "lens": lens, "H": H, "Hkv": Hkv, "fwd_flops": fl,
           "ms": res, "tflops": {k_: [None if t is None else (fl * m / t / 1e9) for t, m in zip(v_, (1, 2.5))] for k_, v_ in res.items() if k_ != "permute_cost"}}
    return out

if __name__ == "__main__":
    rows = [run([8192, 512, 2048, 128, 4096, 1024, 256, 16384 - 128], 16, 16, label="varlen_mix_32k"),
            run([300, 900, 1500, 2400, 700, 300, 900, 1500, 2400, 700, 300, 900, 1500, 2084], 32, 8, label="varlen_chat_16k")]
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(sys.argv[1], "w"), indent=1)
    for r in rows:
        print(r["label"])
        for k_, v_ in r["ms"].items():
            print(f"  {k_:32s} fwd {v_[0] if v_[0] is None else round(v_[0],3)}  bwd {round(v_[1],3)}", r["tflops"].get(k_))
