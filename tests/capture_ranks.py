"""The flex exchange captured in a CUDA graph, on ranks started by torchrun
(as a training job starts them): ``torchrun --nproc_per_node=2
tests/capture_ranks.py`` exits 0 when, on every rank, after one eager call
the exchange's forward and backward captured in one CUDA graph (NCCL
transfers and the side stream inside it) replay to the eager results, a
shape never called refuses to plan inside a capture (ValueError), and the
library's own graphs of the exchange's passes (``FlexExchangeTuning.graph_max_tokens``)
give the eager results on their eager, captured and replayed calls.
tests/test_flex_exchange.py runs it on GPU machines.

Before capturing, the eager call's graph is released: a graph kept alive
keeps the gradient accumulators of the leaves it made, each bound to the
stream current when it was made, and the capture then fails with
cudaErrorStreamCaptureImplicit in the autograd engine (any autograd graph
does this in torch; ``ring_flex_attention``'s docstring says it).
"""
import os
import sys

import torch
import torch.distributed as dist

import longattn
from longattn import masks


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    s, h, d = 16384, 8, 128
    mask = masks.local_global(1024, 128)
    g = torch.Generator("cuda").manual_seed(3)
    q, k, v, do = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    xs = [longattn.shard(x, layout="zigzag").requires_grad_() for x in (q, k, v)]
    dol = longattn.shard(do, layout="zigzag")

    def step():
        out = longattn.ring_flex_attention(*xs, mask_mod=mask, engine="exchange")
        out.backward(dol)
        return out

    out = step()
    want = [out.detach().clone()] + [x.grad.clone() for x in xs]
    # Release the eager call's graph before capturing: while it lives, so do the leaves' gradient
    # accumulators it made, and an accumulator runs on the stream current when it was made (here the
    # legacy default stream), which a capture cannot wait on (cudaErrorStreamCaptureImplicit).
    del out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for x in xs:
            x.grad = None
        step()
    torch.cuda.current_stream().wait_stream(side)
    for x in xs:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    bad = []
    for what, a, b in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in xs], want):
        err = float((a.float() - b.float()).norm() / b.float().norm())
        print(f"rank {rank} replay vs eager {what}: {err:.2e}", flush=True)
        if not err < 1e-2:  # FA4's dQ is summed with atomics: replays differ in the last bits
            bad.append(what)
    half = [x.detach()[:, : x.shape[1] // 2].contiguous() for x in xs]
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            longattn.ring_flex_attention(*half, mask_mod=mask, engine="exchange")
        bad.append("a new shape planned inside a capture without ValueError")
    except ValueError as e:
        if "before capturing" not in str(e):
            bad.append(f"ValueError without the fix: {e}")
    print(f"rank {rank} new shape inside a capture: {'refused' if not bad else bad}", flush=True)
    # the library replaying the exchange's passes from its own graphs (FlexExchangeTuning.graph_max_tokens):
    # eager, captured on every rank, replayed; each call as the eager one
    from longattn import tuning
    from longattn.flex import exchange_run

    auto = tuning.FlexExchangeTuning(graph_max_tokens=1 << 30)
    for i in range(3):
        ys = [x.detach().clone().requires_grad_() for x in xs]
        o = longattn.ring_flex_attention(*ys, mask_mod=mask, engine="exchange", tuning=auto)
        o.backward(dol)
        for what, a, b in zip(("out", "dq", "dk", "dv"), [o.detach()] + [y.grad for y in ys], want):
            err = float((a.float() - b.float()).norm() / b.float().norm())
            print(f"rank {rank} pass graphs call {i} vs eager {what}: {err:.2e}", flush=True)
            if not err < 1e-2:
                bad.append(f"pass graphs call {i} {what}")
    kept = sorted(key[0][0] for key in exchange_run.PASS_GRAPHS.graphs)
    if kept != ["bwd", "fwd"]:
        bad.append(f"pass graphs kept {kept}")
    exchange_run.PASS_GRAPHS.clear()
    # the graphs hold NCCL work of the group: destroyed before it is
    del graph, out
    torch.cuda.synchronize()
    dist.barrier(device_ids=[torch.cuda.current_device()])
    print(f"rank {rank} barrier passed", flush=True)
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank} FAILED: {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
