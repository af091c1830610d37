"""Attention patterns of the flex configs (configs.FlexConfig) as FlexAttention
``mask_mod`` s, and their visible pairs counted exactly.

Configs of kind "flex": longattn.flex_attention against torch's compiled
FlexAttention and dense cuDNN on one device; for `dist`, ring_flex_attention
against torch's context_parallel running FlexAttention (K/V all-gathered).
"""
from __future__ import annotations

import functools

import torch

from .configs import Config


def _flex_doc_lengths(cfg: Config) -> list[int]:
    total, lens, i = cfg.seqlen, [], 0
    while sum(lens) < total:
        lens.append(min(cfg.pattern_args[i % len(cfg.pattern_args)], total - sum(lens)))
        i += 1
    return lens


def _flex_layout(cfg: Config) -> torch.Tensor:
    block, band, density, seed = cfg.pattern_args
    n = -(-cfg.seqlen // block)
    i = torch.arange(n)
    lay = (i[:, None] - i[None, :]).abs() <= band
    lay |= (i[:, None] == 0) | (i[None, :] == 0)
    return lay | (torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) < density)


def flex_mask(cfg: Config, dev):
    """The config's mask_mod (tensors on ``dev``), and-ed with causal when ``cfg.causal``."""
    from longattn import masks

    p, a = cfg.pattern, cfg.pattern_args
    if p == "local_global":
        m = masks.local_global(a[0], a[1])
    elif p == "causal_document":
        cu = torch.tensor([0] + _flex_doc_lengths(cfg)).cumsum(0)
        m = masks.and_(masks.causal(), masks.document(cu_seqlens=cu.to(dev)))
    elif p == "prefix_lm":
        m = masks.prefix_lm(int(cfg.seqlen * a[0]))
    else:
        m = masks.block_sparse(_flex_layout(cfg).to(dev), a[0])
    return masks.and_(masks.causal(), m) if cfg.causal else m


@functools.lru_cache(maxsize=64)
def flex_pairs(cfg: Config) -> float:
    """Visible (query, key) pairs of the pattern per (batch, head), counted exactly."""
    s, a = cfg.seqlen, cfg.pattern_args
    q = torch.arange(s, dtype=torch.float64)
    if cfg.causal:
        return _flex_pairs_by_rows(cfg)
    if cfg.pattern == "block_sparse":
        sizes = torch.full((-(-s // a[0]),), float(a[0]), dtype=torch.float64)
        sizes[-1] = s - a[0] * (len(sizes) - 1)
        return float((_flex_layout(cfg).double() * sizes[:, None] * sizes[None, :]).sum())
    if cfg.pattern == "local_global":
        w, n = a
        lo, hi = (q - w).clamp(min=0), (q + w).clamp(max=s - 1)
        band_in_globals = (hi.clamp(max=n - 1) - lo + 1).clamp(min=0)
        per_row = torch.where(q < n, torch.tensor(float(s)), (hi - lo + 1) + n - band_in_globals)
        return float(per_row.sum())
    if cfg.pattern == "causal_document":
        return float(sum(n * (n + 1) / 2 for n in _flex_doc_lengths(cfg)))
    return float(torch.maximum(q + 1, torch.tensor(float(int(s * a[0])))).sum())  # prefix_lm


def _flex_pairs_by_rows(cfg: Config, rows: int = 1024) -> float:
    """The mask evaluated in row chunks (on CUDA when present): patterns without a closed form."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, s, total = flex_mask(cfg, dev), cfg.seqlen, 0
    k = torch.arange(s, device=dev).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    for r0 in range(0, s, rows):
        q = torch.arange(r0, min(s, r0 + rows), device=dev).view(1, 1, -1, 1)
        total += int(m(zero, zero, q, k).expand(1, 1, q.shape[2], s).sum())
    return float(total)


def flex_fa4_step(cfg: Config, dev):
    """(executor, step) of a flex config on one GPU as ``flex_attention`` plans it for FA4
    (``longattn.flex.pieces.single_executor``, bf16 inputs); ``step(graphed=False)`` runs one
    fwd+bwd through ``fa4.Fa4Flex`` (``graphed``: its passes replayed from CUDA graphs), clears the
    inputs' gradients and returns (out, (dq, dk, dv)). For the scripts that take a call apart (host time, graph kernels)."""
    from ..flex import fa4, pieces
    from .single import make_inputs

    q, k, v = make_inputs(cfg, dev, torch.bfloat16, True)
    do = torch.randn_like(q)
    run = pieces.single_executor(q, k, flex_mask(cfg, dev), cfg.head_dim ** -0.5)

    def step(graphed: bool = False):
        out = fa4.Fa4Flex.apply(q, k, v, run, graphed)[0]
        out.backward(do)
        grads = q.grad, k.grad, v.grad
        q.grad = k.grad = v.grad = None
        return out.detach(), grads
    return run, step
