"""A :class:`longattn.KVCache`'s dense steps on one CUDA device, replayed from
CUDA graphs (:class:`StepGraphs`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import tuning as _tuning
from ..dilated import graphs
from ..kernels import decode as _kdec
from .engine import split_kv_args


class StepGraphs:
    """One cache's dense decode steps on one device, replayed from CUDA graphs.

    An eager step is host-bound at long contexts (launches and checks take as
    long as reading a 128K cache, docs/performance.md 9). Steps run the
    split-KV kernel over the rows' lengths kept on the device (``lens``,
    advanced by the tokens appended since the last step, inside the step's
    graph). A step shape (the query's, the cache's
    storage) runs eagerly on its first call (compiling the kernels) and is
    captured on its second (:class:`longattn.dilated.graphs.GraphCache`: the
    query copied in, the outputs copied out), so one graph serves every step
    until the cache's storage grows (which drops the graphs). At most
    :attr:`MAX` shapes per cache; every cache's graphs share one memory pool
    (steps run one after another on one stream)."""

    MAX = 4
    MAX_CAPTURES = 16  # more, and the cache alternates between more shapes than it keeps: it stops capturing

    def __init__(self):
        self.lens: Optional[torch.Tensor] = None
        # tokens appended to every row since ``lens`` was last advanced: the next step adds them inside its
        # graph (one kernel fewer per step outside it, and no launch of its own on the host)
        self.pending = 0
        self.replays = graphs.GraphCache(self.MAX, self.MAX_CAPTURES, shared_pool=True)

    def clear(self) -> None:
        self.replays.clear()
        self.lens = None
        self.pending = 0

    def advance(self, n: int) -> None:
        """``n`` tokens were appended to every row (``lens`` advances at the next step)."""
        if self.lens is not None:
            self.pending += n

    def attend(self, q, k_cache, v_cache, lens: Sequence[int], scale: float, tuning: _tuning.DecodeTuning,
               need_lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(out, lse) of the step: replayed, or eager on a shape's first call.
        ``need_lse`` False: lse is None (a replay copies out only the outputs
        its caller reads)."""
        if self.lens is None:
            with torch.inference_mode(False):  # appends advance it in and out of inference mode
                self.lens = torch.tensor(list(lens), dtype=torch.int32, device=q.device)

        pending, self.pending = self.pending, 0

        def run(x):
            if pending:  # captured with the step: each replay advances the lengths by this many
                self.lens += pending
            out, lse = _kdec.decode(x, k_cache, v_cache, None, x.shape[1] > 1, scale, lens_tensor=self.lens,
                                    **split_kv_args(x, tuning, replayed=True))
            return (out, lse) if need_lse else (out,)
        # q's shape, dtype and device (and the inference mode) are added by the GraphCache
        key = (q.stride(), scale, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, tuning, need_lse, pending)
        res = self.replays.run(key, run, [q])
        return (res[0], res[1] if need_lse else None)
