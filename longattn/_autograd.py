"""Autograd wiring shared by every attention custom op.

Each op is a pair of ``torch.library`` custom ops: ``fwd(q, k, v, *tensors,
*args) -> (out, lse, *kept)`` and ``bwd(dout, q, k, v, out, lse, dlse,
*tensors, *kept, **args) -> (dq, dk, dv)``, the backward taking the op's
non-tensor arguments by name (so a signature change cannot silently shift
them). ``kept`` are forward results only the backward needs (the ring's last
K/V block); they carry no gradient.

:func:`register_attention_autograd` returns an :class:`AttentionOp`, what the
public functions call. Where nothing traces or transforms the call (plain
tensors off the meta device, eager, no torch.compile or ``torch.jit.trace``,
no ``torch.func`` transform, no dispatch or function mode), it runs the two
functions under one ``torch.autograd.Function`` and skips the dispatcher:
torch.library's dispatch of a Python custom op costs tens of microseconds per
pass (LongNet at 8K-16K on one H200: 0.13-0.15 ms of forward host time against
0.20-0.25 ms through the dispatcher, of a 0.5-1.1 ms call;
``benchmarks/dilated_short_seq.py --variants auto auto_dispatcher``).
Everywhere else the custom op runs, so torch.compile, export, FakeTensor and
vmap see one opaque op with its fake kernel.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import once_differentiable


def direct(tensors: Sequence) -> bool:
    """Whether a call on ``tensors`` may skip the dispatcher (see the module
    docstring): every tensor a plain ``torch.Tensor`` off the meta device (meta
    tensors get the fake kernel, shapes only), not compiling, not under
    ``torch.jit.trace`` (the trace records the custom op, which it can save; an
    ``autograd.Function`` it cannot), no ``torch.func`` transform and no Python
    dispatch or function mode active."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._len_torch_function_stack() == 0 and torch._C._functorch.peek_interpreter_stack() is None
            and not torch._C._is_tracing()
            and all(t is None or (type(t) is torch.Tensor and not t.is_meta) for t in tensors))


class AttentionOp:
    """A forward/backward custom-op pair with its autograd; calling it runs the
    forward (positional arguments as ``fwd_op`` takes them): the custom op, or
    where :func:`direct` says so, the same functions without the dispatcher."""

    def __init__(self, fwd_op, bwd_op, n_tensors: int, function: type):
        self.fwd_op, self.bwd_op, self.n_tensors, self.function = fwd_op, bwd_op, n_tensors, function

    def __call__(self, *args):
        if direct(args[:self.n_tensors]):
            return self.function.apply(*args)
        return self.fwd_op(*args)


def register_attention_autograd(fwd_op, bwd_op, arg_names: Sequence[str], extra_tensors: int = 0,
                                kept_outputs: int = 0, fwd_fake=None) -> AttentionOp:
    """Attach ``bwd_op`` as the backward of ``fwd_op``; returns the
    :class:`AttentionOp` that calls the pair.

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

    def backward(ctx, dout, dlse, *_, bwd=bwd_op):
        *ins, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = bwd(dout.contiguous(), ins[0], ins[1], ins[2], out, lse, dlse, *ins[3:], **ctx.kw)
        return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)

    fwd_op.register_autograd(backward, setup_context=setup)

    fwd_fn, bwd_fn = fwd_op._init_fn, bwd_op._init_fn  # the functions the ops were made from

    def forward(ctx, *inputs):
        output = fwd_fn(*inputs)
        setup(ctx, inputs, output)
        return output

    def direct_backward(ctx, dout, dlse, *_):
        return backward(ctx, dout, dlse, bwd=bwd_fn)

    name = fwd_op._qualname.replace("::", "_")  # the autograd node's name in profiles and error messages
    function = type(name, (torch.autograd.Function,), dict(forward=staticmethod(forward),
                                                          backward=staticmethod(once_differentiable(direct_backward))))
    return AttentionOp(fwd_op, bwd_op, n_tensors, function)


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
