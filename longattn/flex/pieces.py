"""FA4 executors made of pieces: a one-device call's with long chains carved
out (:class:`CarvedStep`), and the exchange's (:mod:`.exchange` plans them,
:mod:`.exchange_run` runs them): FA4 per piece where it runs the pattern (the pattern's form at
the pieces' global positions, the block table with cleared blocks; on a view
of a long side in batch rows where :func:`split_for` says so), else
:class:`TorchPiece`; the halo's pieces (:func:`halo_pieces`): my rows x the
peers' halos, cropped to the rows that see them, peers grouped where the same
rows see them."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .. import tuning as tn
from .._merge import merge_into
from ..backends import _fa4_api
from ..kernels import _common as _kcommon
from ..kernels import few_keys
from . import blocks, fa4, schedule
from . import plan as fp


class TorchPiece:
    """Masked attention in plain PyTorch (float32 math, float64 for float64
    inputs) of queries against keys under a dense mask (Bm, Hm, Lq, Lk) from
    ``make_mask()`` (made on first use): the exchange's executor where FA4 does
    not run (CPU, tests). It materialises the mask and the scores: for
    correctness at small sizes, not for speed. ``forward`` -> (out, lse (B, H,
    Lq) natural log, -inf where a row sees no key); ``backward`` from the given
    (merged) out, lse and dlse."""

    def __init__(self, make_mask: Callable[[], torch.Tensor], scale: float):
        self.make_mask, self.mask, self.scale = make_mask, None, scale

    def _probs(self, q, k, lse=None):
        if self.mask is None:
            self.mask = self.make_mask()
        dt = torch.promote_types(q.dtype, torch.float32)
        kk = k.to(dt).repeat_interleave(q.shape[2] // k.shape[2], 2)
        s = (torch.einsum("bqhd,bkhd->bhqk", q.to(dt), kk) * self.scale).masked_fill(~self.mask, float("-inf"))
        lse = torch.logsumexp(s, -1) if lse is None else lse.to(dt)
        return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse, kk, dt  # rows with no key: -inf - -inf -> 0

    def forward(self, q, k, v):
        p, lse, _, dt = self._probs(q, k)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v.to(dt).repeat_interleave(q.shape[2] // v.shape[2], 2))
        return out.to(q.dtype), lse.float()

    def backward(self, dout, q, k, v, out, lse, dlse):
        p, _, kk, dt = self._probs(q, k, lse)
        g = q.shape[2] // k.shape[2]
        do = dout.to(dt)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, v.to(dt).repeat_interleave(g, 2))
        delta = (do * out.to(dt)).sum(-1).transpose(1, 2)
        if dlse is not None:  # d lse adds p * dlse to dS
            delta = delta - dlse.to(dt)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * self.scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(dt)) * self.scale
        heads = lambda x: x.view(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)  # GQA: sum each group's heads
        return dq.to(q.dtype), heads(dk).to(k.dtype), heads(dv).to(v.dtype)


class FewKeys:
    """The exchange's piece of rows against a few halo keys that every one of
    them sees (dense key blocks: the global tokens' keys on the ranks without
    them), merged into the own piece's outputs in place: ``forward_into(q,
    k, v, out, lse)`` merges the rows' attention over k, v into (out, lse)
    (B, N, H, D) / (B, H, N); ``backward_into(dout, q, k, v, out, lse, dlse,
    dq)`` adds the rows' dQ into ``dq`` from the merged out and lse and
    returns (dK, dV) (B, G, Hkv, D). On CUDA the Triton passes of
    :mod:`longattn.kernels.few_keys` (no FA4 call, no key tile whose backward
    program chains over every row tile, no merge or dQ sum of their own;
    dK, dV float32); elsewhere :class:`TorchPiece` 's math, merged and added
    (dK, dV in k's dtype).

    Equivalent PyTorch (forward)::

        o, l = attention(q, k, v, return_lse=True)
        out, lse = merge((out, lse), (o, l))
    """

    def __init__(self, scale: float):
        self.scale = scale

    @staticmethod
    def _triton(q) -> bool:
        return q.is_cuda and _kcommon.HAS_TRITON

    def _dense(self, q, k) -> TorchPiece:
        """Off CUDA: the rows against every key, as the exchange's other PyTorch executors."""
        return TorchPiece(lambda: torch.ones(1, 1, q.shape[1], k.shape[1], dtype=torch.bool, device=q.device),
                          self.scale)

    def forward_into(self, q, k, v, out, lse) -> None:
        if self._triton(q):
            few_keys.forward_into(q, k, v, out, lse, self.scale)
            return
        o, l_ = self._dense(q, k).forward(q, k, v)
        merge_into(out, lse.transpose(1, 2), o, l_.transpose(1, 2), use_triton=False)

    def backward_into(self, dout, q, k, v, out, lse, dlse, dq) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton(q):
            return few_keys.backward_into(dout, q, k, v, out, lse, dlse, dq, self.scale)
        g = self._dense(q, k).backward(dout, q, k, v, out, lse, dlse)
        dq.add_(g[0])
        return g[1], g[2]


def rows_of(idx: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """Local rows (int64, ascending) of the listed blocks of ``block`` rows."""
    r = (idx[:, None].long() * block + torch.arange(block, device=idx.device)).flatten()
    return r[r < length]


def _long_chains(vis: torch.Tensor, dim: int, heads: int, tuning) -> Optional[torch.Tensor]:
    """The tiles (ascending) whose programs chain over more than
    ``tuning.split_chain`` tiles of the other side, in the pass over ``dim``
    of ``vis`` (Hm, query tiles, key tiles): 2, a query tile's forward over
    key tiles; 1, a key tile's backward over query tiles. None where no tile
    does, or where ``tuning.split_programs`` programs or more (tiles x
    ``heads``) do: those keep every SM busy whatever their length."""
    chains = vis.sum(dim) > tuning.split_chain  # (Hm, tiles)
    if not chains.any() or int(chains.sum()) * max(heads // vis.shape[0], 1) >= tuning.split_programs:
        return None
    return chains.any(0).nonzero().flatten()


def split_for(table: fp.BlockTable, rows: int, keys: int, batch: int, heads: int, kv_heads: int,
              cap: Optional[int], tuning: tn.FlexExchangeTuning) -> Optional[tuple]:
    """(c, axis) where FA4 runs a piece's forward (axis "keys") or backward
    (axis "rows") on c view rows of that pass's long side
    (:class:`fa4.SplitStep`), else None. FA4 runs a program per query tile
    forward and per key tile backward, each a chain over the tiles of the
    other side it sees (``table``, batch 1): a pass is split where its longest
    chain exceeds ``tuning.split_chain`` tiles and fewer than
    ``tuning.split_programs`` programs have such chains (more keep every SM
    busy whatever their length): c the fewest that bring every view's chains
    to ``split_chain`` or below (else the most allowed), the long side cut
    into c equal chunks of whole tiles, each at least ``split_min_blocks``.
    Of two passes that qualify, the one with the longer chain."""
    if cap is None or batch != 1:
        return None
    bq = blocks.sparse_block(cap, rows)[0]
    vis = (table.partial | table.full).any(0)  # (Hm, query tiles, key tiles)
    best = None
    for axis, dim, long_, tile, heads_ in (("keys", 2, keys, fp.BLOCK_SIZE, heads), ("rows", 1, rows, bq, kv_heads)):
        longest = int(vis.sum(dim).max())
        if _long_chains(vis, dim, heads_, tuning) is None or long_ % tile:
            continue
        n = long_ // tile
        ok = [d for d in range(2, n + 1) if n % d == 0 and n // d >= tuning.split_min_blocks
              and (axis == "keys" or blocks.sparse_block(cap, long_ // d)[0] == bq)]
        if not ok or (best is not None and best[0] >= longest):
            continue
        chunk = lambda d: int(vis.unflatten(dim, (d, n // d)).sum(dim + 1).max())  # a view's longest chain
        best = longest, next((d for d in ok if chunk(d) <= tuning.split_chain), ok[-1]), axis
    return None if best is None else best[1:]


def executor(mask_mod, qpos, kpos, batch, heads, scale, cap: Optional[int], clear=(),
             split: Optional[Callable[[fp.BlockTable, int, int], Optional[tuple]]] = None):
    """The executor of (queries at global ``qpos``) x (keys at ``kpos``), the
    blocks ``clear`` = [(query blocks of the plan's query block, first key
    block, end key block)] removed; FA4 where ``cap`` (its major compute
    capability) is given, on (c, axis) view rows where ``split(table, rows,
    keys)`` gives them (:func:`split_for`); None where nothing is visible."""
    if len(qpos) == 0 or len(kpos) == 0:
        return None
    block = blocks.sparse_block(cap, len(qpos)) if cap is not None else fp.BLOCK_SIZE
    table = _cleared(fp.block_table(mask_mod, batch, heads, qpos, kpos, block), clear)
    if table.empty:
        return None
    if cap is None:
        def make_mask():
            m = torch.ones(1, 1, len(qpos), len(kpos), dtype=torch.bool, device=qpos.device) if mask_mod is None \
                else fp.evaluate(mask_mod, fp.mask_dims(mask_mod, batch, heads, qpos, kpos), qpos, kpos).clone()
            for qb, kb0, kb1 in clear:
                m[:, :, rows_of(qb, fp.BLOCK_SIZE, len(qpos)), kb0 * fp.BLOCK_SIZE:kb1 * fp.BLOCK_SIZE] = False
            return m
        return TorchPiece(make_mask, scale)
    inner, at = _at_positions(mask_mod, qpos, kpos)
    step = lambda t, f: fa4.Step(t, block, f, blocks.aux_tensors(f, qpos.device), blocks.sparse_tensors(t), False)
    whole = step(table, at)
    split = split(table, len(qpos), len(kpos)) if split is not None else None
    if split is None:
        return fa4.RingStep(whole, scale, len(qpos), len(kpos))
    c, axis = split
    if axis == "keys":  # the chunks' tables: the whole one cut along its key blocks (batch 1: Bm = 1)
        fc = blocks.form("at_positions", c, tensors=(qpos, kpos.view(c, -1)), parts=(inner,))
        parts = [x.reshape(*x.shape[1:3], c, -1).movedim(2, 0) for x in (table.partial, table.full)]
    else:
        fc = blocks.form("at_positions", c, tensors=(qpos.view(c, -1), kpos), parts=(inner,))
        parts = [x.reshape(x.shape[1], c, -1, x.shape[3]).movedim(1, 0) for x in (table.partial, table.full)]
    split_step = step(fp.BlockTable(*(x.contiguous() for x in parts)), fc)
    return fa4.SplitStep(whole, split_step, scale, c, axis, len(qpos), len(kpos))


def _at_positions(mask_mod, qpos, kpos) -> tuple:
    """(the pattern's FA4 form, that form at global positions ``qpos`` x ``kpos``). No mask: an unbounded window,
    true at every position (FA4's block sparsity, which cleared blocks need, runs with a mask; with every block
    full it is never evaluated)."""
    inner = blocks.form("window", -1, -1) if mask_mod is None else mask_mod.fa4
    return inner, blocks.form("at_positions", tensors=(qpos, kpos), parts=(inner,))


def _cleared(table: fp.BlockTable, clear) -> fp.BlockTable:
    if not clear:
        return table
    table = fp.BlockTable(table.partial.clone(), table.full.clone())
    for qb, kb0, kb1 in clear:
        table.partial[:, :, qb, kb0:kb1] = False
        table.full[:, :, qb, kb0:kb1] = False
    return table


def _halo_executor(mask_mod, qpos, kpos, batch, heads, scale, cap: Optional[int], clear, bq: int, split,
                   window: tuple):
    """(executor, r0, r1): my rows x halo keys at ``kpos`` (the blocks
    ``clear`` removed, see :func:`_executor`), cropped to the rows [r0, r1) of
    the first to the last query block of ``bq`` rows in ``window`` (query
    blocks [lo, hi)) that sees one of them (the rows around shard edges, for
    most patterns): no executor runs rows that see none of them."""
    if len(qpos) == 0 or len(kpos) == 0:
        return None, 0, 0
    table = _cleared(fp.block_table(mask_mod, batch, heads, qpos, kpos, (bq, fp.BLOCK_SIZE)), clear)
    lo, hi = window
    idx = [i for i in (table.partial | table.full).flatten(0, 1).any(0).any(1).nonzero().flatten().tolist()
           if lo <= i < hi]
    if not idx:
        return None, 0, 0
    b0, b1 = idx[0], idx[-1] + 1
    r0, r1 = b0 * bq, min(b1 * bq, len(qpos))
    if cap is not None and blocks.sparse_block(cap, r1 - r0)[0] != bq:  # the cleared blocks would not line up
        b0, b1 = lo, hi
        r0, r1 = lo * bq, min(hi * bq, len(qpos))
        if blocks.sparse_block(cap, r1 - r0)[0] != bq:
            b0, b1, r0, r1 = 0, (len(qpos) + bq - 1) // bq, 0, len(qpos)
    keep = [(qb[(qb >= b0) & (qb < b1)] - b0, kb0, kb1) for qb, kb0, kb1 in clear]
    return executor(mask_mod, qpos[r0:r1], kpos, batch, heads, scale, cap, clear=keep, split=split), r0, r1


def _runs(flags: list) -> list:
    """[(start, end)] of the runs of True in ``flags``."""
    runs, start = [], None
    for i, f in enumerate(list(flags) + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _few_keys(tables: list, lens: list, offs: list, nqb: int, few_keys: int, share: float) -> Optional[tuple]:
    """(peer, first and end key block in its halo, [(first, end query block)]) of the few-keys pieces, or None:
    the first run of at most ``few_keys`` keys in a peer's halo, block-aligned in the concatenated halo, whose
    blocks are full (every pair visible) for every query block, batch row and head; their rows, the runs of
    query blocks that see no other halo key and hold at least ``share`` of the blocks (the others keep those
    key blocks in their halo pieces)."""
    found = None
    for p, t in enumerate(tables):
        if t is None or offs[p] % fp.BLOCK_SIZE:
            continue
        full = t.full.flatten(0, 1).all(0).all(0).tolist()
        for kb0, kb1 in _runs(full):
            if min(kb1 * fp.BLOCK_SIZE, lens[p]) - kb0 * fp.BLOCK_SIZE <= few_keys:
                found = p, kb0, kb1
                break
        if found:
            break
    if found is None:
        return None
    others = torch.zeros(nqb, dtype=torch.bool, device="cpu")  # explicit: a default device may be set
    for p, t in enumerate(tables):
        if t is None:
            continue
        vis = (t.partial | t.full).flatten(0, 1).any(0).cpu()
        if p == found[0]:
            vis[:, found[1]:found[2]] = False
        others |= vis.any(1)
    runs = [(b0, b1) for b0, b1 in _runs((~others).tolist()) if b1 - b0 >= share * nqb]
    return (*found, runs) if runs else None


def halo_pieces(mask_mod, qpos, halo_pos: list, heavy: list, batch, heads, scale, cap, bq: int, split,
                few_keys: int = 0, few_share: float = 1.0) -> tuple[list, list]:
    """The halo's executors, :class:`HaloPiece` s over my rows x the peers'
    halos concatenated in rank order (``halo_pos[p]``: their keys' positions,
    ``heavy[p]``: my query blocks computed on p, cleared against p's keys),
    and the few-keys pieces. Consecutive peers whose halos my rows see over
    overlapping row ranges share one executor (one launch, one merge: a
    pattern whose every row sees some peer's keys, global tokens), where the
    earlier halos fill whole key blocks (the cleared blocks then line up);
    others run apart, each on the rows that see it.

    ``few_keys`` > 0: a run of at most that many halo keys every row sees
    (the global tokens' keys) is a :class:`FewKeys` piece over each run of
    rows that see no other halo key and hold ``few_share`` of the rows or
    more (:func:`_few_keys`); those blocks are cleared from the halo
    executors there, which run on the rows between those runs apart. ->
    (halo pieces, few-keys pieces)."""
    lens = [len(x) for x in halo_pos]
    offs = [sum(lens[:p]) for p in range(len(lens) + 1)]
    nqb = -(-len(qpos) // bq)
    nkb = [-(-n // fp.BLOCK_SIZE) for n in lens]
    clears = [[(heavy[p], 0, nkb[p])] if len(heavy[p]) else [] for p in range(len(lens))]
    tables = [_cleared(fp.block_table(mask_mod, batch, heads, qpos, halo_pos[p], (bq, fp.BLOCK_SIZE)), clears[p])
              if n else None for p, n in enumerate(lens)]
    few, windows = [], [(0, nqb)]
    dense = _few_keys(tables, lens, offs, nqb, few_keys, few_share) if few_keys > 0 else None
    if dense is not None:
        p, kb0, kb1, runs = dense
        clears[p].append((torch.cat([torch.arange(b0, b1, device=qpos.device) for b0, b1 in runs]), kb0, kb1))
        k0, k1 = offs[p] + kb0 * fp.BLOCK_SIZE, min(offs[p] + kb1 * fp.BLOCK_SIZE, offs[p + 1])
        few = [HaloPiece(FewKeys(scale), b0 * bq, min(b1 * bq, len(qpos)), k0, k1, None) for b0, b1 in runs]
        edges = [0] + [b for r in runs for b in r] + [nqb]
        windows = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b > a]
    pieces = []
    for lo, hi in windows:
        groups, skipped = [], []
        for p in (p for p, n in enumerate(lens) if n):
            t = _cleared(tables[p], clears[p])  # the heavy blocks again (a no-op) and the few-keys blocks
            idx = [i for i in (t.partial | t.full).flatten(0, 1).any(0).any(1).nonzero().flatten().tolist()
                   if lo <= i < hi]
            if not idx:  # none of these rows sees p's halo: a group may span it (its keys are never visible)
                skipped.append(p)
                continue
            b0, b1 = idx[0], idx[-1] + 1
            last = groups[-1] if groups else None
            # a group's halos are consecutive in the concatenation, each but the last filling whole key blocks
            between = (last[0] + skipped) if last else []
            if last and b0 < last[2] and last[1] < b1 and all(lens[x] % fp.BLOCK_SIZE == 0 for x in between):
                last[0] += skipped + [p]
                last[1], last[2] = min(last[1], b0), max(last[2], b1)
            else:
                groups.append([[p], b0, b1])
            skipped = []
        for g, _, _ in groups:
            k0, k1 = offs[g[0]], offs[g[-1] + 1]
            clear = [(qb, (offs[p] - k0) // fp.BLOCK_SIZE + c0, (offs[p] - k0) // fp.BLOCK_SIZE + c1)
                     for p in g for qb, c0, c1 in clears[p] if len(qb)]
            run, r0, r1 = _halo_executor(mask_mod, qpos, torch.cat([halo_pos[p] for p in g]), batch, heads, scale,
                                         cap, clear, bq, split, (lo, hi))
            if run is not None:
                pieces.append(HaloPiece(run, r0, r1, k0, k1, None))
    return pieces, few


@dataclasses.dataclass
class HaloPiece:
    """An executor of my rows [r0, r1) x the concatenated halo keys [k0, k1);
    ``at``: (positions in the plan's ``heavy``, rows in the piece) of the
    heavy rows it covers."""

    run: object
    r0: int
    r1: int
    k0: int
    k1: int
    at: Optional[tuple]


def within(rows: torch.Tensor, r0: int, r1: int) -> tuple:
    """(positions in ``rows`` of the rows in [r0, r1), those rows - r0)."""
    sel = ((rows >= r0) & (rows < r1)).nonzero().flatten()
    return sel, rows[sel] - r0


class CarvedStep:
    """A one-device FA4 call whose pattern has a few long chains (global
    tokens: a key tile every query tile sees, a query tile that sees every
    key tile), run as pieces: forward, the chained query tiles' rows apart
    (``rows_run``, on views of the keys) and every other row in one call
    with them cleared (``fwd``), the rows written in place; backward, the
    chained key tiles apart (``keys_run``, on views of the rows) and the rest
    in one call with them cleared (``bwd``), their dK/dV written in place
    and dQ summed. Every pair is computed once per pass: the results of one
    call (:class:`fa4.RingStep`'s interface), without a chain that starts
    late and outlasts the pass (:class:`longattn.tuning.FlexFa4Tuning`).

    Equivalent PyTorch (forward; ``rows``: the chained tiles' rows)::

        out, lse = attend(q, k, v, mask without rows)
        out[:, rows], lse[:, :, rows] = attend(q[:, rows], k, v, mask at rows)
    """

    def __init__(self, fwd, rows: Optional[torch.Tensor], rows_run, bwd, keys: Optional[torch.Tensor], keys_run):
        self.fwd, self.rows, self.rows_run = fwd, rows, rows_run
        self.bwd, self.keys, self.keys_run = bwd, keys, keys_run
        # the carved tiles' rows once per view: one gather builds the views' inputs
        self.rows_rep = None if rows_run is None else rows.repeat(rows_run.c)
        self.keys_rep = None if keys_run is None else keys.repeat(keys_run.c)

    def forward(self, q, k, v):
        out, lse = self.fwd.forward(q, k, v)
        if self.rows_run is not None:
            self.rows_run.forward_into(q, self.rows, self.rows_rep, k, v, out, lse)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, dlse):
        dq, dk, dv = self.bwd.backward(dout, q, k, v, out, lse, dlse)
        if self.keys_run is not None:
            self.keys_run.backward_into(dout, q, k, v, self.keys, self.keys_rep, out, lse, dlse, dq, dk, dv)
        return dq, dk, dv


class DocumentsStep:
    """The executor of queries and keys at the same global positions whose
    pattern is documents, alone or with causal and windows
    (:func:`.blocks.documents_form`), each document one contiguous run in
    every batch row: FA4's varlen kernel over the rows' documents in one
    launch, which computes only each document's own tiles and calls no mask
    (``FlexFa4Tuning.documents_varlen``): a one-device call, and the
    exchange's own piece (a rank's zigzag chunks keep documents contiguous).
    Its needs (CUDA, fp16/bf16, sm_90 / sm_100, head dims 64 to 128) are
    within those of FA4's masks that chose FA4. ``forward(q, k, v)`` -> (out,
    lse (B, H, S)); ``backward`` from the given out, lse and dlse."""

    def __init__(self, cu: torch.Tensor, max_seqlen: int, scale: float, causal: bool, window: tuple,
                 cu_k: Optional[torch.Tensor] = None, max_seqlen_k: int = 0):
        self.cu, self.max_seqlen, self.scale, self.causal, self.window = cu, max_seqlen, scale, causal, window
        self.cu_k, self.max_seqlen_k = cu_k, max_seqlen_k  # key segments of their own (None: the queries')

    @classmethod
    def of(cls, q, k, mask_mod, scale: float, tuning: tn.FlexFa4Tuning = tn.FLEX_FA4) -> Optional["DocumentsStep"]:
        """The step of a one-device call, or None (see :meth:`at`)."""
        if k.shape[1] != q.shape[1]:
            return None
        pos = torch.arange(q.shape[1], device=q.device)
        return cls.at(mask_mod, pos, q.shape[0], scale, tuning)

    @classmethod
    def at(cls, mask_mod, pos: torch.Tensor, batch: int, scale: float,
           tuning: tn.FlexFa4Tuning = tn.FLEX_FA4) -> Optional["DocumentsStep"]:
        """The step of queries and keys at ``pos`` (increasing global
        positions), or None where the pattern is not such documents there
        (the ids are read on the host once: plans are cached). Where ``pos``
        has gaps (a zigzag shard), local offsets are not global ones, so a
        window bound other than causal's leaves the pattern to its mask."""
        form = blocks.documents_form(getattr(mask_mod, "fa4", None)) if tuning.documents_varlen else None
        if form is None or len(pos) == 0:
            return None
        ids, causal, window = form
        p = pos.cpu()
        s, last = len(p), int(p[-1])
        if bool((p[1:] <= p[:-1]).any()):
            return None
        if last - int(p[0]) + 1 != s and (window[0] >= 0 or window[1] > 0):
            return None
        if ids.shape[-1] <= last or (ids.dim() == 2 and ids.shape[0] != batch):
            return None  # the mask path reports what is wrong with them
        rows = ids.cpu()[..., p]
        rows = rows.expand(batch, s) if rows.dim() == 1 else rows
        lengths = []
        for row in rows:
            runs, counts = torch.unique_consecutive(row, return_counts=True)
            if runs.unique().numel() != runs.numel():  # a document that comes back: no varlen form
                return None
            lengths += counts.tolist()
        cu = torch.tensor([0] + lengths, device="cpu").cumsum(0).to(torch.int32)
        return cls(cu.to(pos.device), max(lengths), scale, causal, window)

    def forward(self, q, k, v):
        """q (B, S, H, D); k, v (B, S, ...) or, with key segments of their own, (T, ...)."""
        b, s, h, _ = q.shape
        flat = lambda x: x.reshape(-1, *x.shape[-2:])
        with torch.no_grad():
            out, lse = _fa4_api.forward(flat(q), flat(k), flat(v), self.scale, self.causal, self.window, self.cu,
                                        self.max_seqlen, cu_k=self.cu_k, max_seqlen_k=self.max_seqlen_k)
        return out.view(b, s, h, -1), lse.view(h, b, s).transpose(0, 1).contiguous()

    def backward(self, dout, q, k, v, out, lse, dlse, graph=None):
        b, s, h, _ = q.shape
        flat = lambda x: x.reshape(-1, *x.shape[-2:])
        packed = lambda x: None if x is None else x.transpose(0, 1).reshape(h, b * s)  # varlen lse: (H, T)
        dq, dk, dv = _fa4_api.backward(flat(dout), flat(q), flat(k), flat(v), flat(out), packed(lse), self.scale,
                                       self.causal, self.window, packed(dlse), self.cu, self.max_seqlen,
                                       cu_k=self.cu_k, max_seqlen_k=self.max_seqlen_k)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


class JoinedKeys:
    """An exchange rank's own executor over [halo keys | its keys] (every
    peer's halo rows in rank order, as they arrive, then the shard's):
    ``run`` takes the concatenation (its table at those keys' positions,
    :func:`executor`), ``halo`` keys before the shard's.
    ``forward(q, kh, k, vh, v)`` -> (out, lse); ``backward`` -> (dq, dk,
    dv, dk of the halo, dv of the halo)."""

    def __init__(self, run, halo: int):
        self.run, self.halo = run, halo

    def forward(self, q, kh, k, vh, v):
        return self.run.forward(q, torch.cat([kh, k], 1), torch.cat([vh, v], 1))

    def backward(self, dout, q, kh, k, vh, v, out, lse, dlse):
        dq, dk, dv = self.run.backward(dout, q, torch.cat([kh, k], 1), torch.cat([vh, v], 1), out, lse, dlse)
        n = self.halo
        return dq, dk[:, n:], dv[:, n:], dk[:, :n], dv[:, :n]


class JoinedDocuments:
    """A rank's causal documents as FA4's varlen kernel with each
    document's earlier keys from the peers (the halo) in its key segment:
    ``step``, a :class:`DocumentsStep` whose query segments are the rank's
    runs of one document and whose key segments hold the halo keys of that
    document, in position order, then the run's own keys (causal
    bottom-right). The segments' keys are gathered into one buffer
    (``own_dst`` / ``halo_dst``: rows of the flattened (batch x rows) shard /
    used halo rows ``halo_src`` in it) and their gradients scattered back. The
    interface of :class:`JoinedKeys`."""

    def __init__(self, step: DocumentsStep, own_dst, halo_src, halo_dst, total: int):
        self.step, self.own_dst, self.halo_src, self.halo_dst, self.total = step, own_dst, halo_src, halo_dst, total

    @classmethod
    def at(cls, mask_mod, pos: torch.Tensor, hpos: torch.Tensor, batch: int, scale: float,
           tuning: tn.FlexFa4Tuning = tn.FLEX_FA4) -> Optional["JoinedDocuments"]:
        """The executor of my rows at ``pos`` against the halo keys at
        ``hpos`` (rank order) and my keys, or None where the pattern is not
        causal documents in runs whose halo keys all come before them (and,
        with a window, at consecutive positions through the run)."""
        form = blocks.documents_form(getattr(mask_mod, "fa4", None)) if tuning.documents_varlen else None
        if form is None or not form[1] or len(pos) == 0 or len(hpos) == 0:
            return None
        ids, _, window = form
        p, hp = pos.cpu(), hpos.cpu()
        last = int(max(p[-1], hp.max()))
        if bool((p[1:] <= p[:-1]).any()) or ids.shape[-1] <= last or (ids.dim() == 2 and ids.shape[0] != batch):
            return None
        rows, hrows = (ids.cpu()[..., x] for x in (p, hp))
        rows, hrows = (x.expand(batch, x.shape[-1]) if x.dim() == 1 else x for x in (rows, hrows))
        cu_q, cu_k, own_dst, halo_src, halo_dst = [0], [0], [], [], []
        for bi in range(batch):
            runs, counts = torch.unique_consecutive(rows[bi], return_counts=True)
            if runs.unique().numel() != runs.numel():  # a document that comes back: no varlen form
                return None
            a = 0
            for d, n in zip(runs.tolist(), counts.tolist()):
                mine = hrows[bi] == d
                first = int(p[a])
                if bool((mine & (hp > first)).any()):  # a later key of the run's document: not bottom-right
                    return None
                sel = mine.nonzero().flatten()
                sel = sel[torch.argsort(hp[sel])]
                kp = torch.cat([hp[sel], p[a:a + n]])
                if (window[0] >= 0 or window[1] > 0) and bool((kp[1:] - kp[:-1] != 1).any()):
                    return None  # a window bound counts offsets in the segment: positions must be consecutive
                t = cu_k[-1]
                halo_src += (bi * len(hp) + sel).tolist()
                halo_dst += range(t, t + len(sel))
                own_dst += range(t + len(sel), t + len(sel) + n)
                cu_q.append(cu_q[-1] + n)
                cu_k.append(t + len(sel) + n)
                a += n
        dev = pos.device
        long_ = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        cu = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
        qlens, klens = (torch.tensor(x, device="cpu").diff() for x in (cu_q, cu_k))
        step = DocumentsStep(cu(cu_q), int(qlens.max()), scale, True, window, cu(cu_k), int(klens.max()))
        return cls(step, long_(own_dst), long_(halo_src), long_(halo_dst), cu_k[-1])

    def _keys(self, xh, x):
        flat = lambda t: t.reshape(-1, *t.shape[2:])
        out = x.new_empty(self.total, *x.shape[2:])
        out.index_copy_(0, self.own_dst, flat(x))
        out.index_copy_(0, self.halo_dst, flat(xh).index_select(0, self.halo_src))
        return out

    def forward(self, q, kh, k, vh, v):
        return self.step.forward(q, self._keys(kh, k), self._keys(vh, v))

    def backward(self, dout, q, kh, k, vh, v, out, lse, dlse):
        dq, dk, dv = self.step.backward(dout, q, self._keys(kh, k), self._keys(vh, v), out, lse, dlse)

        def back(g, xh, x):  # the shard's rows in order; halo rows no segment used get 0
            gh = g.new_zeros(xh.shape[0] * xh.shape[1], *g.shape[1:])
            gh.index_copy_(0, self.halo_src, g.index_select(0, self.halo_dst))
            return g.index_select(0, self.own_dst).view(x.shape), gh.view(xh.shape)
        (dk_, dkh), (dv_, dvh) = back(dk, kh, k), back(dv, vh, v)
        return dq, dk_, dv_, dkh, dvh


def single_executor(q, k, mask_mod, scale: float, tuning: tn.FlexFa4Tuning = tn.FLEX_FA4):
    """The FA4 executor of a one-device flex call (cached in
    :data:`.schedule.PLANS`): a :class:`DocumentsStep` (FA4's varlen kernel)
    where the pattern is contiguous documents with causal or windows, a
    :class:`fa4.RingStep` of the whole call, or a
    :class:`CarvedStep` where the pattern has tiles with long chains that
    views would cut (batch 1, :func:`split_for` with ``tuning``); None where
    no query sees a key."""
    key = ("fa4", schedule.pattern_key(mask_mod), tuple(q.shape), tuple(k.shape), str(q.device), scale, tuning)
    return schedule.PLANS.get_or(key, lambda: _single(q, k, mask_mod, scale, tuning), q, "flex_attention")


def _single(q, k, mask_mod, scale, tuning):
    docs = DocumentsStep.of(q, k, mask_mod, scale, tuning)
    if docs is not None:
        return docs
    dev = q.device
    qpos, kpos = (torch.arange(n, dtype=torch.int32, device=dev) for n in (q.shape[1], k.shape[1]))
    return carved(mask_mod, qpos, kpos, q.shape[0], q.shape[2], k.shape[2], scale,
                  fa4.KERNEL.capability(dev)[0], tuning, fa4.single_step(q, k, mask_mod))


def carved(mask_mod, qpos, kpos, batch: int, heads: int, kv_heads: int, scale: float, cap: int, tuning,
           step: Optional["fa4.Step"] = None):
    """The FA4 executor of queries at ``qpos`` x keys at ``kpos`` (``step``:
    its form there, made where not given): a :class:`fa4.RingStep`, or a
    :class:`CarvedStep` where at batch 1 the pattern has tiles with long
    chains that views would cut (:func:`split_for` with ``tuning``, which
    holds ``split_chain``, ``split_programs`` and ``split_min_blocks``: a
    one-device call's :class:`longattn.tuning.FlexFa4Tuning`, the exchange's
    joined own piece's :class:`longattn.tuning.FlexExchangeTuning`); None
    where no query sees a key."""
    if step is None:
        step = fa4.make_step(mask_mod, batch, heads, qpos, kpos, cap, _at_positions(mask_mod, qpos, kpos)[1])
    if step.empty:
        return None
    lq, lk, dev = len(qpos), len(kpos), qpos.device
    whole = fa4.RingStep(step, scale, lq, lk)
    vis = (step.table.partial | step.table.full).any(0)
    rows, keys = _long_chains(vis, 2, heads, tuning), _long_chains(vis, 1, kv_heads, tuning)
    if batch != 1 or (rows is None and keys is None):
        return whole
    split = lambda table, r, c: split_for(table, r, c, batch, heads, kv_heads, cap, tuning)
    cleared = lambda t: fa4.RingStep(fa4.Step(t, step.block, step.form, step.aux, blocks.sparse_tensors(t), t.empty),
                                     scale, lq, lk)
    fwd = bwd = whole
    qrows = krows = rows_run = keys_run = None
    if rows is not None:  # the chained query tiles' rows against every key, on views of the keys
        qrows = rows_of(rows, step.block[0], lq)
        rows_run = executor(mask_mod, qpos[qrows], kpos, batch, heads, scale, cap, split=split)
        if isinstance(rows_run, fa4.SplitStep):
            fwd = cleared(_cleared(step.table, [(rows, 0, vis.shape[2])]))
        else:
            qrows = rows_run = None
    if keys is not None:  # every row against the chained key tiles, on views of the rows
        krows = rows_of(keys, step.block[1], lk)
        keys_run = executor(mask_mod, qpos, kpos[krows], batch, heads, scale, cap, split=split)
        if isinstance(keys_run, fa4.SplitStep):
            every = torch.arange(vis.shape[1], device=dev)
            bwd = cleared(_cleared(step.table, [(every, int(t), int(t) + 1) for t in keys.tolist()]))
        else:
            krows = keys_run = None
    if rows_run is None and keys_run is None:
        return whole
    return CarvedStep(fwd, qrows, rows_run, bwd, krows, keys_run)
