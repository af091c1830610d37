"""What every attention call of the adapter checks and translates: the
refusals (each names the setting to change), GQA and value head dims,
autocast dtypes, transformers' sliding window as ``window_size``."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

# The attention-call keyword through which a ShardedCache layer reaches the call (written by its
# ``update`` into the keyword arguments the model passes on, as transformers' paged cache does).
SHARDED_LAYER_KEY = "longattn_sharded_layer"

# The attention-call keyword of a batch sharded by longattn.context_parallel.shard_batch.
CP_KEY = "longattn_cp"


class _Handover(threading.local):
    """A ShardedCache layer whose ``update`` got no keyword arguments to write
    itself into (models of transformers before 5.24 call ``update(key, value,
    layer_idx)``), with weak references to the key and value it returned:
    the model hands those very tensors to the attention call next."""

    layer = key = value = None


_HANDOVER = _Handover()


def hand_over(layer, key: torch.Tensor, value: torch.Tensor) -> None:
    # all weak: a hand-over nobody reads keeps neither the cache nor the tensors alive
    _HANDOVER.layer, _HANDOVER.key, _HANDOVER.value = weakref.ref(layer), weakref.ref(key), weakref.ref(value)


def sharded_layer(kwargs: dict, key: torch.Tensor, value: torch.Tensor, module=None):
    """The ShardedCache layer this attention call serves, or None: the one in
    its keyword arguments, else the one whose ``update`` just returned this
    very ``key`` and ``value`` (:func:`hand_over`; a stale hand-over never
    matches new tensors). The layer found is marked read (``layer.read()``).
    Raises where the layer handed over is still unread and has this
    ``module``'s ``layer_idx``, but the key and value are other tensors: the
    model changed them between the cache's update and this call."""
    h = _HANDOVER
    layer = kwargs.get(SHARDED_LAYER_KEY)
    if layer is None and h.layer is not None:
        pending = h.layer()
        if h.key() is key and h.value() is value:
            layer = pending
        elif pending is not None and pending.is_pending() and pending.index() == getattr(module, "layer_idx", None):
            h.layer = h.key = h.value = None
            raise ValueError("ShardedCache: this attention call got a key and value other than the tensors the "
                             "cache's update returned (the model changes them in between), so it cannot find its "
                             "sharded layer: before transformers 5.24 the layer travels with those very tensors. "
                             "Use transformers >= 5.24 (the layer travels in the keyword arguments), or the default "
                             "cache")
    if layer is not None:
        if h.layer is not None and layer is h.layer():
            h.layer = h.key = h.value = None
        layer.read()
    return layer


def check_call(impl: str, module, query, key, value, dropout, softcap, kwargs, scores: bool = False):
    """Raise on what longattn does not run; return (causal, value, value head
    dim) with value's head dim padded to the query's (exact: zero columns give
    zero output columns, cropped after). ``scores``: the implementation runs
    logit soft-capping and attention sinks (``s_aux``) itself."""
    if dropout:
        raise ValueError(f"attn_implementation={impl!r} has no attention dropout (got dropout={dropout}, used in "
                         f"training): set the model's config.attention_dropout = 0.0, or use "
                         f"attn_implementation='sdpa'")
    if softcap is not None and not scores:
        raise ValueError(f"attn_implementation={impl!r} has no attention logit soft-capping (softcap={softcap}): "
                         f"set the model config's soft-capping (e.g. config.attn_logit_softcapping) to None, or use "
                         f"attn_implementation='eager' or 'longattn'")
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_implementation={impl!r} does not return attention weights: call the model with "
                         f"output_attentions=False, or use attn_implementation='eager'")
    refused = (("position_bias", "an additive position bias"), ("cache", "a paged cache (continuous batching)"))
    for name, what in refused + (() if scores else (("s_aux", "attention sinks"),)):
        if kwargs.get(name) is not None:
            alt = "'longattn', " if name == "s_aux" else ""
            raise ValueError(f"attn_implementation={impl!r} cannot run {what} ({name}=...): use "
                             f"attn_implementation={alt}'sdpa' or 'eager' for this model")
    hq, hk, d, dv = query.shape[1], key.shape[1], query.shape[-1], value.shape[-1]
    if hk == 0 or hq % hk:
        raise ValueError(f"attn_implementation={impl!r}: num_attention_heads ({hq}) must be a multiple of "
                         f"num_key_value_heads ({hk}) for grouped-query attention; fix the model config")
    if key.shape[-1] != d or dv > d:
        raise ValueError(f"attn_implementation={impl!r}: query/key head dims {d}/{key.shape[-1]} must match and "
                         f"the value head dim ({dv}) must not exceed them; use attn_implementation='sdpa'")
    if dv < d:
        value = torch.nn.functional.pad(value, (0, d - dv))
    is_causal = kwargs.get("is_causal")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    return causal, value, dv


def first_layer(module) -> bool:
    """The call where a distributed implementation agrees across ranks: once
    per forward, so that every rank raises together."""
    return getattr(module, "layer_idx", None) in (None, 0)


def to_bshd(query, key, value):
    """transformers' (batch, heads, seq, dim) as longattn's (batch, seq, heads,
    dim); under autocast in the autocast dtype, as autocast does for SDPA (RoPE
    in float32 can leave q/k in float32 while v is already bf16)."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def crop(out: torch.Tensor, dv: int) -> tuple[torch.Tensor, None]:
    """The attention call's result: the value head dim as the model gave it."""
    return (out[..., :dv] if dv != out.shape[-1] else out), None


def window(sliding_window, causal: bool, length: int) -> tuple[int, int]:
    """transformers' sliding window as longattn's window_size; none when it
    cannot cut anything at this length."""
    if sliding_window is None or sliding_window >= length:
        return (-1, -1)
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w, w)


def flash_kwargs(kwargs) -> Optional[tuple]:
    """(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k) of transformers'
    flash-attention path when all are given, else None."""
    got = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    return tuple(got) if all(x is not None for x in got) else None
