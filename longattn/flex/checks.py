"""Argument checks of the flex ops, raised at the public call: the mask and
score functions (callable, with FlexAttention's signature, no captured
tensor that wants a gradient) and the tensors."""
from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch

from .. import backends as bk
from .._validation import check_flag, check_qkv, check_scale

SIGNATURES = {"mask_mod": "mask_mod(b, h, q_idx, kv_idx) -> bool tensor",
              "score_mod": "score_mod(score, b, h, q_idx, kv_idx) -> score"}

# functions whose signature passed as a kind: reading a signature costs ~15 us, a third of a flex call's own
# host time, and every call passes the same mask (a function's code does not change its arity in place)
_PASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_mod(fn, kind: str, label: Optional[str] = None) -> None:
    """``fn`` (None or a function) as a ``kind`` (``"mask_mod"`` or
    ``"score_mod"``) argument, named ``label`` in the error (default: the
    kind): callable, and taking FlexAttention's positional arguments (4 for a
    mask, 5 for a score) where its signature can be read. A wrong arity would
    otherwise fail deep inside the block planning or torch's vmap."""
    want, label = SIGNATURES[kind], label or kind
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"{label} must be a function {want} (FlexAttention's signature) or None, "
                        f"got {type(fn).__name__}")
    try:
        if kind in _PASSED.get(fn, ()):
            return
    except TypeError:  # not weakly referable or not hashable: checked every call
        pass
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): it is called as it is
        return
    nargs = want.count(",") + 1
    try:
        sig.bind(*range(nargs))
    except TypeError:
        what = getattr(fn, "__qualname__", type(fn).__name__)
        raise TypeError(f"{label} must take {nargs} positional arguments, {want} (FlexAttention's signature); "
                        f"got {what}{sig}") from None
    try:
        _PASSED[fn] = _PASSED.get(fn, frozenset()) | {kind}
    except TypeError:
        pass


def check_mods(mask_mod, score_mod) -> None:
    check_mod(mask_mod, "mask_mod")
    check_mod(score_mod, "score_mod")
    for cell in getattr(score_mod, "__closure__", None) or ():
        try:
            val = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(val, torch.Tensor) and val.requires_grad:
            raise ValueError("score_mod captures a tensor that requires grad; these ops give no gradient to "
                             "score_mod's tensors: detach it (or use torch's flex_attention on one device)")


def check_call(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen: bool) -> float:
    """The arguments of a flex call, checked; returns the softmax scale."""
    check_qkv(q, k, v, same_seqlen=same_seqlen)
    check_mods(mask_mod, score_mod)
    check_flag(return_lse, "return_lse")
    check_scale(softmax_scale)
    if q.is_cuda and min(q.shape[-1], v.shape[-1]) < 16:  # Inductor's flex kernels refuse it at compile time
        raise ValueError(f"flex attention on CUDA needs head dims >= 16, got q/k {q.shape[-1]} and v {v.shape[-1]}: "
                         "pad them with zeros to 16 (pass softmax_scale=1/sqrt(original head dim)) and slice the "
                         "output, or run on CPU")
    return bk.default_scale(q.shape[-1], softmax_scale)


def plan_outside_capture(x: torch.Tensor, what: str) -> None:
    """Raise where ``what`` would plan a (shape, pattern) under CUDA graph
    capture: planning reads the mask's block table on the host (across ranks,
    also the results of collectives), which a capture cannot run. Plans are
    cached, so a call made once outside the capture replays inside it."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"{what} plans each (shape, pattern) on its first call, reading the mask's blocks on the "
                         f"host (across ranks: with collectives), which CUDA graph capture cannot run: call it once "
                         f"with these shapes and this pattern before capturing")
