"""Attention modules over the functional ops."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .. import ops as F_
from .._validation import check_dilation


class DilatedAttention(nn.Module):
    """LongNet dilated attention over (batch, seqlen, nheads, headdim) tensors.

    ``forward(q, k, v, is_causal=None)``; ``is_causal`` overrides the default
    ``causal`` given at construction. See :func:`longattn.dilated_attention`.
    """

    def __init__(self, segment_lengths: Sequence[int], dilation_rates: Sequence[int],
                 softmax_scale: Optional[float] = None, causal: bool = False, backend: str = "auto"):
        super().__init__()
        self.segment_lengths, self.dilation_rates = check_dilation(segment_lengths, dilation_rates)
        self.softmax_scale, self.causal, self.backend = softmax_scale, causal, backend

    def forward(self, q, k, v, is_causal: Optional[bool] = None):
        return F_.dilated_attention(q, k, v, segment_lengths=self.segment_lengths, dilation_rates=self.dilation_rates,
                                    causal=self.causal if is_causal is None else is_causal,
                                    softmax_scale=self.softmax_scale, backend=self.backend)

    def extra_repr(self) -> str:
        return f"segment_lengths={self.segment_lengths}, dilation_rates={self.dilation_rates}, causal={self.causal}"


class MultiheadDilatedAttention(nn.Module):
    """Drop-in multi-head layer with LongNet dilated attention (batch first).

    ``forward(query, key=None, value=None, is_causal=False, need_weights=False) -> (out, None)``
    with query/key/value ``(batch, seqlen, embed_dim)``; ``key`` defaults to
    ``query`` and ``value`` to ``key``, so ``layer(x)`` is self-attention (as
    ``layer(x, x, x)``). Projections q/k/v/out,
    GQA through ``num_kv_heads``, and the MAGNETO sub-layer norm before the
    output projection (as in LongNet), with xavier-normal init of gain
    ``gamma_init`` on the value and output projections.

    ``dropout`` on attention probabilities is not offered: the branches are
    merged by their softmax denominators and the backward recomputes each
    branch's probabilities from the merged lse, which dropout masks would
    break. A non-zero value raises at construction instead of being ignored.
    """

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths: Sequence[int],
                 dilation_rates: Sequence[int], *, num_kv_heads: Optional[int] = None, dropout: float = 0.0,
                 bias: bool = True, layer_norm: bool = True, layer_norm_eps: float = 1e-5, gamma_init: float = 1.0,
                 device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if dropout != 0.0:
            raise ValueError(
                f"dropout={dropout}: attention-probability dropout is not supported by the dilated attention "
                "backends (branches merge by lse and the backward recomputes probabilities); use dropout=0.0 "
                "and apply dropout to the layer output instead")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        kv_dim = self.head_dim * num_kv_heads
        fk = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **fk)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **fk) if layer_norm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.attention = DilatedAttention(segment_lengths, dilation_rates)
        self.gamma_init = gamma_init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.q_proj.weight)
        nn.init.xavier_normal_(self.k_proj.weight)
        nn.init.xavier_normal_(self.v_proj.weight, gain=self.gamma_init)
        nn.init.xavier_normal_(self.out_proj.weight, gain=self.gamma_init)
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, query, key=None, value=None, is_causal: bool = False, need_weights: bool = False):
        if need_weights:
            raise ValueError("need_weights=True: attention weights are never materialised; pass need_weights=False")
        q, k, v = self.project(query, key, value)
        return self.output(self.attention(q, k, v, is_causal=is_causal)), None

    def project(self, query, key=None, value=None):
        """The q/k/v projections of ``forward``, split into heads: query, key,
        value ``(batch, seqlen, embed_dim)`` (``key`` defaults to ``query``,
        ``value`` to ``key``) -> q ``(batch, seqlen, num_heads, head_dim)``, k
        and v ``(batch, seqlen_kv, num_kv_heads, head_dim)``."""
        key = query if key is None else key
        value = key if value is None else value
        for x, n in ((query, "query"), (key, "key"), (value, "value")):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(f"{n} must be (batch, seqlen, {self.embed_dim}), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        b = query.shape[0]
        return (self.q_proj(query).view(b, query.shape[1], self.num_heads, self.head_dim),
                self.k_proj(key).view(b, key.shape[1], self.num_kv_heads, self.head_dim),
                self.v_proj(value).view(b, value.shape[1], self.num_kv_heads, self.head_dim))

    def output(self, attn_out):
        """The rest of ``forward`` after attention: heads merged, sub-layer
        norm, output projection. ``attn_out (batch, seqlen, num_heads,
        head_dim)`` -> ``(batch, seqlen, embed_dim)``."""
        x = attn_out.reshape(*attn_out.shape[:2], self.embed_dim)
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x)


class RingAttention(nn.Module):
    """Module form of :func:`longattn.ring_attention` (inputs are local shards)."""

    def __init__(self, causal: bool = False, softmax_scale: Optional[float] = None,
                 window_size: tuple[int, int] = (-1, -1), layout: str = "contiguous", backend: str = "auto",
                 group=None):
        super().__init__()
        self.causal, self.softmax_scale, self.window_size = causal, softmax_scale, window_size
        self.layout, self.backend, self.group = layout, backend, group

    def forward(self, q, k, v):
        from ..ops import ring_attention

        return ring_attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                              window_size=self.window_size, layout=self.layout, backend=self.backend,
                              group=self.group)
