"""The public ops: ``torch.library`` custom ops (fake kernels for
``torch.compile``, autograd unpacked by name) and the thin functions that
validate inputs, decide once how a call runs, and document it."""
from .attention import attention
from .decode import decode_attention, dilated_decode_attention
from .dilated import dilated_attention
from .flex import explain_flex, flex_attention, ring_flex_attention
from .packed_cp import packed_attention
from .hybrid import context_parallel_attention, context_parallel_attention_varlen
from .ring import ring_attention
from .ring_varlen import ring_attention_varlen
from .ulysses import ulysses_attention, ulysses_attention_varlen
from .varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "dilated_attention", "ring_attention", "ring_attention_varlen",
           "ulysses_attention", "ulysses_attention_varlen", "context_parallel_attention",
           "context_parallel_attention_varlen", "explain_flex", "flex_attention", "ring_flex_attention",
           "decode_attention", "dilated_decode_attention", "packed_attention"]
