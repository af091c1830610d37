"""Autograd wiring shared by every attention custom op.

Each op is a pair of ``torch.library`` custom ops: ``fwd(q, k, v, *tensors,
*args) -> (out, lse, *kept)`` and ``bwd(dout, q, k, v, out, lse, dlse,
*tensors, *kept, **args) -> (dq, dk, dv)``, the backward taking the op's
non-tensor arguments by name (so a signature change cannot silently shift
them). ``kept`` are forward results only the backward needs (the ring's last
K/V block); they carry no gradient.
"""
from __future__ import annotations

from typing import Sequence

import torch


def register_attention_autograd(fwd_op, bwd_op, arg_names: Sequence[str], extra_tensors: int = 0,
                                kept_outputs: int = 0, fwd_fake=None) -> None:
    """Attach ``bwd_op`` as the backward of ``fwd_op``.

    ``arg_names`` are the names of fwd_op's inputs after q, k, v and the
    ``extra_tensors`` tensor inputs (e.g. cu_seqlens), in order;
    ``kept_outputs`` counts the outputs after (out, lse) handed to the backward.
    ``fwd_fake``: the forward's fake kernel (e.g. :func:`out_lse_like`); given,
    the backward's is registered too (:func:`grads_like`).
    """
    if fwd_fake is not None:
        fwd_op.register_fake(fwd_fake)
        bwd_op.register_fake(grads_like)
    n_tensors = 3 + extra_tensors

    def setup(ctx, inputs, output):
        # An unused lse must reach backward as None, not as zeros: a zero dlse
        # would send the backward down the slower dlse-folding path.
        ctx.set_materialize_grads(False)
        kept = output[2:2 + kept_outputs]
        ctx.mark_non_differentiable(*kept)
        ctx.save_for_backward(*inputs[:n_tensors], *kept, output[0], output[1])
        ctx.kw = dict(zip(arg_names, inputs[n_tensors:]))
        ctx.n_inputs = len(inputs)

    def backward(ctx, dout, dlse, *_):
        *ins, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd_op(dout.contiguous(), ins[0], ins[1], ins[2], out, lse, dlse, *ins[3:], **ctx.kw)
        return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)

    fwd_op.register_autograd(backward, setup_context=setup)


def grads_like(dout, q, k, v, *args, **kwargs):
    """The fake kernel of every backward op: gradients shaped like q, k and v."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def out_lse_like(q, *args, **kwargs):
    """The fake kernel of a (B, S, H, D) forward op: the output like q and a (B, H, S) float32 lse."""
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty(b, h, s, dtype=torch.float32)


def varlen_out_lse_like(q, *args, **kwargs):
    """The fake kernel of a packed-document forward op on (T, H, D): the output like q and an (H, T) lse."""
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
