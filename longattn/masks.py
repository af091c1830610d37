"""Attention patterns as FlexAttention ``mask_mod`` functions on GLOBAL positions.

Each factory returns ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True:
query ``q_idx`` sees key ``kv_idx``) with FlexAttention's signature, for
:func:`longattn.flex_attention` on one device and
:func:`longattn.ring_flex_attention` across ranks alike: the ring passes the
global positions of each rank's shard, so a pattern is written once.

The functions are elementwise: they work on scalars (FlexAttention's vmap and
compiled kernels) and on broadcast index tensors (how longattn evaluates a mask
per block). Tensors a mask holds (document ids, global-token flags, a block
layout) must be on the device of q.

Each mask carries ``pattern_key`` (its kind and parameters, tensors by
content): longattn caches the block masks it builds per pattern, so calling
``masks.sliding_window(256)`` again in every training step reuses them. A
function of your own is cached by identity: build it once.

Combine with :func:`and_` / :func:`or_`, e.g. a causal sliding window over
packed documents: ``and_(causal(), sliding_window(1024, 0), document(cu_seqlens=cu))``.

Each mask built here (and every ``and_`` / ``or_`` of them) also carries
``fa4``, its FlashAttention-4 form (:mod:`longattn.flex.blocks`): with it,
:func:`longattn.flex_attention` runs FA4's kernels with the pattern compiled
in and its exact block sparsity where flash-attn-4 runs (see
:func:`longattn.ops.flex.explain_flex`); a function of your own (``fa4`` None)
runs on FlexAttention.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import torch

from .flex import blocks
from .flex.checks import check_mod

__all__ = ["causal", "sliding_window", "document", "prefix_lm", "local_global", "block_sparse", "dilated_branch",
           "dilated", "and_", "or_"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _keyed(fn, *key, fa4: Optional[blocks.Form] = None) -> MaskMod:
    fn.pattern_key = key
    fn.fa4 = fa4
    return fn


def _digest(t: torch.Tensor) -> tuple:
    """A tensor by content (shape, dtype, SHA-1 of its bytes): two masks built
    from equal tensors share cached block masks (and ranks can compare them)."""
    raw = t.detach().cpu().contiguous().flatten().view(torch.uint8)
    return (tuple(t.shape), str(t.dtype), hashlib.sha1(raw.numpy().tobytes()).hexdigest())


def _check_int(x, name: str, lo: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    return x


def causal() -> MaskMod:
    """Key at or before the query: ``kv_idx <= q_idx``."""
    def mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    return _keyed(mask, "causal", fa4=blocks.form("causal"))


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """``q_idx - left <= kv_idx <= q_idx + right`` (``-1``: unbounded on that
    side), as flash-attn's ``window_size=(left, right)``: ``sliding_window(w, 0)``
    is the causal sliding window of w keys before the query (and itself)."""
    left, right = _check_int(left, "left", -1), _check_int(right, "right", -1)

    def mask(b, h, q_idx, kv_idx):
        ok = q_idx >= 0
        if left >= 0:
            ok = ok & (q_idx - kv_idx <= left)
        if right >= 0:
            ok = ok & (kv_idx - q_idx <= right)
        return ok
    return _keyed(mask, "sliding_window", left, right, fa4=blocks.form("window", left, right))


def document(doc_ids: Optional[torch.Tensor] = None, *, cu_seqlens: Optional[torch.Tensor] = None) -> MaskMod:
    """Packed sequences: a query sees only keys of its own document.

    Give ``doc_ids`` (``(seqlen,)`` or per batch row ``(batch, seqlen)``, any
    integer ids, one per position) or ``cu_seqlens`` (int, ``(ndocs + 1,)``,
    cumulative lengths from 0 to seqlen, as :func:`longattn.attention_varlen`).
    Combine with :func:`causal` for causal documents.
    """
    if (doc_ids is None) == (cu_seqlens is None):
        raise ValueError("document(): give exactly one of doc_ids or cu_seqlens")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D integer tensor of cumulative lengths (ndocs + 1 entries)")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        if int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()):
            raise ValueError("cu_seqlens must start at 0 and be non-decreasing")
        doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point():
        raise ValueError("doc_ids must be an integer tensor (seqlen,) or (batch, seqlen)")
    ids = doc_ids
    if ids.dim() == 1:
        def mask(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
    else:
        def mask(b, h, q_idx, kv_idx):
            return ids[b, q_idx] == ids[b, kv_idx]
    return _keyed(mask, "document", _digest(ids), fa4=blocks.form("document", tensors=(ids,)))


def prefix_lm(prefix_len) -> MaskMod:
    """Prefix-LM: every query sees the whole prefix (bidirectional), the rest
    is causal: ``kv_idx < prefix_len or kv_idx <= q_idx``. ``prefix_len``: an
    int, or a ``(batch,)`` integer tensor (one prefix per batch row)."""
    if isinstance(prefix_len, torch.Tensor):
        if prefix_len.dim() != 1 or prefix_len.is_floating_point():
            raise ValueError("prefix_len must be an int or a (batch,) integer tensor")
        n = prefix_len

        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < n[b]) | (kv_idx <= q_idx)
        return _keyed(mask, "prefix_lm", _digest(n), fa4=blocks.form("prefix_rows", tensors=(n,)))
    p = _check_int(prefix_len, "prefix_len", 0)

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < p) | (kv_idx <= q_idx)
    return _keyed(mask, "prefix_lm", p, fa4=blocks.form("prefix", p))


def local_global(window: int, global_tokens) -> MaskMod:
    """Longformer / BigBird (ITC): a local band ``|q_idx - kv_idx| <= window``
    plus global tokens that see and are seen by every position.

    ``global_tokens``: an int n (the first n positions, e.g. a CLS block) or a
    ``(seqlen,)`` bool tensor flagging them. Add BigBird's random blocks with
    ``or_(local_global(...), block_sparse(random_layout, block))``; make it
    causal with ``and_(causal(), local_global(...))``.
    """
    w = _check_int(window, "window", 0)
    if isinstance(global_tokens, torch.Tensor):
        if global_tokens.dtype != torch.bool or global_tokens.dim() != 1:
            raise ValueError("global_tokens must be an int or a (seqlen,) bool tensor")
        g = global_tokens

        def mask(b, h, q_idx, kv_idx):
            return ((q_idx - kv_idx).abs() <= w) | g[q_idx] | g[kv_idx]
        return _keyed(mask, "local_global", w, _digest(g), fa4=blocks.form("local_global_flags", w, tensors=(g,)))
    n = _check_int(global_tokens, "global_tokens", 0)

    def mask(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() <= w) | (q_idx < n) | (kv_idx < n)
    return _keyed(mask, "local_global", w, n, fa4=blocks.form("local_global", w, n))


def block_sparse(layout: torch.Tensor, block_size: int) -> MaskMod:
    """Block-sparse attention from a layout matrix: query block i sees key
    block j when ``layout[i, j]`` (``(n_q_blocks, n_kv_blocks)`` bool), or per
    query head ``layout[h, i, j]`` (``(nheads, n_q_blocks, n_kv_blocks)``).
    Block i holds positions ``[i * block_size, (i + 1) * block_size)``."""
    bs = _check_int(block_size, "block_size", 1)
    if not isinstance(layout, torch.Tensor) or layout.dtype != torch.bool or layout.dim() not in (2, 3):
        raise ValueError("layout must be a bool tensor (n_q_blocks, n_kv_blocks) or (nheads, n_q_blocks, n_kv_blocks)")
    lay = layout
    if lay.dim() == 2:
        def mask(b, h, q_idx, kv_idx):
            return lay[q_idx // bs, kv_idx // bs]
    else:
        def mask(b, h, q_idx, kv_idx):
            return lay[h, q_idx // bs, kv_idx // bs]
    return _keyed(mask, "block_sparse", bs, _digest(lay), fa4=blocks.form("layout", bs, tensors=(lay,)))


def dilated_branch(segment_length: int, dilation_rate: int, *, causal: bool = False) -> MaskMod:
    """One LongNet branch (w, r): the sequence is cut into segments of w; in
    each, query head h keeps the positions p with ``(p % w) % r == h % r``;
    kept queries see the kept keys of their segment (causal: not later ones).
    The same rows as :func:`longattn.dilated_attention`'s branch."""
    w = _check_int(segment_length, "segment_length", 1)
    r = _check_int(dilation_rate, "dilation_rate", 1)

    def mask(b, h, q_idx, kv_idx):
        off = h % r
        ok = (q_idx // w == kv_idx // w) & ((q_idx % w) % r == off) & ((kv_idx % w) % r == off)
        if causal:
            ok = ok & (kv_idx <= q_idx)
        return ok
    return _keyed(mask, "dilated_branch", w, r, bool(causal), fa4=blocks.form("dilated_branch", w, r, bool(causal)))


def dilated(segment_lengths: Sequence[int], dilation_rates: Sequence[int], *, causal: bool = False) -> MaskMod:
    """LongNet dilated attention as one mask: the union of its branches.

    One softmax over the union of the keys the branches give. LongNet's
    :func:`longattn.dilated_attention` also takes one softmax over the branches'
    keys, but a key two branches both give (e.g. the query's own segment start
    in every branch) enters it once per branch; a mask can give a key only
    once. So the two agree exactly where no (query, key) pair is in two
    branches, and differ (slightly) elsewhere: the mask version is the
    "set union" variant.
    """
    if len(segment_lengths) != len(dilation_rates) or not segment_lengths:
        raise ValueError("segment_lengths and dilation_rates must be non-empty and of the same length")
    return or_(*(dilated_branch(w, r, causal=causal) for w, r in zip(segment_lengths, dilation_rates)))


def _combine(mods, op: str) -> MaskMod:
    if not mods or not all(callable(m) for m in mods):
        raise TypeError(f"{op}_() takes one or more mask_mod functions")
    for i, m in enumerate(mods):
        check_mod(m, "mask_mod", f"{op}_() argument {i + 1}")
    mods = tuple(mods)
    if op == "and":
        def mask(b, h, q_idx, kv_idx):
            ok = mods[0](b, h, q_idx, kv_idx)
            for m in mods[1:]:
                ok = ok & m(b, h, q_idx, kv_idx)
            return ok
    else:
        def mask(b, h, q_idx, kv_idx):
            ok = mods[0](b, h, q_idx, kv_idx)
            for m in mods[1:]:
                ok = ok | m(b, h, q_idx, kv_idx)
            return ok
    mask.fa4 = blocks.combine(op, mods)  # None where a part is a function of your own
    keys = [getattr(m, "pattern_key", None) for m in mods]
    if all(k is not None for k in keys):  # a user function among them: cached by identity
        mask.pattern_key = (op, *keys)
    return mask


def and_(*mods: MaskMod) -> MaskMod:
    """A key is visible when every mask allows it."""
    return _combine(mods, "and")


def or_(*mods: MaskMod) -> MaskMod:
    """A key is visible when any mask allows it."""
    return _combine(mods, "or")
