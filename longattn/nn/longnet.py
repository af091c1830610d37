"""A small LongNet-style decoder LM: token embedding, pre-norm blocks of
MultiheadDilatedAttention + MLP, tied output head."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from .attention import MultiheadDilatedAttention


class Block(nn.Module):
    def __init__(self, dim, num_heads, segment_lengths, dilation_rates, num_kv_heads, mlp_ratio, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = MultiheadDilatedAttention(dim, num_heads, segment_lengths, dilation_rates,
                                              num_kv_heads=num_kv_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, is_causal=True)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class LongNetLM(nn.Module):
    """Causal language model with dilated attention.

    ``forward(tokens (B, S) int64, targets=None) -> (logits (B, S, vocab), loss or None)``.
    Token ids must lie in ``[0, vocab_size)``. Positions are learned embeddings
    up to ``max_seqlen``.
    """

    def __init__(self, vocab_size: int, dim: int = 256, depth: int = 4, num_heads: int = 4,
                 segment_lengths: Sequence[int] = (128, 256, 512), dilation_rates: Sequence[int] = (1, 2, 4),
                 *, num_kv_heads: Optional[int] = None, mlp_ratio: int = 4, max_seqlen: int = 2048,
                 dropout: float = 0.0):
        super().__init__()
        self.vocab_size, self.max_seqlen = vocab_size, max_seqlen
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_seqlen, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads, segment_lengths, dilation_rates, num_kv_heads, mlp_ratio,
                                          dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(f"tokens must be a (batch, seqlen) tensor of token ids, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must hold integer token ids (torch.long), got {tokens.dtype}")
        # nn.Embedding would fail with a bare IndexError (a device assert on CUDA); the
        # check reads two numbers back, so it is left out while torch.compile traces
        if tokens.numel() and not torch.compiler.is_compiling():
            lo, hi = (int(x) for x in torch.aminmax(tokens))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"tokens holds ids from {lo} to {hi}, outside [0, vocab_size) with vocab_size="
                                 f"{self.vocab_size}; map the ids into that range or build the model with "
                                 f"vocab_size > {hi}")
        b, s = tokens.shape
        if s > self.max_seqlen:
            raise ValueError(f"tokens has seqlen {s} > max_seqlen {self.max_seqlen}; build the model with a larger "
                             "max_seqlen")
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
