"""Forward of the LongNet config (32K, H=16, D=128, bf16) through the views path
in three variants, to see what the rate-1 branch's handling costs:

* current: the rate-1 branch's result becomes the output (one piece, batch 1);
* no_adopt: it is copied into a preallocated output;
* zeros_merge: the output is zero-filled and every part merges (the old path).

    BK=auto|cudnn python benchmarks/dilated_adopt_probe.py   -> $OUT/probe_adopt.json
"""
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

import longattn
from longattn import dilated
from longattn.bench import measure

dev = torch.device("cuda")
segs, rates = [2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16]
res = {}
for S in (32768, 131072):
    q, k, v = (torch.randn(1, S, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    f = lambda: longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates,
                                           backend=os.environ.get("BK", "cudnn"))
    ref = longattn.dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, backend="triton").float()
    orig_adopt, orig_order = dilated._adoptable, dilated._ordered_units
    for name in ("current", "no_adopt", "zeros_merge"):
        dilated._adoptable, dilated._ordered_units = orig_adopt, orig_order
        if name in ("no_adopt", "zeros_merge"):
            dilated._adoptable = lambda *a, **k: False
        if name == "zeros_merge":
            dilated._ordered_units = lambda *a: (dilated.units(*a), 0)
        with torch.no_grad():
            err = float((f().float() - ref).norm() / ref.norm())
            t = measure.time_ms(f, dev, warmup=3, iters=10)["median_ms"]
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                f()
                torch.cuda.synchronize()
            top = sorted(((e.device_time_total, e.count, e.key[:60]) for e in p.key_averages()
                          if e.device_time_total > 0), reverse=True)[:6]
        res[f"{S}_{name}"] = dict(ms=t, err=err, top=[(round(a / 1e3, 3), c, n) for a, c, n in top])
        print(S, name, round(t, 3), f"{err:.1e}", res[f"{S}_{name}"]["top"][:4], flush=True)
    dilated._adoptable, dilated._ordered_units = orig_adopt, orig_order
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "probe_adopt.json"), "w"), indent=1)
