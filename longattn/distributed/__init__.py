"""Context parallelism over torch.distributed: ring attention, layouts,
packed documents across ranks, and dilated attention across ranks."""
from .layout import shard, shard_positions, unshard
from .ring import ring_attention
from .varlen import VarlenShard, ring_attention_varlen, shard_varlen, unshard_varlen

__all__ = ["ring_attention", "ring_attention_varlen", "shard", "unshard", "shard_positions", "shard_varlen",
           "unshard_varlen", "VarlenShard"]
