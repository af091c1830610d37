"""Decoding with the cache sharded over the ranks of a group: each rank's
partial (out, lse) and the merge by lse in float32, through one all-gather
whose size does not depend on the context length."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import backends as bk
from .._merge import merge_stack
from .._streams import side_stream
from .._sinks import apply_sinks, sinks_meta
from ..distributed import checks as dist_checks
from .checks import check_decode_args, check_lengths, describe, no_capture
from .engine import dense_part, on_device


def gather_partials(part: Optional[tuple[torch.Tensor, torch.Tensor]], shape: Optional[tuple[int, int, int, int]],
                    header: Sequence[int], group, device) -> tuple[list[list[int]], Callable]:
    """One all-gather of every rank's ``header`` (ints in ``[0, 2**31)``) and,
    where ``shape`` ``(B, Lq, H, D)`` is given, its partial result ``part`` =
    (out ``(B, Lq, H, D)``, lse ``(B, H, Lq)``); a rank with no result
    (``part`` None: its call failed or differs) sends zeros of ``shape``, so
    every rank's block has the same size whatever its arguments. ``shape`` must
    be the same on every rank (agreed before).

    Returns (the headers of every rank, as host ints: one device-to-host copy
    when there is a header; a thunk giving the merge by lse in float32 of the
    gathered results, (out, lse), the same bits on every rank).
    """
    nh = len(header)
    b, lq, h, d = shape if shape is not None else (0, 0, 0, 0)
    n_out, n_lse = b * lq * h * d, b * h * lq
    # one int32 block: the header, then the float32 partials viewed in place
    buf = torch.empty(nh + n_out + n_lse, dtype=torch.int32, device=device)
    if nh:
        buf[:nh].copy_(torch.tensor(list(header), dtype=torch.int32, device="cpu"))
    pay = buf[nh:].view(torch.float32)
    if part is None:
        pay.zero_()
    else:
        pay[:n_out].copy_(part[0].reshape(-1))
        pay[n_out:].copy_(part[1].reshape(-1))
    world = dist.get_world_size(group)
    got = buf.new_empty(world * buf.numel())  # one receive buffer: no per-rank tensors to copy out
    dist.all_gather_into_tensor(got, buf, group=group)
    got = got.view(world, -1)
    heads = got[:, :nh].tolist() if nh else [[] for _ in range(world)]

    def merge() -> tuple[torch.Tensor, torch.Tensor]:
        xs = got[:, nh:].view(torch.float32)
        # every rank merges the same bits in the same order: the same result everywhere
        out, lse = merge_stack(xs[:, :n_out].view(world, b, lq, h, d),
                               xs[:, n_out:].view(world, b, h, lq).transpose(2, 3))
        return out, lse.transpose(1, 2).contiguous()

    return heads, merge


def checks_apart(device: torch.device, tuning) -> bool:
    """Whether a sharded step exchanges its checks in an all-gather of their
    own between its part's checks and its kernels (:func:`gather_checks`: the
    host waits for the previous step's collectives, not this step's
    attention) rather than in the header of the partials' one all-gather
    (read back after it: the host waits for this step's attention). ``tuning.sharded_checks``
    (:class:`longattn.tuning.DecodeTuning`): "auto" apart where the partials are
    on a GPU (on the CPU nothing is waited for either way: one collective)."""
    mode = tuning.sharded_checks
    return device.type == "cuda" if mode == "auto" else mode == "apart"


def gather_checks(header: Sequence[int], group, device: torch.device) -> list[list[int]]:
    """Every rank's ``header`` ints (rank order) on the host, without waiting
    for the work this rank has queued: on CUDA the all-gather is issued from a
    side stream that does not wait for the current one. The group's
    collectives still run in issue order, so it lands after the previous
    step's all-gather of partials. Issued before the step's attention kernels
    (a kernel that fills every SM would hold it back until it ends), it lets
    the host run up to one step ahead of the GPU."""
    if device.type != "cuda":
        return dist_checks.gather_ints(group, header, device)
    with torch.cuda.stream(side_stream(device, "decode checks")):
        return dist_checks.gather_ints(group, header, device)


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial (out ``(B, Lq, H, D)``, lse ``(B, H, Lq)``) merged by
    lse in float32, the same on every rank: one all-gather of
    ``B * Lq * H * (D + 1)`` floats per rank, whatever the context length,
    nothing read back (the ranks agreed on the call before)."""
    return gather_partials((out, lse), tuple(out.shape), [], group, out.device)[1]()


def decode_call(q, k_cache, v_cache, cache_seqlens, causal, softmax_scale, return_lse, backend: str, group,
                softcap=0.0, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`longattn.decode_attention` with ``group``: the call agreed on
    every rank (the capacity and the lengths may differ; everything else may
    not), each rank's part, merged; (out in q's dtype, lse), the same on every
    rank. A rank whose lengths are out of range (or whose arguments are bad)
    makes every rank raise before the merge. The sinks merge once, after the ranks' parts.

    Each rank checks its arguments and lengths and queues its part first, then
    the ranks agree (one small all-gather, read on the host where the group
    has a CPU backend: no device sync) and every rank raises where one had a
    problem or the calls differ; then one all-gather of the partials."""
    no_capture(q, "decode_attention(..., group=...)")
    g = dist_checks.resolve_group(group)
    problem = out = lse = None
    try:
        softcap = check_decode_args(q, k_cache, v_cache, cache_seqlens, causal, return_lse, softmax_scale, backend,
                                    softcap, sinks)
        lens = cache_seqlens.tolist()
        check_lengths(lens, k_cache.shape[1], q.shape[1], causal)
        out, lse = dense_part(q, k_cache, v_cache, lens, causal, bk.default_scale(q.shape[-1], softmax_scale),
                              backend, on_device(cache_seqlens, q), softcap=softcap)
    except (TypeError, ValueError) as e:  # a part that raises (a forced backend refusing) is this rank's problem
        problem = e
    dist_checks.agree(g, "decode_attention", problem, q=describe(q), k=describe(k_cache, capacity=False),
                      v=describe(v_cache, capacity=False), seqlens=describe(cache_seqlens), scale=softmax_scale,
                      lse=return_lse, backend=backend, softcap=softcap, sinks=sinks_meta(sinks))
    out, lse = merge_over_ranks(out, lse, g)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(q.dtype), lse
