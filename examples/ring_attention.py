# Ring attention: each rank holds one shard of the sequence; K/V blocks travel
# around the ring of ranks. One process per GPU (NCCL), or per CPU rank (gloo):
#   torchrun --nproc_per_node=2 examples/ring_attention.py
import os

import torch
import torch.distributed as dist

import longattn

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
device, dtype, seqlen = ("cuda", torch.bfloat16, 65536) if cuda else ("cpu", torch.float32, 2048)

# Every rank draws the same full sequence here, only to check the result below;
# a real model builds its own shard (tokens and positions from shard_positions).
torch.manual_seed(0)
q_full = torch.randn(1, seqlen, 16, 64, device=device, dtype=dtype)
k_full = torch.randn(1, seqlen, 4, 64, device=device, dtype=dtype)  # GQA: only the 4 kv heads travel
v_full = torch.randn_like(k_full)

layout = "zigzag"  # each rank holds an early and a late chunk: equal causal work per rank
q, k, v = (longattn.shard(x, layout=layout).requires_grad_() for x in (q_full, k_full, v_full))
pos = longattn.shard_positions(seqlen, layout=layout, device=device)  # global positions of q's rows (RoPE)
out = longattn.ring_attention(q, k, v, causal=True, layout=layout)
out.float().square().mean().backward()  # gradients of this rank's shard: q.grad, k.grad, v.grad

# Check against attention over the whole sequence on one device.
out_full = longattn.unshard(out.detach(), layout=layout)
if rank == 0:
    ref = longattn.attention(q_full, k_full, v_full, causal=True)
    err = ((out_full.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"{dist.get_world_size()} ranks, {seqlen} tokens ({q.shape[1]} per rank, positions "
          f"{pos[:2].tolist()}...): relative difference from one-device attention {err:.1e}")
dist.destroy_process_group()
