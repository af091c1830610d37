"""Ulysses head parallelism (the all-to-all of DeepSpeed-Ulysses) and the
layout of the Ulysses x ring hybrid over a 2-D mesh.

Ulysses: every rank holds a shard of the sequence with every head. One
all-to-all gives each rank the whole sequence (every rank's shard, put back in
sequence order) for nheads/p query heads and the kv heads they read; the local
attention runs on that; a second all-to-all returns each rank its shard of the
output for every head. Each all-to-all moves (p-1)/p of the local q (or out)
and k/v per rank, whatever p is; the backward is the same exchanges
transposed, so gradients go back the way the inputs came.

Per tensor and pass: one copy lays the send buffer out (rank j's block of
its heads contiguous), one all-to-all (PyTorch's functional collective, so
``torch.compile`` traces it), and on the receiving side a view of the whole
sequence (one contiguous shard per rank, batch 1) or one copy; the outputs
go back into their heads with one copy. The backward is written out (an
autograd Function), not derived by autograd through views, which would
zero-fill and sum a full-size buffer per slice. :func:`ulysses` pipelines a
call over groups of heads (:class:`longattn.tuning.UlyssesTuning`): group c's attention runs
while group c+1's inputs and group c-1's outputs travel, never more groups
at once, and every buffer goes as soon as it has served (send buffers at
their wait, received inputs once the local call has them or saved them,
received outputs once in place): what lives through the backward is what
the local call saves, the head-split inputs and its out and lse.

GQA/MQA (:class:`HeadPlan`): rank r attends with query heads [r m, (r+1) m),
m = nheads/p, and receives exactly the kv heads those read (kv head of query
head h: h // (nheads/nheads_kv)): nheads_kv/p each when p divides nheads_kv;
one each when nheads_kv divides p (a kv head goes to the p/nheads_kv ranks
that read it); otherwise a kv head read by two ranks' query heads goes to both.
Where the received kv heads do not serve the local query heads as plain GQA
(the last case), they are expanded locally after the exchange, never before.

The hybrid over a mesh of u (ulysses) x r (ring) ranks: the sequence is split
by the ring layout over the r ring ranks (:mod:`longattn.distributed.layout`),
and each ring shard cut into u contiguous pieces over its ulysses group. The
all-to-all inside the ulysses group rebuilds the ring shard for nheads/u
heads, the ring runs across the ring group, and the all-to-all returns the
pieces. Packed documents likewise: the ring shard of ``shard_varlen``, padded
at its end to a multiple of u, cut into u pieces.

Modules: :mod:`.heads` (head plans), :mod:`.exchange` (the all-to-alls and
their wire format), :mod:`.pipeline` (the pipelined call, :func:`ulysses`),
:mod:`.mesh` (packed documents' rows and the hybrid's layout). The local op
is :class:`longattn.distributed.local.LocalOp`, the ring's protocol.
"""
from .exchange import Exchange, heads_to_seq, lse_to_seq, seq_to_heads
from .heads import HeadPlan, check_heads
from .mesh import (MESH_DIMS, mesh_groups, mesh_varlen_length, packed_rows, pad_rows, shard_for_mesh,
                   shard_positions_for_mesh, shard_varlen_for_mesh, unshard_for_mesh, unshard_varlen_for_mesh)
from .pipeline import ulysses

__all__ = ["Exchange", "HeadPlan", "MESH_DIMS", "check_heads", "heads_to_seq", "lse_to_seq", "mesh_groups",
           "mesh_varlen_length", "packed_rows", "pad_rows", "seq_to_heads", "shard_for_mesh",
           "shard_positions_for_mesh", "shard_varlen_for_mesh", "ulysses", "unshard_for_mesh",
           "unshard_varlen_for_mesh"]
