"""The transformers ``Cache`` of context-parallel generation (see
:mod:`longattn.integrations.transformers`): imported on first use of
``longattn.integrations.transformers.ShardedCache``."""
from __future__ import annotations

import functools

from transformers.cache_utils import Cache, CacheLayerMixin

from .. import context_parallel as _cp
from ..distributed.layout import check_layout

__all__ = ["ShardedCache"]


class ShardedLayer(CacheLayerMixin):
    """One layer of a :class:`ShardedCache`: a :class:`longattn.KVCache` built by
    the layer's first attention call (the prefill), appended by ``update``."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner):
        super().__init__()
        self.owner, self.kv = owner, None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv is not None:
            self.kv.append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        # The attention call finds the layer here (the model passes it the
        # returned tensors, not the cache): the new tokens only, never the
        # cache's parts.
        key_states._longattn_layer = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.kv is None else self.kv.layout.seqlens[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv, self.is_initialized = None, False

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("a ShardedCache cannot be reordered, cropped or re-batched (beam search, "
                                  "assisted decoding); use greedy or sampled generation")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

class ShardedCache(Cache):
    """A transformers ``Cache`` for context-parallel generation with
    ``attn_implementation="longattn_ring"`` or ``"longattn_dilated"``: each
    layer is a :class:`longattn.KVCache` sharded over ``group`` (default: the
    whole world), filled by the prefill and appended to one rank per token
    (see the module docstring). Only those two attention implementations
    read it: ``update`` returns the new tokens alone, so ``"sdpa"`` or
    ``"eager"`` would attend to nothing else (``"longattn"`` raises).

    Args:
        group: ProcessGroup (default WORLD; torch.distributed must be
            initialised); a group of one rank works too.
        layout: how a prompt given whole is split for the cache (``"zigzag"``
            or ``"contiguous"``; any length); a sharded batch brings its own.
        reserve: tokens to be generated, preallocated (otherwise the parts
            grow when full, a copy each time).
        block: tokens that go to one rank before the next is chosen.
    """

    def __init__(self, group=None, *, layout: str = "zigzag", reserve: int = 0, block: int = 256):
        check_layout(layout)
        self.group = _cp.resolve_group(group)
        self.layout, self.reserve, self.block = layout, reserve, block
        super().__init__(layer_class_to_replicate=functools.partial(ShardedLayer, self))
