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
    split-KV kernel over the rows' lengths kept on the device (``lens``):
    the tokens appended since the last step are added to them by the step,
    one token inside its graph, any more before it. A step shape (the
    query's, the cache's storage, whether a token was appended) runs eagerly
    on its first call (compiling the kernels) and is captured on its second
    (:class:`longattn.dilated.graphs.GraphCache`: the query copied in, the
    outputs copied out), so one graph serves every step until the cache's
    storage grows (which drops the graphs). At most :attr:`MAX` shapes per
    cache; every cache's graphs share one memory pool (steps run one after
    another on one stream)."""

    MAX = 4
    MAX_CAPTURES = 16  # more, and the cache alternates between more shapes than it keeps: it stops capturing

    def __init__(self):
        self.lens: Optional[torch.Tensor] = None
        # tokens appended to every row since ``lens`` was last advanced: a generation loop's one token is
        # added inside the next step's graph (no kernel or host launch of its own outside it)
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
               need_lse: bool = True, copies: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(out, lse) of the step: replayed, or eager on a shape's first call.
        ``need_lse`` False: lse is None (a replay copies out only the outputs
        its caller reads). ``copies``: (destinations, sources) to copy before
        the step (an append's new tokens), in the launch that copies the
        query into a replayed graph."""
        if self.lens is None:
            with torch.inference_mode(False):  # made here, advanced by steps in and out of inference mode
                self.lens = torch.tensor(list(lens), dtype=torch.int32, device=q.device)
        # one appended token is added inside the graph (a loop's steps share one graph whatever they append
        # in between), the rest before it
        inside = min(self.pending, 1)
        before, self.pending = self.pending - inside, 0

        def run(x):
            # inside: the captured launch itself counts the token and advances the lengths (every replay)
            out, lse = _kdec.decode(x, k_cache, v_cache, None, x.shape[1] > 1, scale, lens_tensor=self.lens,
                                    advance=inside, **split_kv_args(x, tuning, replayed=True))
            return (out, lse) if need_lse else (out,)
        # q's shape, dtype and device (and the inference mode) are added by the GraphCache
        key = (q.stride(), scale, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, tuning, need_lse, inside)
        try:
            if before:
                self.lens += before
            res = self.replays.run(key, run, [q], copies=copies)
        except BaseException:
            # whether the lengths were advanced is unknown (a capture that failed, an interrupt): the host's
            # are the truth; copied into the same tensor, which the captured graphs read
            with torch.inference_mode(False):
                self.lens.copy_(torch.tensor(list(lens), dtype=torch.int32, device="cpu"))
            raise
        return (res[0], res[1] if need_lse else None)
