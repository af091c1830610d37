"""Context parallelism over torch.distributed: the ring algorithm and its
parts (planning, transport, accumulators), layouts of sharded sequences and
packed documents, and dilated attention over ranks. The public ops built on
them live in :mod:`longattn.ops` (``ring_attention``, ``ring_attention_varlen``,
``dilated_attention(..., group=...)``)."""
from .layout import shard, shard_positions, unshard
from .transport import use_transport
from .varlen_layout import VarlenShard, shard_varlen, unshard_varlen

__all__ = ["shard", "unshard", "shard_positions", "shard_varlen", "unshard_varlen", "VarlenShard", "use_transport"]
