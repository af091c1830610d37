"""longattn.masks against dense boolean definitions written plainly (Python
loops over positions), evaluated both on broadcast index tensors and as
FlexAttention evaluates them (torch.vmap over scalars); the block planner
of longattn/flex/plan.py against the dense mask it summarises."""
import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from longattn import masks
from longattn.flex import plan as fp
from reference import dense_mask, dilated_masks

B, H, S = 2, 4, 24


def plain(fn, batch=B, heads=H, s=S):
    """(B, H, S, S) bool from fn(b, h, q, k) on Python ints."""
    out = torch.zeros(batch, heads, s, s, dtype=torch.bool)
    for b, h, q, k in itertools.product(range(batch), range(heads), range(s), range(s)):
        out[b, h, q, k] = bool(fn(b, h, q, k))
    return out


def check(mask_mod, fn):
    want = plain(fn)
    assert torch.equal(dense_mask(mask_mod, B, H, S), want)  # broadcast index tensors
    assert torch.equal(create_mask(mask_mod, B, H, S, S, "cpu"), want)  # FlexAttention's vmap over scalars


DOCS = [0] * 5 + [1] * 3 + [2] * 9 + [3] * 7
CU = [0, 5, 8, 17, 24]
LAYOUT = torch.rand(S // 4, S // 4, generator=torch.Generator().manual_seed(3)) < 0.4
HEAD_LAYOUT = torch.rand(H, S // 6, S // 6, generator=torch.Generator().manual_seed(4)) < 0.5
FLAGS = torch.zeros(S, dtype=torch.bool)
FLAGS[[0, 9, 20]] = True

CASES = {
    "causal": (masks.causal(), lambda b, h, q, k: k <= q),
    "sliding causal": (masks.sliding_window(4, 0), lambda b, h, q, k: 0 <= q - k <= 4),
    "sliding both": (masks.sliding_window(2, 3), lambda b, h, q, k: -3 <= q - k <= 2),
    "sliding right only": (masks.sliding_window(-1, 1), lambda b, h, q, k: k - q <= 1),
    "document ids": (masks.document(torch.tensor(DOCS)), lambda b, h, q, k: DOCS[q] == DOCS[k]),
    "document cu_seqlens": (masks.document(cu_seqlens=torch.tensor(CU, dtype=torch.int32)),
                            lambda b, h, q, k: DOCS[q] == DOCS[k]),
    "document per batch": (masks.document(torch.tensor([DOCS, sorted(DOCS, key=lambda d: -d)])),
                           lambda b, h, q, k: (DOCS if b == 0 else sorted(DOCS, key=lambda d: -d))[q]
                           == (DOCS if b == 0 else sorted(DOCS, key=lambda d: -d))[k]),
    "prefix_lm": (masks.prefix_lm(6), lambda b, h, q, k: k < 6 or k <= q),
    "prefix_lm per batch": (masks.prefix_lm(torch.tensor([3, 10])), lambda b, h, q, k: k < [3, 10][b] or k <= q),
    "local_global first n": (masks.local_global(2, 3), lambda b, h, q, k: abs(q - k) <= 2 or q < 3 or k < 3),
    "local_global flags": (masks.local_global(1, FLAGS), lambda b, h, q, k: abs(q - k) <= 1 or FLAGS[q] or FLAGS[k]),
    "block_sparse": (masks.block_sparse(LAYOUT, 4), lambda b, h, q, k: LAYOUT[q // 4, k // 4]),
    "block_sparse per head": (masks.block_sparse(HEAD_LAYOUT, 6), lambda b, h, q, k: HEAD_LAYOUT[h, q // 6, k // 6]),
    "dilated branch": (masks.dilated_branch(8, 2),
                       lambda b, h, q, k: q // 8 == k // 8 and (q % 8) % 2 == h % 2 and (k % 8) % 2 == h % 2),
    "dilated branch causal": (masks.dilated_branch(12, 3, causal=True),
                              lambda b, h, q, k: q // 12 == k // 12 and (q % 12) % 3 == h % 3
                              and (k % 12) % 3 == h % 3 and k <= q),
    "and": (masks.and_(masks.causal(), masks.sliding_window(3, -1), masks.document(torch.tensor(DOCS))),
            lambda b, h, q, k: k <= q and q - k <= 3 and DOCS[q] == DOCS[k]),
    "or": (masks.or_(masks.sliding_window(1, 1), masks.prefix_lm(2)),
           lambda b, h, q, k: abs(q - k) <= 1 or k < 2 or k <= q),
}


@pytest.mark.parametrize("name", list(CASES))
def test_mask_matches_plain_definition(name):
    mask_mod, fn = CASES[name]
    check(mask_mod, fn)


def test_dilated_is_the_union_of_the_reference_branches():
    segs, rates = (4, 8, 24), (1, 2, 4)
    union = torch.stack(dilated_masks(S, H, segs, rates, causal=True)).any(0)
    got = dense_mask(masks.dilated(segs, rates, causal=True), 1, H, S)[0]
    assert torch.equal(got, union)
    for (w, r), ref in zip(zip(segs, rates), dilated_masks(S, H, segs, rates, causal=False)):
        assert torch.equal(dense_mask(masks.dilated_branch(w, r), 1, H, S)[0], ref)


def test_pattern_keys():
    """Equal patterns (tensors by content) share a key, so their block masks are cached once."""
    assert masks.sliding_window(5, 0).pattern_key == masks.sliding_window(5, 0).pattern_key
    assert masks.sliding_window(5, 0).pattern_key != masks.sliding_window(6, 0).pattern_key
    d1, d2 = masks.document(torch.tensor(DOCS)), masks.document(cu_seqlens=torch.tensor(CU))
    assert d1.pattern_key == d2.pattern_key  # the same documents, given two ways
    assert masks.document(torch.tensor(DOCS[::-1])).pattern_key != d1.pattern_key
    both = masks.and_(masks.causal(), d1)
    assert both.pattern_key == masks.and_(masks.causal(), d2).pattern_key
    assert not hasattr(masks.and_(masks.causal(), lambda b, h, q, k: q > 0), "pattern_key")  # cached by identity


def test_bad_arguments():
    with pytest.raises(ValueError, match="left"):
        masks.sliding_window(-2)
    with pytest.raises(ValueError, match="exactly one"):
        masks.document()
    with pytest.raises(ValueError, match="cu_seqlens"):
        masks.document(cu_seqlens=torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="doc_ids"):
        masks.document(torch.zeros(4))
    with pytest.raises(ValueError, match="global_tokens"):
        masks.local_global(2, torch.zeros(4))
    with pytest.raises(ValueError, match="layout"):
        masks.block_sparse(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="same length"):
        masks.dilated((4, 8), (1,))
    with pytest.raises(TypeError, match="and_"):
        masks.and_()


# ------------------------------------------------------------------ the block planner
def _blocks(dense, bq, bk):
    """partial / full per block from a dense (B, H, Sq, Sk) mask, by loops."""
    b, h, sq, sk = dense.shape
    nq, nk = -(-sq // bq), -(-sk // bk)
    part = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    full = torch.zeros_like(part)
    for i, j in itertools.product(range(nq), range(nk)):
        blk = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
        full[:, :, i, j] = blk.flatten(2).all(-1)
        part[:, :, i, j] = blk.flatten(2).any(-1) & ~full[:, :, i, j]
    return part, full


@pytest.mark.parametrize("name", ["causal", "document ids", "block_sparse per head", "prefix_lm per batch", "or"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_block_tables_summarise_the_mask(name, layout):
    """Every step's table: full blocks all visible, partial ones some, the rest
    none, for the rows a rank holds (block 5: blocks straddle zigzag's chunks);
    a mask that depends on neither b nor h gets one table for all."""
    mask_mod, _ = CASES[name]
    world, local = 3, 8
    full_mask = dense_mask(mask_mod, B, H, world * local)
    for rank in range(world):
        qpos = fp.global_positions(layout, rank, world, local)
        tables = fp.rank_tables(mask_mod, layout, rank, world, local, B, H, block=5)
        for s, t in enumerate(tables):
            kpos = fp.global_positions(layout, (rank - s) % world, world, local)
            sub = full_mask[:, :, qpos.long()][:, :, :, kpos.long()]
            part, full = _blocks(sub, 5, 5)
            assert t.partial.shape[0] in (1, B) and t.partial.shape[1] in (1, H)
            assert torch.equal(t.partial.expand_as(part), part) and torch.equal(t.full.expand_as(full), full)
            assert t.empty == (not sub.any())
    dep = {"causal": (1, 1), "document ids": (1, 1), "block_sparse per head": (1, H), "prefix_lm per batch": (B, 1),
           "or": (1, 1)}[name]
    assert tuple(fp.rank_tables(mask_mod, layout, 0, world, local, B, H, block=5)[0].full.shape[:2]) == dep


def test_vmap_fallback_for_scalar_only_masks():
    """A mask that runs only on scalars (here torch.stack of the indices) is
    evaluated with torch.vmap, per batch row and head."""
    def scalar_only(b, h, q, k):
        return torch.stack([q, k]).max(0).values % 3 == 0
    qpos = torch.arange(10, dtype=torch.int32)
    t = fp.block_table(scalar_only, 2, 3, qpos, qpos, block=4)
    want = plain(lambda b, h, q, k: max(q, k) % 3 == 0, 2, 3, 10)
    part, full = _blocks(want, 4, 4)
    assert t.partial.shape == part.shape and torch.equal(t.partial, part) and torch.equal(t.full, full)
    with pytest.raises(TypeError, match="bool"):
        fp.block_table(lambda b, h, q, k: q - k, 1, 1, qpos, qpos)


def test_position_map_and_steps():
    for layout, world, local in itertools.product(("contiguous", "zigzag"), (1, 2, 3), (4, 6)):
        for rank in range(world):
            idx = torch.arange(local, dtype=torch.int32)
            got = fp.to_global(idx, fp.position_map(layout, rank, world, local))
            assert torch.equal(got, fp.global_positions(layout, rank, world, local))
    # a causal window of 3 over shards of 8: the own block and the previous one (2 of 4 steps)
    steps = [fp.steps_needed(fp.rank_tables(masks.sliding_window(3, 0), "contiguous", r, 4, 8, 1, 1))
             for r in range(4)]
    assert steps == [1, 2, 2, 2]
    # documents within shards: every rank needs its own block only
    docs = masks.document(torch.arange(32) // 8)
    assert {fp.steps_needed(fp.rank_tables(docs, "contiguous", r, 4, 8, 1, 1)) for r in range(4)} == {1}
