"""Launch geometry of the Triton attention kernels: which rows a program
reads (:class:`Geometry` for a dense block, a packed-document call or one
dilated branch; :class:`GroupedPlan` for the grouped dilated schedule) and the
built-in tile table."""
from __future__ import annotations

import functools

import torch

# (kind, headdim bucket) -> launch config; kinds: fwd, dkdv (BLOCK_M query
# rows x BLOCK_N keys per program), dq. Starting points from the Triton
# fused-attention tutorial's Hopper settings; head dims <= 128 from an H200
# sweep (benchmarks/results/tune_triton_h200.jsonl).
STATIC_TILES = {}
for _d in (32, 64, 96, 128, 256):
    _big = _d > 128
    STATIC_TILES[("fwd", _d)] = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2) if _big else
                                 dict(BLOCK_M=128, BLOCK_N=128 if _d > 64 else 64, num_warps=8, num_stages=3))
    STATIC_TILES[("dkdv", _d)] = (dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=1) if _big else
                                  dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3))
    STATIC_TILES[("dq", _d)] = (dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=1) if _big else
                                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3))
del _d, _big


def static_tiles(d: int, device: torch.device, kind: str) -> dict:
    """Block sizes and warps: small tiles under the interpreter (speed of the
    tests), the table's tiles on GPU."""
    if device.type == "cpu":
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    kind = kind.removeprefix("grouped_")
    bucket = min((b for b in (32, 64, 96, 128, 256) if b >= d), default=256)
    return dict(STATIC_TILES[(kind, bucket)])


class Geometry:
    """Launch geometry of one dense call, one packed-document call or one dilated branch."""

    def __init__(self, sq, sk, *, w=None, r=1, causal=False, window=(-1, -1), q_offset=0, cu_seqlens=None,
                 max_seqlen=None, inner=0, higher=None):
        # deduplicated dilated branch (see dedup_chain): ``inner`` class indices per
        # sub-block whose pairs an earlier branch computes (0: none), ``higher`` the
        # rates of the later branches (their count weights each pair)
        self.inner, self.higher = inner, tuple(higher or ())
        self.dilated = w is not None
        self.varlen = cu_seqlens is not None
        self.cu = cu_seqlens
        self.causal, self.window, self.q_offset = causal, window, q_offset
        self.sq, self.sk = sq, sk
        if self.varlen:
            self.w, self.r, self.nfull, self.tail = sq, 1, 1, 0
            self.nseg = cu_seqlens.numel() - 1
            self.max_m = self.max_mk = max_seqlen
        elif self.dilated:
            self.w, self.r = w, r
            self.nfull, self.tail = sq // w, sq % w
            self.nseg = self.nfull + (1 if self.tail else 0)
            self.max_m = -(-min(w, sq) // r)
            self.max_mk = self.max_m
        else:
            self.w, self.r, self.nfull, self.tail, self.nseg = sq, 1, 1, 0, 1
            self.max_m, self.max_mk = sq, sk

    def scalars(self):
        left, right = self.window
        return (self.sq, self.sk, self.w, self.r, self.nfull, self.tail, self.q_offset, max(left, 0),
                max(right, 0))

    def flags(self):
        return dict(CAUSAL=self.causal, HAS_LEFT=self.window[0] >= 0, HAS_RIGHT=self.window[1] >= 0,
                    DILATED=self.dilated, VARLEN=self.varlen, DEDUP=self.inner > 0, NH=len(self.higher),
                    HR=sum(r << (15 * t) for t, r in enumerate(self.higher)))  # compile-time constants

    def cu_arg(self, like: torch.Tensor) -> torch.Tensor:
        return self.cu if self.varlen else like


DEDUP_MAX_BRANCHES = 5  # the later rates of a branch travel packed in one 64-bit constant


class DedupBranch:
    """One branch of a deduplicated dilated call, in chain order: its
    (segment, rate), the sub-block ``inner`` (class indices of the previous
    branch's segment; 0 for the first branch) and ``rank`` (its place in the chain)."""

    def __init__(self, index, w, r, inner, rank):
        self.index, self.w, self.r, self.inner, self.rank = index, w, r, inner, rank


def dedup_chain(seqlen, segment_lengths, dilation_rates, align: int = 16):
    """The branches in chain order when each pair of the union is computed once, else None.

    A chain: sorted by (rate, segment), each rate divides the next and each
    segment nests in the next (divides it, or the next covers the sequence).
    Then branch i's pairs inside the previous branch's segment (its diagonal
    sub-blocks of ``inner = w_prev / r_i`` class indices) are pairs of the
    previous branch too, and are skipped; the earlier branch counts each of
    its pairs once per branch that gives it (``levels`` in the kernels):
    every pair computed once, the softmax over the union unchanged (LongNet:
    76% of the pairs, causal 75%; tests/test_dilated.py checks exactness).
    ``align``: each ``inner`` must be a multiple of it (tiles lie inside one
    sub-block); a previous segment covering the sequence leaves nothing. The
    kernels take the later rates as compile-time constants: at most
    ``DEDUP_MAX_BRANCHES`` branches, rates below 2**15."""
    if len(dilation_rates) > DEDUP_MAX_BRANCHES or max(dilation_rates) >= 1 << 15:
        return None
    order = []  # by (rate, segment), by comparisons: under torch.compile the values may be symbolic,
    for i in range(len(dilation_rates)):  # which Dynamo cannot sort by
        key = (dilation_rates[i], segment_lengths[i])
        at = next((j for j, o in enumerate(order) if key < (dilation_rates[o], segment_lengths[o])), len(order))
        order.insert(at, i)
    whole = lambda w: w >= seqlen
    out = []
    for rank, i in enumerate(order):
        w, r = segment_lengths[i], dilation_rates[i]
        inner = 0
        if rank:
            wp, rp = segment_lengths[order[rank - 1]], dilation_rates[order[rank - 1]]
            if r % rp or not (whole(w) or (not whole(wp) and w % wp == 0)):
                return None
            if whole(wp):  # every pair of this branch is the previous one's: a sub-block past the end
                inner = max(128, 1 << (seqlen - 1).bit_length())
            elif wp % r or (wp // r) % align:
                return None
            else:
                inner = wp // r
        out.append(DedupBranch(i, w, r, inner, rank))
    return out


class GroupedPlan:
    """The grouped schedule of a dilated call (see grouped_jit), or ``None``
    from :meth:`of` where branches do not nest. A branch whose segment covers
    the sequence is given the segment ``W0 * ceil(S / W0)`` (same selection:
    one segment)."""

    def __init__(self, seqlen, w0, r0, segs, rates, causal):
        self.sq, self.w, self.r0, self.causal = seqlen, w0, r0, causal
        self.segs, self.rates = segs, rates
        self.dilated, self.nseg, self.max_m = True, -(-seqlen // w0), w0 // r0

    @staticmethod
    def of(seqlen, segment_lengths, dilation_rates, causal):
        r0 = max(dilation_rates)
        finite = [w for w in segment_lengths if w < seqlen]
        w0 = min(finite) if finite else r0 * -(-seqlen // r0)
        whole = w0 * -(-seqlen // w0)
        segs = [w if w < seqlen else whole for w in segment_lengths]
        if any(r0 % r for r in dilation_rates) or w0 % r0 or any(w % w0 for w in segs):
            return None
        return GroupedPlan(seqlen, w0, r0, segs, list(dilation_rates), causal)

    def table(self, device) -> torch.Tensor:
        """int32: (w, r) per branch, then the class offsets from a head's own
        class, by decreasing number of branches that select them. On the
        device once per branches and kept (a captured pass reads it at every
        replay); inside a CUDA graph capture, copied from a kept pinned host
        tensor (a pageable copy is illegal there; the copy is a graph node)."""
        order = sorted(range(self.r0), key=lambda o: -sum(o % r == 0 for r in self.rates))
        values = tuple(int(x) for wr in zip(self.segs, self.rates) for x in wr) + tuple(order)
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return _pinned_table(values).to(device, non_blocking=True)
        return _device_table(values, device)


# never evicted: a graph captured over a table reads it at every replay (a few ints per set of branches)
@functools.lru_cache(maxsize=None)
def _device_table(values: tuple, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _pinned_table(values: tuple) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cpu").pin_memory()
