"""A small LongNet-style decoder LM: token embedding, pre-norm blocks of
MultiheadDilatedAttention + MLP, tied output head; greedy generation with a
KV cache, on one device or with the prompt and the cache sharded over ranks."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..cache import KVCache
from ..distributed import checks
from ..distributed.layout import shard, shard_positions
from ..ops import dilated_attention
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
        q, k, v = self._qkv(x)
        return self._finish(x, self.attn.attention(q, k, v, is_causal=True))

    # generate() runs the attention between these two halves itself (sharded, or from a KV cache)
    def _qkv(self, x):
        return self.attn.project(self.ln1(x))

    def _finish(self, x, attn_out):
        x = x + self.drop(self.attn.output(attn_out))
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

    def _branches(self):
        att = self.blocks[0].attn.attention
        return att.segment_lengths, att.dilation_rates, att.softmax_scale, att.backend

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, *, seqlens=None, group=None) -> torch.Tensor:
        """Greedy decoding with a KV cache per block (:class:`longattn.KVCache`).

        Args:
            tokens: ``(batch, seqlen)`` prompts, the same on every rank; rows
                shorter than ``seqlen`` are right-padded (any id in range).
            max_new_tokens: tokens to generate per row.
            seqlens: real prompt length of each row (``(batch,)`` ints, >= 1);
                default ``seqlen``.
            group: a ProcessGroup: context-parallel inference. The prompt is sharded
                contiguously over the group (prefill with
                ``dilated_attention(..., group=group)``, whose segment lengths must
                divide the shard length or be multiples of it), each rank keeps
                the K/V of its positions (:meth:`KVCache.from_prefill`), and each
                new token's K/V goes to one rank; every rank returns the same tokens.

        Returns:
            ``(batch, max_new_tokens)`` int64 token ids: row b continues its first
            ``seqlens[b]`` tokens. The same tokens as taking the argmax of
            ``forward`` on the growing sequence. Attention is dilated as the model
            says, dense (no branch logic) when its one branch is rate 1 and
            covers ``max_seqlen``. Call ``model.eval()`` first when it has dropout.
        """
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (batch, seqlen) int64 tensor, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        b, s = tokens.shape
        lens = [s] * b if seqlens is None else [int(x) for x in (seqlens.tolist() if isinstance(seqlens, torch.Tensor)
                                                                   else seqlens)]
        if len(lens) != b or any(not 1 <= n <= s for n in lens):
            raise ValueError(f"seqlens must hold {b} lengths in [1, {s}], got {lens}")
        if max(lens) + max_new_tokens > self.max_seqlen:
            raise ValueError(f"prompt ({max(lens)}) + max_new_tokens ({max_new_tokens}) exceeds max_seqlen "
                             f"({self.max_seqlen}); build the model with a larger max_seqlen")
        segs, rates, scale, backend = self._branches()
        dense = len(segs) == 1 and rates[0] == 1 and segs[0] >= self.max_seqlen
        branches = {} if dense else dict(segment_lengths=segs, dilation_rates=rates)
        g = None if group is None else checks.resolve_group(group)
        dev = tokens.device

        # prefill: this rank's shard of every row, all of it on one device
        local = tokens if g is None else shard(tokens, group=g)
        pos = torch.arange(s, device=dev) if g is None else shard_positions(s, group=g, device=dev)
        x = self.tok(local) + self.pos(pos)
        caches = []
        for blk in self.blocks:
            q, k, v = blk._qkv(x)
            a = dilated_attention(q, k, v, segment_lengths=segs, dilation_rates=rates, causal=True,
                                  softmax_scale=scale, backend=backend, group=g)
            caches.append(KVCache.from_prefill(k, v, seqlens=lens, group=g, reserve=max_new_tokens))
            x = blk._finish(x, a)
        # the last real token of each row lives on one rank: gather those rows
        last = torch.zeros(b, x.shape[-1], dtype=x.dtype, device=dev)
        p0 = int(pos[0])
        for row, n in enumerate(lens):
            if p0 <= n - 1 < p0 + x.shape[1]:
                last[row] = x[row, n - 1 - p0]
        if g is not None:
            dist.all_reduce(last, group=g)  # one rank holds each row; the others add zeros
        nxt = self.head(self.ln_f(last)).argmax(-1)

        out = [nxt]
        for step in range(1, max_new_tokens):
            x = self.tok(nxt[:, None]) + self.pos(torch.tensor([n + step - 1 for n in lens], device=dev))[:, None]
            for blk, cache in zip(self.blocks, caches):
                q, k, v = blk._qkv(x)
                x = blk._finish(x, cache.attend(q, k_new=k, v_new=v, softmax_scale=scale, backend=backend,
                                                **branches))
            nxt = self.head(self.ln_f(x[:, 0])).argmax(-1)
            out.append(nxt)
        return torch.stack(out, 1)
