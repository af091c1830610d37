"""The mask hooks (transformers' ``AttentionMaskInterface``) and what they
hand the attention calls.

transformers builds the mask once per forward and passes whatever the hook
returns to every attention call as ``attention_mask``. For ``"longattn"`` and
``"longattn_dilated"`` the hook returns None (dense attention) or
:class:`Documents`: the real tokens as packed documents, computed once per
forward, with the causal/window pattern read from transformers' mask
function. ``"longattn_ring"`` takes its documents from the sharded batch.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Pattern:
    """What a transformers mask function describes, when longattn can run it."""

    causal: Optional[bool] = None
    window: Optional[int] = None  # causal sliding window: kv > q - window
    bidirectional_window: Optional[int] = None  # |q - kv| <= window
    packed: Optional[torch.Tensor] = None  # (batch, seq) document index of each token
    # Chunked attention (Llama 4's attention_chunk_size): (chunk_size, left
    # padding per row); a key is seen only in the query's chunk.
    chunk: Optional[tuple[int, torch.Tensor]] = None
    positions: Optional[torch.Tensor] = None  # (batch, seq) position ids the parts read, when packed


@dataclasses.dataclass(frozen=True)
class Documents:
    """Real tokens of a (batch, kv_len) document-id mask as packed documents.

    Queries are the last ``q_len`` key positions of each row (the cache holds
    the tokens up to the last query). ``q_idx``/``k_idx``: flat indices of
    real tokens in ``batch * q_len`` / ``batch * kv_len``; documents in the same
    order for both, ``cu_q``/``cu_k`` int32 (a document may have no query)."""

    q_len: int
    kv_len: int
    q_idx: torch.Tensor
    k_idx: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    packed: bool  # documents from position ids (not padding)
    holes: bool  # some row has padding between real tokens
    right_padded: bool  # every row: real tokens first, then padding; one document per row
    pattern: Optional[Pattern] = None


def unsupported(impl: str, what: str) -> ValueError:
    return ValueError(
        f"attn_implementation={impl!r}: this model's attention mask contains {what}, which longattn cannot "
        f"express (it runs causal or bidirectional attention, sliding windows, padding and packed documents); "
        f"use attn_implementation='sdpa' or 'flex_attention' for this model")


def chunk_error(impl: str) -> ValueError:
    return ValueError(f"attn_implementation={impl!r} does not run chunked attention (the model's "
                      f"attention_chunk_size, Llama 4); use attn_implementation='longattn' (one device) or 'sdpa'")


def mask_error(impl: str, mask) -> ValueError:
    shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
    return ValueError(
        f"attn_implementation={impl!r}: got a {shape} attention mask; longattn takes padding as a 2-D "
        f"(batch, seq) attention_mask and packed documents as position_ids or cu_seq_lens_q/k, and cannot run an "
        f"arbitrary 4-D mask: pass a 2-D mask, or use attn_implementation='sdpa' (or 'flex_attention') for "
        f"custom masks")


def read_pattern(fn, impl: str) -> Pattern:
    """Walk the closures transformers.masking_utils builds (and_masks of causal,
    sliding-window and packed-sequence parts) and return what they say; any
    other part (chunked attention, or_masks, block overlays, user functions)
    raises."""
    import transformers.masking_utils as mu

    found: dict = {}

    def visit(f):
        name = getattr(f, "__qualname__", type(f).__name__)
        if getattr(f, "__module__", None) != mu.__name__:
            raise unsupported(impl, f"a custom mask function ({name})")
        cells = dict(zip(f.__code__.co_freevars, (c.cell_contents for c in (f.__closure__ or ()))))
        if f is mu.causal_mask_function:
            found["causal"] = True
        elif f is mu.bidirectional_mask_function:
            found["causal"] = False
        elif name == "and_masks.<locals>.and_mask":
            for g in cells["mask_functions"]:
                visit(g)
        elif name == "sliding_window_overlay.<locals>.inner_mask":
            found["window"] = int(cells["sliding_window"])
        elif name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
            found["bidirectional_window"] = int(cells["sliding_window"])
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            found["packed"] = cells["packed_sequence_mask"]
        elif name == "chunked_overlay.<locals>.inner_mask":
            found["chunk"] = (int(cells["chunk_size"]), cells["left_padding"])
        elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            # Inside a document positions rise by 1, so the wrapped causal/window
            # function on positions equals itself on indices; chunks are cut on
            # the positions.
            found["positions"] = cells["position_ids"]
            visit(cells["mask_function"])
        else:
            raise unsupported(impl, f"the part {name!r} (e.g. image-token blocks)")

    visit(fn if fn is not None else mu.causal_mask_function)
    return Pattern(**found)


def make_documents(ids: torch.Tensor, q_len: int, packed: bool, pattern: Optional[Pattern] = None) -> Documents:
    """:class:`Documents` of a (batch, kv_len) int mask: 0 padding, equal
    positive ids one document within a row."""
    b, kv = ids.shape
    valid = ids > 0
    k_idx = torch.nonzero(valid.reshape(-1)).flatten()
    m = int(ids.max()) + 1
    key_doc = (k_idx // kv) * m + ids.reshape(-1)[k_idx].long()
    docs, k_counts = torch.unique_consecutive(key_doc, return_counts=True)
    qv = valid[:, kv - q_len:]
    q_idx = torch.nonzero(qv.reshape(-1)).flatten()
    q_rows, q_cols = q_idx // q_len, q_idx % q_len + (kv - q_len)
    q_doc = q_rows * m + ids[q_rows, q_cols].long()
    q_counts = torch.bincount(torch.searchsorted(docs, q_doc), minlength=docs.numel())
    cu = lambda c: torch.cat([c.new_zeros(1), c.cumsum(0)]).to(torch.int32).cpu()
    n = valid.sum(1)
    first = valid.float().argmax(1)
    last = kv - 1 - valid.flip(1).float().argmax(1)
    holes = bool(((n > 0) & (last - first + 1 != n)).any())
    right = (not packed) and bool(((n == 0) | ((first == 0) & (last == n - 1))).all())
    return Documents(q_len, kv, q_idx, k_idx, cu(q_counts), cu(k_counts), int(q_counts.max()), int(k_counts.max()),
                     packed, holes, right, pattern)


def _check_offsets(impl, q_length, kv_length, q_offset, kv_offset) -> None:
    q_offset = int(q_offset)
    if q_offset - int(kv_offset) != kv_length - q_length:
        raise ValueError(
            f"attn_implementation={impl!r}: the KV cache holds keys beyond the last query (kv_length={kv_length}, "
            f"q_offset={q_offset}: a static cache); use the default dynamic cache (no "
            f"cache_implementation='static'), or attn_implementation='sdpa'")


def local_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function=None, attention_mask: Optional[torch.Tensor] = None, *, impl: str = "longattn",
               **kwargs) -> Optional[Documents]:
    """transformers' mask hook for "longattn" / "longattn_dilated": None when
    every key is a real token of one sequence (dense attention); otherwise the
    :class:`Documents` of the padding mask or of the packed sequences, cut at
    the chunk edges under chunked attention."""
    pattern = read_pattern(mask_function, impl)
    if pattern.chunk is not None and impl != "longattn":
        raise chunk_error(impl)
    _check_offsets(impl, q_length, kv_length, q_offset, kv_offset)
    if pattern.packed is not None:
        ids, packed = (pattern.packed.expand(batch_size, -1) + 1).to(torch.int32).contiguous(), True
    elif attention_mask is not None:
        pad = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
        if pad.shape[-1] < kv_length:  # as transformers: keys past the 2-D mask are not keys
            pad = torch.nn.functional.pad(pad, (0, kv_length - pad.shape[-1]))
        ids, packed = pad.to(torch.int32), False
    elif pattern.chunk is not None:  # one document per row, cut into chunks below
        ids, packed = torch.ones(batch_size, kv_length, dtype=torch.int32, device=pattern.chunk[1].device), False
    else:
        return None
    if pattern.chunk is not None:
        ids = _chunked(ids, pattern, kv_offset)
    if not packed and bool((ids != 0).all()) and bool((ids == ids[:, :1]).all()):
        return None  # every key real, one document (one chunk) per row: dense
    return make_documents(ids, q_length, packed, pattern)


def _chunked(ids: torch.Tensor, pattern: Pattern, kv_offset: int) -> torch.Tensor:
    """Document ids cut at chunk edges: chunked attention is causal attention
    within documents of ``chunk_size`` tokens. The chunk of a token is as
    transformers' ``chunked_overlay`` computes it: (index - left padding) //
    chunk_size, on position ids where packed sequences remapped them."""
    size, left = pattern.chunk
    b, kv = ids.shape
    if pattern.positions is not None:
        pos = pattern.positions.expand(b, -1).to(ids.device).long()
    else:
        idx = torch.arange(kv, device=ids.device) + int(kv_offset)
        pos = idx[None, :] - left.to(ids.device).long().view(-1, 1)
    chunk = torch.div(pos, size, rounding_mode="floor").clamp_min(0)  # < 0 only on left padding
    span = int(chunk.max()) + 1
    # Real tokens: (document, chunk) as one id, increasing along each row as both are.
    return torch.where(ids > 0, ids.long() * span + chunk, 0)


@dataclasses.dataclass(frozen=True)
class RingMask:
    """What ``"longattn_ring"``'s mask hook hands a layer beyond None (the
    sharded batch carries the documents). ``chunk``: chunked attention's
    chunk size (Llama 4's local layers): the ring cuts the sharded documents
    (or dense rows) at every multiple of it of their positions, as
    transformers' ``chunked_overlay`` does unsharded. ``positions``: False
    when transformers built the mask without the model's position_ids, so
    that unsharded a packed row is one sequence (see :func:`builder_positions`).
    ``chunk_on_index``: this transformers release cuts the chunks at
    multiples of each row's token index (from its first real token), not of
    the position ids of packed documents (:func:`chunks_on_positions`: before
    5.24). The ring cuts each document from its own start: the same where
    every document starts on a chunk edge (:func:`.cp.check_sharded_call`)."""

    chunk: Optional[int] = None
    positions: bool = True
    chunk_on_index: bool = False


def builder_positions(depth: int = 4) -> Optional[bool]:
    """Whether the transformers mask builder that called the hook
    (``create_causal_mask`` and its siblings) was given position_ids; None when
    the hook was not called from one. transformers treats restarting positions
    as packed documents only from the builder's position_ids, which it hands
    the hook only when it finds documents in them; a model that leaves them
    out of its builder (GPT-OSS, huggingface/transformers#39997) runs a packed
    row as one sequence, which the hook can tell only from the builder's
    frame."""
    import sys

    import transformers.masking_utils as mu

    f = sys._getframe(1)
    for _ in range(depth):
        f = f.f_back
        if f is None:
            return None
        if f.f_globals.get("__name__") == mu.__name__ and f.f_code.co_name.startswith("create_"):
            return f.f_locals["position_ids"] is not None if "position_ids" in f.f_locals else None
    return None


@functools.lru_cache(maxsize=None)
def chunks_on_positions() -> bool:
    """Whether this transformers release cuts chunked attention's chunks of
    packed sequences on their position ids (its chunked mask builder remaps
    positions: 5.24 on) rather than on the row's token index. A property of
    the release, the same on every rank: a rank's own mask cannot tell, since
    transformers remaps only where that rank's position ids look packed."""
    import inspect

    import transformers.masking_utils as mu

    return "remap_positions_for_packed_sequence" in inspect.getsource(mu.create_chunked_causal_mask)


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
              mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask hook for "longattn_ring": the sharded batch carries the
    documents (CPContext); local position ids jump between zigzag chunks and are
    not documents. A padding mask that reaches the model is returned so that
    the attention call reports it on every rank; a chunked layer, or a model
    whose mask builder had no position_ids, gets :class:`RingMask`."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return attention_mask
    chunk = read_pattern(mask_function, "longattn_ring").chunk
    mask = RingMask(None if chunk is None else chunk[0], builder_positions() is not False,
                    chunk is not None and not chunks_on_positions())
    return None if mask == RingMask() else mask


def documents_of(mask, q_len: int, impl: str) -> Documents:
    """The :class:`Documents` an attention call received as ``attention_mask``
    (from :func:`local_mask`, or a 2-D padding mask given to the call directly)."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = make_documents((mask != 0).to(torch.int32), q_len, False)
    if not isinstance(mask, Documents):
        raise mask_error(impl, mask)
    if mask.q_len != q_len:
        raise ValueError(f"attn_implementation={impl!r}: the attention mask was built for {mask.q_len} queries, "
                         f"the layer has {q_len}")
    return mask


def causal_and_window(docs: Optional[Documents], causal: bool, sliding_window, impl: str):
    """The layer's (causal, sliding_window), where transformers built a mask
    read from it (it is the truth; a layer window that differs raises)."""
    if docs is None or docs.pattern is None:
        return causal, sliding_window
    pat = docs.pattern
    mask_window = pat.window if pat.window is not None else pat.bidirectional_window
    if sliding_window is not None and mask_window != sliding_window:
        raise ValueError(f"attn_implementation={impl!r}: the layer's sliding_window ({sliding_window}) differs "
                         f"from its mask's ({mask_window})")
    return (causal if pat.causal is None else pat.causal), mask_window
