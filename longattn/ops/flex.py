"""``flex_attention`` and ``ring_flex_attention``: any attention pattern
(FlexAttention ``mask_mod`` / ``score_mod`` on global positions) on one device
or over a sequence sharded across ranks. The engines (block planning, the
local step and its compile cache, the ring schedule and its autograd) are in
:mod:`longattn.flex`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import tuning as _tuning
from ..distributed import checks as dist_checks
from ..dilated import graphs
from ..distributed.layout import check_layout
from ..flex import checks, exchange, fa4, schedule
from ..flex.autograd import NoKeys, RingFlex
from ..flex.exchange_run import ExchangeFlex

__all__ = ["flex_attention", "ring_flex_attention", "explain_flex"]


@torch.compiler.disable
def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_mod: Optional[Callable] = None,
                   score_mod: Optional[Callable] = None, softmax_scale: Optional[float] = None,
                   return_lse: bool = False, kernel: str = "auto",
                   tuning: Optional[_tuning.FlexFa4Tuning] = None):
    """Attention with any pattern: FlashAttention-4 for the patterns of
    :mod:`longattn.masks`, PyTorch's FlexAttention for any other, in longattn's layout.

    Args:
        q: ``(batch, seqlen_q, nheads, headdim)``.
        k, v: ``(batch, seqlen_k, nheads_kv, headdim)`` (GQA/MQA from the head counts).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True: visible), e.g.
            from :mod:`longattn.masks`; None: every key.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` applied to
            the scaled score before the softmax (a bias, a soft cap); None: none.
            Tensors it captures get no gradient.
        softmax_scale: default ``headdim ** -0.5``.
        return_lse: also return lse ``(batch, nheads, seqlen_q)`` float32 (natural log).
        kernel: ``"auto"`` (FA4 where the mask has an FA4 form, ``score_mod`` is
            None and flash-attn-4 runs on this sm_90/sm_100 GPU; else
            FlexAttention), ``"fa4"`` (raises where it cannot run) or ``"flex"``.
            :func:`explain_flex` says which runs and why.
        tuning: how FA4 runs it (documents as varlen, tiles with long chains
            apart, short calls replayed from CUDA graphs); default
            ``longattn.tuning.FLEX_FA4``.

    Returns:
        out ``(batch, seqlen_q, nheads, headdim)``; rows that see no key hold 0
        (and lse -inf).

    Equivalent PyTorch (``mask``, ``bias`` the functions evaluated on every (b, h, i, j))::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k_expanded) * scale + bias
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1).nan_to_num(0)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v_expanded)

    FA4 runs the pattern's mask compiled into its kernels with the exact block
    sparsity of the pattern (full blocks without the mask, empty ones
    skipped), in forward and backward; at batch 1 a few tiles seen by (or
    seeing) every other, global tokens, run apart on views
    (``longattn.tuning.FLEX_FA4``). Documents that are contiguous runs (alone,
    or with causal and sliding windows) run as FA4's varlen kernel, one launch
    over every document's own tiles. On CUDA FlexAttention is compiled (once per shape and pattern; block masks
    cached per pattern, see :mod:`longattn.masks`); elsewhere torch's eager
    FlexAttention runs (dense scores: small shapes). Runs outside ``torch.compile``
    graphs (a graph break).
    """
    scale = checks.check_call(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen=False)
    if tuning is not None and not isinstance(tuning, _tuning.FlexFa4Tuning):
        raise TypeError(f"flex_attention: tuning must be a longattn.tuning.FlexFa4Tuning or None, got "
                        f"{type(tuning).__name__}")
    if fa4.choose(q, k, v, mask_mod, score_mod, kernel) == "fa4":
        res = fa4.attend(q, k, v, mask_mod, scale, tuning or _tuning.FLEX_FA4)
        out, lse = NoKeys.apply(q, k, v) if res is None else res
        return (out, lse) if return_lse else out
    step = schedule.single_step(q, k, mask_mod, score_mod, scale)
    out, lse = NoKeys.apply(q, k, v) if step is None else step.attend(q, k, v)  # FlexAttention's autograd
    return (out, lse) if return_lse else out


def explain_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_mod: Optional[Callable] = None,
                 score_mod: Optional[Callable] = None, kernel: str = "auto") -> dict:
    """Which kernel :func:`flex_attention` runs for these arguments and why:
    ``{"kernel": "fa4" or "flex", "fa4": [reasons FA4 cannot run], "flex": []}``
    (as :func:`longattn.backends.explain` lists each backend's refusals).

    >>> explain_flex(q, k, v, mask_mod=longattn.masks.causal())["kernel"]
    'fa4'
    """
    checks.check_mods(mask_mod, score_mod)
    return fa4.explain(q, k, v, mask_mod, score_mod, kernel)


@torch.compiler.disable
def ring_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask_mod: Optional[Callable] = None,
                        score_mod: Optional[Callable] = None, layout: str = "zigzag",
                        softmax_scale: Optional[float] = None, return_lse: bool = False, kernel: str = "auto",
                        tuning: Optional[_tuning.FlexExchangeTuning] = None, group=None, engine: str = "auto"):
    """Attention with any pattern over a sequence sharded across the ranks of ``group``.

    Args:
        q: this rank's shard ``(batch, seqlen_local, nheads, headdim)`` (see
            :func:`longattn.shard`); k, v: ``(batch, seqlen_local, nheads_kv, headdim)``.
        mask_mod, score_mod: as :func:`flex_attention`, on GLOBAL positions of
            the unsharded sequence (the same functions as on one device).
        layout: ``"zigzag"`` (rank r holds chunks r and 2p-1-r of 2p: balanced
            work for causal-like patterns) or ``"contiguous"``.
        softmax_scale, return_lse, kernel: as :func:`flex_attention` (each
            rank's steps; ``"fa4"`` where FA4 cannot run raises on every rank).
        group: a ProcessGroup (default WORLD).
        engine: ``"ring"`` (below), ``"exchange"`` (each rank fetches only the
            K/V blocks its rows see and ships its dense query rows, e.g. global
            tokens, to the ranks whose keys they see: :mod:`longattn.flex.exchange`;
            masks only, no ``score_mod``) or ``"auto"``: the exchange from
            ``longattn.tuning.FLEX_EXCHANGE.min_world`` ranks on (2), where
            its busiest rank sends under ``FLEX_EXCHANGE.max_traffic`` x
            (the ring's steps) of the ring's bytes and FA4 runs the pattern
            (or on CPU), else the ring.
            Both are exact; planned on the first call per (shape, pattern).
            Every rank passes the same value.
        tuning: the exchange's :class:`longattn.tuning.FlexExchangeTuning`
            (default ``longattn.tuning.FLEX_EXCHANGE``, whose fields carry the
            measurements behind them; ``graph_max_tokens`` replays the
            exchange's passes from CUDA graphs the library captures per shape);
            the same on every rank.

    Returns:
        This rank's shard of the output (and lse). ``unshard(out)`` equals
        :func:`flex_attention` on the unsharded q, k, v.

    Each step attends to the visiting K/V block under the block mask of
    (local queries x that block) in global positions: empty blocks are
    skipped, a step with no visible key is not computed, and the ring ends
    after the last step any rank needs (a sliding window or documents that
    stay within a shard end it early). Block masks are built on the first call
    per (shape, pattern) and cached (two small collectives then). A call
    whose arguments and plan a first call made can be captured in a CUDA
    graph (its transfers and side stream inside the graph); planning or
    agreeing under capture raises ValueError. Release the outputs of eager
    calls before capturing a backward (torch's rule for any autograd graph:
    a graph still alive binds its leaves' gradient accumulators to the stream
    it ran on, and the capture fails with cudaErrorStreamCaptureImplicit);
    ``tests/capture_ranks.py`` captures the exchange's forward and backward.

    Runs outside ``torch.compile`` graphs (a graph break). With ``kernel="auto"`` each step runs the
    pattern's FA4 form where :func:`explain_flex` would choose FA4 for these shards (a named pattern, FA4
    installed on sm_90 / sm_100), else compiled FlexAttention on CUDA.

    Equivalent PyTorch::

        full = lambda x: longattn.unshard(x, layout=layout)
        out = longattn.shard(longattn.flex_attention(full(q), full(k), full(v), mask_mod=mask_mod,
                                                     score_mod=score_mod), layout=layout)
    """
    scale = checks.check_call(q, k, v, mask_mod, score_mod, softmax_scale, return_lse, same_seqlen=True)
    check_layout(layout)
    exchange.check_engine(engine)
    if tuning is not None and not isinstance(tuning, _tuning.FlexExchangeTuning):
        raise TypeError(f"tuning must be a longattn.tuning.FlexExchangeTuning or None, got {type(tuning).__name__}")
    tuning = _tuning.FLEX_EXCHANGE if tuning is None else tuning
    g = dist_checks.resolve_group(group)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even local seqlen (two chunks per rank), got {q.shape[1]}")
    dist_checks.check_consistent(g, "ring_flex_attention", q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype),
                                 layout=layout, scale=scale, mask=schedule.signature(mask_mod),
                                 score=schedule.signature(score_mod), engine=engine, kernel=kernel, tuning=repr(tuning))
    plan = exchange.plan_for(q, k, mask_mod, score_mod, layout, scale, g, kernel, engine, tuning)
    if plan is not None:  # every rank decides alike: the shapes and the tuning are checked equal above
        graphed = graphs.replays(q, tuning.graph_max_tokens)
        out, lse = ExchangeFlex.apply(q, k, v, plan, g, graphed)
        return (out, lse) if return_lse else out
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    plan = schedule.ring_schedule(q, k, mask_mod=mask_mod, score_mod=score_mod, layout=layout, scale=scale, group=g,
                                  kernel=kernel)
    out, lse = RingFlex.apply(q, k, v, plan, g, grad)
    return (out, lse) if return_lse else out
