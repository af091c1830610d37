"""Context parallelism over torch.distributed: ring attention, layouts,
packed documents across ranks, and dilated attention across ranks."""
from .layout import shard, shard_positions, unshard
from .ring import ring_attention

__all__ = ["ring_attention", "shard", "unshard", "shard_positions"]
