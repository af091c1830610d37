"""FlashAttention-4 for the patterns of longattn.masks (longattn/flex/blocks.py,
longattn/flex/fa4.py).

On CPU: every named pattern's FA4 form (its mask body, run on torch tensors
with the padded aux tensors FA4 receives) against the pattern itself; the
exact block plans at FA4's sparse blocks against dense masks (ragged
lengths, GQA, per batch row / head); FA4's block-sparse tensors decoded back;
the ring step's form at global offsets; the choice between FA4 and
FlexAttention; the check that FA4's mask arguments are where they were; and
the whole call (forward, backward with the lse's gradient) through a
stand-in for FA4's interface that applies the tensors as FA4 reads them.

On a GPU with flash-attn-4: every named pattern through FA4 and through torch's
FlexAttention against float64, outputs, lse and all gradients within 2x the
error of SDPA in bf16 with the same mask.
"""
import dataclasses
import types

import pytest
import torch

import longattn
from longattn import masks
from longattn.backends import _fa4_api
from longattn.flex import blocks, fa4
from longattn.flex import plan as fp
from longattn.ops.flex import explain_flex
from reference import assert_close, dense_mask, flex_ref, rel_err, results

S = 300  # not a multiple of any tile


def patterns(dev="cpu"):
    """Every named pattern of longattn.masks and combinations of them (their tensors on ``dev``)."""
    g = torch.Generator().manual_seed(5)
    docs = torch.repeat_interleave(torch.arange(6), torch.tensor([40, 7, 120, 1, 60, 72]))
    flags = torch.rand(S, generator=g) < 0.03
    layout = torch.rand(-(-S // 32), -(-S // 32), generator=g) < 0.3
    layout[3] = False  # a query block that sees nothing
    head_layout = torch.rand(4, -(-S // 48), -(-S // 48), generator=g) < 0.4
    docs, flags, layout, head_layout = (t.to(dev) for t in (docs, flags, layout, head_layout))
    return {
        "causal": masks.causal(),
        "sliding_window": masks.sliding_window(50, 0),
        "sliding_window_both": masks.sliding_window(30, 17),
        "sliding_window_right": masks.sliding_window(-1, 9),
        "document_cu": masks.document(cu_seqlens=torch.tensor([0, 40, 47, 167, 168, 228, 300], device=dev)),
        "document_rows": masks.document(torch.stack([docs, docs.flip(0)])),
        "prefix_lm": masks.prefix_lm(70),
        "prefix_lm_rows": masks.prefix_lm(torch.tensor([10, 200], device=dev)),
        "local_global": masks.local_global(20, 5),
        "local_global_flags": masks.local_global(11, flags),
        "block_sparse": masks.block_sparse(layout, 32),
        "block_sparse_heads": masks.block_sparse(head_layout, 48),
        "dilated": masks.dilated([64, 128], [1, 2]),
        "dilated_causal": masks.dilated([32, 96], [2, 3], causal=True),
        "and": masks.and_(masks.causal(), masks.sliding_window(90, 0), masks.document(docs)),
        "or": masks.or_(masks.local_global(8, flags), masks.block_sparse(layout, 32)),
        "nested": masks.and_(masks.or_(masks.prefix_lm(40), masks.sliding_window(25, 25)), masks.document(docs)),
    }


PATTERNS = patterns()
DOCS = torch.repeat_interleave(torch.arange(6), torch.tensor([40, 7, 120, 1, 60, 72]))
DOCS2 = torch.stack([DOCS, DOCS.flip(0)])


def _idx(b, h, sq, sk):
    v = lambda n, d: torch.arange(n, dtype=torch.int32).view([n if i == d else 1 for i in range(4)])
    return v(b, 0), v(h, 1), v(sq, 2), v(sk, 3)


# ------------------------------------------------------------------ the forms (CPU)
@pytest.mark.parametrize("name", list(PATTERNS))
def test_form_body_is_the_pattern(name):
    """The body FA4 compiles, run on torch tensors with the padded int32 aux
    tensors it receives, equals the pattern; reads on the padded rows and
    columns of a last tile (up to 256 past the end) stay in bounds."""
    m = PATTERNS[name]
    assert m.fa4 is not None
    body, reads = blocks.mask_body(m.fa4, blocks.TorchOps)
    aux = blocks.aux_tensors(m.fa4, "cpu")
    assert len(aux) == len(reads) and all(t.dtype == torch.int32 and t.is_contiguous() for t in aux)
    got = body(*_idx(2, 4, S, S), aux).expand(2, 4, S, S)
    assert torch.equal(got, dense_mask(m, 2, 4, S))
    body(*_idx(2, 4, S + 256, S + 256), aux)  # no IndexError


def test_user_functions_have_no_form():
    mine = lambda b, h, q, k: (q - k) % 3 == 0
    assert getattr(mine, "fa4", None) is None
    assert masks.and_(masks.causal(), mine).fa4 is None and masks.or_(mine, masks.causal()).fa4 is None
    assert masks.and_(masks.causal(), masks.prefix_lm(3)).fa4.kind == "and"


def test_code_hash_ignores_tensor_contents_only():
    a, b = masks.document(DOCS), masks.document(DOCS.flip(0))
    assert a.fa4.code_hash() == b.fa4.code_hash()
    assert a.fa4.code_hash() != masks.document(DOCS2).fa4.code_hash()  # 2-D ids: other code
    assert masks.sliding_window(3).fa4.code_hash() != masks.sliding_window(4).fa4.code_hash()
    assert masks.and_(masks.causal(), a).fa4.code_hash() != masks.or_(masks.causal(), a).fa4.code_hash()


def _cute_modules():
    """cutlass's CuTe DSL (it runs ``cute.jit`` host code on CPU) and
    ``scalar_to_ssa`` from FA4's utils where flash-attn-4 imports (else the
    same three lines)."""
    installed = _fa4_api.installed_version() != "unknown"
    if not installed:  # the DSL alone may be; with FA4 installed, its DSL and utils must import
        pytest.importorskip("cutlass.cute")
    import cutlass
    import cutlass.cute as cute
    if installed:
        from flash_attn.cute import utils
    else:  # the DSL without FA4: its helper, as FA4 writes it
        def scalar_to_ssa(a, dtype):
            vec = cute.make_rmem_tensor(1, dtype)
            vec[0] = a
            return vec.load()
        utils = types.SimpleNamespace(scalar_to_ssa=scalar_to_ssa)
    return types.SimpleNamespace(cutlass=cutlass, cute=cute, utils=utils)


def _run_cute_mask(f, batch, heads, n):
    """The form's CuTe mask_mod (what FA4 compiles) evaluated at every (b, h, q, kv)
    in [0, n), in a ``cute.jit`` host loop with the padded aux tensors FA4 receives."""
    fa = _cute_modules()
    cutlass, cute, ssa, i32 = fa.cutlass, fa.cute, fa.utils.scalar_to_ssa, fa.cutlass.Int32
    from cutlass.cute.runtime import from_dlpack

    mask_mod = fa4.build_mask(f, fa)
    aux = blocks.aux_tensors(f, "cpu")
    used = len(aux)

    @cute.jit
    def host(out, a0, a1, a2):
        tensors = [a0, a1, a2][:used]
        for b in cutlass.range(batch):
            for h in cutlass.range(heads):
                for i in cutlass.range(n):
                    for j in cutlass.range(n):
                        m = mask_mod(ssa(b, i32), ssa(h, i32), ssa(i, i32), ssa(j, i32), None, tensors)
                        out[b, h, i, j] = i32(1) if cutlass.Boolean(m[0]) else i32(0)

    out = torch.zeros(batch, heads, n, n, dtype=torch.int32)
    args = (aux + [torch.zeros(1, dtype=torch.int32)] * 3)[:3]
    assert used <= 3
    host(from_dlpack(out), *(from_dlpack(a) for a in args))
    return out.bool()


@pytest.mark.parametrize("name", list(PATTERNS))
def test_cute_mask_is_the_pattern(name):
    """FA4's mask_mod itself (cute.jit, run as host code: needs cutlass's DSL,
    no GPU) equals the pattern; reads 256 past the end stay in the padding."""
    m = PATTERNS[name]
    got = _run_cute_mask(m.fa4, 2, 4, S + 256)[:, :, :S, :S]
    assert torch.equal(got, dense_mask(m, 2, 4, S))


# ------------------------------------------------------------------ block plans (CPU)
def dense_from_tensors(cnt: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The (B, H, rows, n) bool table a count / index pair lists (how FA4 reads them)."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None].long()
    dense = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, torch.where(listed, idx.long(), n), True)
    return dense[..., :n]


def _regions(dense, bq, bk):
    """(any, all) per (query block, key block) of a (B, H, Sq, Sk) bool mask."""
    b, h, sq, sk = dense.shape
    nq, nk = -(-sq // bq), -(-sk // bk)
    anyv = torch.zeros(b, h, nq, nk, dtype=torch.bool)
    allv = torch.zeros_like(anyv)
    for i in range(nq):
        for j in range(nk):
            r = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            anyv[:, :, i, j], allv[:, :, i, j] = r.flatten(2).any(-1), r.flatten(2).all(-1)
    return anyv, allv


def _check_table(t, dense, bq, bk):
    anyv, allv = _regions(dense, bq, bk)
    full, part = t.full.expand_as(anyv), t.partial.expand_as(anyv)
    assert torch.equal(full, allv), "full blocks are exactly those entirely visible"
    assert torch.equal(part, anyv & ~allv), "partial blocks are exactly those partly visible"
    assert not (full & part).any()
    assert t.empty == (not dense.any())


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("block,sq,sk", [((128, 128), S, S), ((256, 128), S, S), ((16, 24), 100, 90),
                                         ((128, 128), 260, S)])
def test_block_plan_against_dense(name, block, sq, sk):
    """Exact plans at FA4's sparse blocks (sm_90 128 x 128, sm_100 256 x 128)
    and small ones, lengths not multiples of the block, query and key lengths
    apart; 4 query heads (GQA: the plan is per query head)."""
    m = PATTERNS[name]
    t = fp.block_table(m, 2, 4, torch.arange(sq, dtype=torch.int32), torch.arange(sk, dtype=torch.int32), block)
    _check_table(t, dense_mask(m, 2, 4, sq, sk), *block)


@pytest.mark.parametrize("name", ["causal", "document_rows", "block_sparse_heads", "or"])
def test_fa4_tensors_list_the_table(name):
    """FA4's tensors: per query block the key blocks (forward), per key block
    the query blocks (backward), ascending within each count."""
    m = PATTERNS[name]
    pos = torch.arange(S, dtype=torch.int32)
    t = fp.block_table(m, 2, 4, pos, pos, (16, 24))
    ts = blocks.sparse_tensors(t)
    nq, nk = t.full.shape[-2:]
    for which, n, part, full in (("fwd", nk, t.partial, t.full), ("bwd", nq, t.partial.mT, t.full.mT)):
        x = ts[which]
        assert all(v.dtype == torch.int32 and v.is_contiguous() for v in x.values())
        assert torch.equal(dense_from_tensors(x["mask_block_cnt"], x["mask_block_idx"], n), part)
        assert torch.equal(dense_from_tensors(x["full_block_cnt"], x["full_block_idx"], n), full)
        for cnt, idx in ((x["mask_block_cnt"], x["mask_block_idx"]), (x["full_block_cnt"], x["full_block_idx"])):
            listed = torch.arange(idx.shape[-1]) < cnt[..., None]
            step = idx[..., 1:] - idx[..., :-1]
            assert (step[listed[..., 1:]] > 0).all()


@pytest.mark.parametrize("lq,lk", [(128, 4096), (4096, 128), (128, 128)])
def test_sparse_tensors_have_unit_last_stride(lq, lk):
    """FA4 checks the last dim's stride is 1 even where that dim has one element: one query block (the global
    rows an exchange rank serves) makes the backward's per-key-block lists (B, H, N, 1) a transposed view, whose
    contiguous() keeps stride N."""
    qpos, kpos = torch.arange(lq, dtype=torch.int32), torch.arange(lk, dtype=torch.int32)
    table = fp.block_table(masks.local_global(64, 16), 1, 2, qpos, kpos, (128, 128))
    for which, lists in blocks.sparse_tensors(table).items():
        for name, t in lists.items():
            assert t.stride(-1) == 1 and t.is_contiguous(), (which, name, t.shape, t.stride())


def test_sparse_block_sizes():
    assert blocks.sparse_block(9, 32768) == (128, 128) and blocks.sparse_block(9, 100) == (128, 128)
    assert blocks.sparse_block(10, 32768) == (256, 128) and blocks.sparse_block(10, 128) == (128, 128)


# ------------------------------------------------------------------ the ring step's form (CPU)
@pytest.mark.parametrize("name", ["causal", "document_rows", "local_global_flags", "block_sparse_heads", "and"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_step_form_at_offsets(name, layout):
    """Each (rank, step) of a 3-rank ring: the plan of local queries against
    the visiting keys at their global positions, and the form FA4 runs on
    local indices (position tables as aux tensors), against the dense mask."""
    m, world, local = PATTERNS[name], 3, S // 3
    full = dense_mask(m, 2, 4, S)
    for rank in range(world):
        qpos = fp.global_positions(layout, rank, world, local)
        for s in range(world):
            kpos = fp.global_positions(layout, (rank - s) % world, world, local)
            step = fa4.ring_step(m, qpos, kpos, 2, 4, 9)
            sub = full[:, :, qpos.long()][:, :, :, kpos.long()]
            _check_table(step.table, sub, *step.block)
            body, _ = blocks.mask_body(step.form, blocks.TorchOps)
            got = body(*_idx(2, 4, local, local), step.aux).expand_as(sub)
            assert torch.equal(got, sub), (rank, s)
            body(*_idx(2, 4, local + 256, local + 256), step.aux)  # padded reads in bounds


@pytest.mark.parametrize("name", ["and", "block_sparse_heads", "document_rows"])
def test_cute_ring_step_form(name):
    """The ring step's CuTe mask_mod (local indices through the position
    tables) equals the pattern at the step's global positions."""
    m = PATTERNS[name]
    full = dense_mask(m, 2, 4, S)
    qpos, kpos = fp.global_positions("zigzag", 1, 3, 100), fp.global_positions("zigzag", 2, 3, 100)
    step = fa4.ring_step(m, qpos, kpos, 2, 4, 9)
    got = _run_cute_mask(step.form, 2, 4, 100 + 256)[:, :, :100, :100]
    assert torch.equal(got, full[:, :, qpos.long()][:, :, :, kpos.long()])


def test_ring_step_without_a_mask():
    qpos, kpos = fp.global_positions("zigzag", 0, 2, 200), fp.global_positions("zigzag", 1, 2, 200)
    step = fa4.ring_step(None, qpos, kpos, 2, 4, 9)
    assert step.form is None and step.aux is None and bool(step.table.full.all()) and not step.table.partial.any()


# ------------------------------------------------------------------ the choice (CPU)
class _Gpu(fa4.Fa4Masks):
    def __init__(self, cap=(9, 0), why=None):
        self.cap, self.why = cap, why

    def capability(self, device):
        return self.cap

    def problem(self):
        return self.why


def _t(*shape, dtype=torch.bfloat16, device="cuda"):
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=tuple(shape))


Q = _t(1, 1024, 8, 128)
KV = _t(1, 1024, 2, 128)


@pytest.mark.parametrize("cap", [(9, 0), (10, 0)])
def test_named_patterns_choose_fa4(cap):
    for m in (*PATTERNS.values(), None):
        got = fa4.explain(Q, KV, KV, m, None, "auto", _Gpu(cap))
        assert got == {"kernel": "fa4", "fa4": [], "flex": []}


@pytest.mark.parametrize("case,args,gpu,why", [
    ("own mask", dict(mask_mod=lambda b, h, q, k: k <= q), _Gpu(), "no FA4 form"),
    ("and_ with own mask", dict(mask_mod=masks.and_(masks.causal(), lambda b, h, q, k: q >= 0)), _Gpu(),
     "no FA4 form"),
    ("score_mod", dict(mask_mod=masks.causal(), score_mod=lambda s, b, h, q, k: s), _Gpu(), "score_mod"),
    ("sm_80", dict(mask_mod=masks.causal()), _Gpu((8, 0)), "sm_90 and sm_100 only"),
    ("not installed", dict(mask_mod=masks.causal()), _Gpu(why="flash-attn-4 not installed"), "not installed"),
    ("head dim 192", dict(mask_mod=masks.causal(), q=_t(1, 1024, 8, 192), kv=_t(1, 1024, 2, 192)), _Gpu(),
     "head dims 192/192"),
    ("fp32", dict(mask_mod=masks.causal(), q=_t(1, 64, 8, 128, dtype=torch.float32),
                  kv=_t(1, 64, 2, 128, dtype=torch.float32)), _Gpu(), "fp16/bf16"),
    ("cpu", dict(mask_mod=masks.causal(), q=_t(1, 64, 8, 128, device="cpu"), kv=_t(1, 64, 2, 128, device="cpu")),
     _Gpu(), "needs CUDA"),
])
def test_refusals_choose_flex(case, args, gpu, why):
    q, kv = args.get("q", Q), args.get("kv", KV)
    got = fa4.explain(q, kv, kv, args.get("mask_mod"), args.get("score_mod"), "auto", gpu)
    assert got["kernel"] == "flex" and any(why in r for r in got["fa4"]), got
    with pytest.raises(ValueError, match="kernel='fa4' cannot run this call: .*" + why.split()[0]):
        fa4.explain(q, kv, kv, args.get("mask_mod"), args.get("score_mod"), "fa4", gpu)
    assert fa4.explain(q, kv, kv, args.get("mask_mod"), args.get("score_mod"), "flex", gpu)["kernel"] == "flex"


def test_cpu_calls_run_flexattention():
    q = torch.randn(1, 64, 2, 16)
    got = explain_flex(q, q, q, mask_mod=masks.causal())
    assert got["kernel"] == "flex" and any("needs CUDA" in r for r in got["fa4"])
    with pytest.raises(ValueError, match="kernel='fa4' cannot run this call"):
        longattn.flex_attention(q, q, q, mask_mod=masks.causal(), kernel="fa4")
    with pytest.raises(ValueError, match="kernel='triton'"):
        longattn.flex_attention(q, q, q, mask_mod=masks.causal(), kernel="triton")
    with pytest.raises(TypeError, match="mask_mod must take 4"):
        explain_flex(q, q, q, mask_mod=lambda q, k: q)
    out = longattn.flex_attention(q, q, q, mask_mod=masks.causal(), kernel="flex")
    assert torch.allclose(out, longattn.flex_attention(q, q, q, mask_mod=masks.causal()))


# ------------------------------------------------------------------ FA4's mask arguments (CPU)
def _fwd(q, k, v, softmax_scale=None, causal=False, pack_gqa=None, mask_mod=None, block_sparse_tensors=None,
         return_lse=False, aux_tensors=None):
    pass


def _bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, mask_mod=None, aux_tensors=None,
         block_sparse_tensors=None, dlse=None):
    pass


class _Sparse(types.SimpleNamespace):
    _fields = fa4.SPARSE_FIELDS


def test_signature_check_names_the_version_written_for():
    iface = types.SimpleNamespace(_flash_attn_fwd=_fwd, _flash_attn_bwd=_bwd)
    sparse = types.SimpleNamespace(BlockSparseTensorsTorch=_Sparse)
    utils = types.SimpleNamespace(scalar_to_ssa=lambda a, t: a)
    assert fa4.signature_problem(iface, sparse, utils, _fa4_api.WRITTEN_FOR) is None
    moved = types.SimpleNamespace(_flash_attn_fwd=lambda q, k, v, mask_mod=None: None, _flash_attn_bwd=_bwd)
    why = fa4.signature_problem(moved, sparse, types.SimpleNamespace(), "4.1.0")
    assert "4.1.0" in why and "'block_sparse_tensors'" in why and "scalar_to_ssa" in why
    assert f"written for flash-attn-4=={_fa4_api.WRITTEN_FOR}" in why


def _fa4_modules():
    """FA4's modules where flash-attn-4 is installed (skipped where it is not; installed, they must import)."""
    if _fa4_api.installed_version() == "unknown":
        pytest.skip(f"{_fa4_api.DIST} is not installed ({_fa4_api.INSTALL_HINT})")
    from flash_attn.cute import block_sparsity, interface, utils
    return interface, block_sparsity, utils


def test_installed_fa4_has_the_mask_arguments():
    """The installed flash-attn-4 (where it imports; no GPU needed) still has
    every argument and field longattn.flex.fa4 passes."""
    interface, block_sparsity, utils = _fa4_modules()
    assert fa4.signature_problem(interface, block_sparsity, utils, _fa4_api.installed_version()) is None


@pytest.mark.parametrize("arch", [90, 100])
@pytest.mark.parametrize("b,h,sq,sk,d", [(1, 16, 32768, 32768, 128), (2, 4, 1000, 700, 64), (2, 4, 300, 300, 96),
                                         (1, 2, 100, 300, 128)])
def test_installed_fa4_takes_the_block_tensors(arch, b, h, sq, sk, d):
    """FA4's own tile choice and block-sparsity checks (forward and backward,
    run on fake CUDA tensors: no GPU needed) accept the sparse block of
    blocks.sparse_block and the tensors of blocks.sparse_tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    interface, bs, _ = _fa4_modules()
    m = masks.and_(masks.causal(), masks.sliding_window(200, 0))
    block = blocks.sparse_block(arch // 10, sq)
    t = fp.block_table(m, b, h, torch.arange(sq, dtype=torch.int32), torch.arange(sk, dtype=torch.int32), block)
    ts = blocks.sparse_tensors(t)
    with FakeTensorMode():
        fake = lambda x: bs.BlockSparseTensorsTorch(
            **{n: torch.empty(v.shape, dtype=v.dtype, device="cuda") for n, v in x.items()}, block_size=block)
        fwd, bwd = fake(ts["fwd"]), fake(ts["bwd"])
        cfg = interface._get_fwd_config(
            arch=arch, head_dim=d, head_dim_v=d, max_seqlen_q=sq, max_seqlen_k=sk, num_head_kv=h, qhead_per_kvhead=1,
            pack_gqa=False, batch_size=b, causal=False, local=False, window_size_left=None, window_size_right=None,
            num_splits=1, device=torch.device("cuda"), seqlen_q=sq, block_sparse_tensors=fwd)
        bs.normalize_block_sparse_config(fwd, batch_size=b, num_head=h, seqlen_q=sq, seqlen_k=sk,
                                         block_size=(cfg.m_block_size, cfg.n_block_size), q_stage=cfg.q_stage,
                                         allow_kv_subtile=arch == 100)
        tile = (128, 128)  # sm_100's backward tile (flash_attn.cute.interface._flash_attn_bwd)
        if arch == 90:
            c = interface._tile_size_bwd_sm90(d, d, False, False, sparse_block_size_q=block[0])
            tile = (c.m_block_size, c.n_block_size)
        assert block[0] % tile[0] == 0 and block[1] == tile[1]
        bs.normalize_block_sparse_config_bwd(bwd, batch_size=b, num_head=h, seqlen_q=sq, seqlen_k=sk, block_size=tile,
                                             q_subtile_factor=block[0] // tile[0])


# ------------------------------------------------------------------ the whole call through a stand-in (CPU)
class _MaskInterface:
    """Stands in for FA4's interface on CPU: builds each call's mask the way
    FA4 reads its arguments (listed full blocks visible, listed partial
    blocks through mask_mod, unlisted blocks skipped; the backward from its
    own per-key-block lists) and runs float64 attention with it."""

    def _mask(self, q, k, mask_mod, aux, sp, by_key: bool):
        b, sq, h, _ = q.shape
        sk = k.shape[1]
        if sp is None:
            return torch.ones(1, 1, sq, sk, dtype=torch.bool) if mask_mod is None else None
        bq, bk = sp.block_size
        n = -(-sq // bq) if by_key else -(-sk // bk)
        part = dense_from_tensors(sp.mask_block_cnt, sp.mask_block_idx, n)
        full = dense_from_tensors(sp.full_block_cnt, sp.full_block_idx, n)
        if by_key:
            part, full = part.mT, full.mT
        grow = lambda t: t.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :sq, :sk]
        ms = mask_mod(*_idx(b, h, sq, sk), None, aux)
        return grow(full) | (grow(part) & ms)

    def _attend(self, q, k, v, scale, mask):
        from reference import masked_attention
        return masked_attention(q, k, v, mask, scale)

    def _flash_attn_fwd(self, q, k, v, softmax_scale=None, causal=False, pack_gqa=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, aux_tensors=None):
        assert return_lse and not causal and pack_gqa is False
        out, lse = self._attend(q, k, v, softmax_scale, self._mask(q, k, mask_mod, aux_tensors,
                                                                    block_sparse_tensors, False))
        return out.to(q.dtype), lse.float(), None, None, None

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, mask_mod=None,
                        aux_tensors=None, block_sparse_tensors=None, dlse=None):
        """FA4's backward from the GIVEN out and lse: P = exp(S - lse) on the
        visible entries, delta = rowsum(dO * O) - dlse."""
        from reference import expand_kv
        mask = self._mask(q, k, mask_mod, aux_tensors, block_sparse_tensors, True)
        h, hkv = q.shape[2], k.shape[2]
        qd, kd, vd = q.double(), expand_kv(k.double(), h), expand_kv(v.double(), h)
        s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale
        p = torch.exp(s - lse.double()[..., None]).masked_fill(~mask, 0).nan_to_num(0)
        do, o = dout.double(), out.double()
        delta = (do * o).sum(-1).transpose(1, 2) - (0 if dlse is None else dlse.double())
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vd)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale
        group = lambda t: t.view(*t.shape[:2], hkv, h // hkv, t.shape[-1]).sum(3)
        dk = group(torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale)
        dv = group(torch.einsum("bhqk,bqhd->bkhd", p, do))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    """FA4's mask calls on :class:`_MaskInterface`, its varlen calls (contiguous
    documents, pieces.DocumentsStep) on test_fa4's math stand-in (``.varlen``: its calls)."""
    from test_fa4 import _MathInterface

    varlen = _MathInterface()
    monkeypatch.setattr(_fa4_api, "_interface", lambda: varlen)
    ns = types.SimpleNamespace(interface=_MaskInterface(), sparse=lambda **kw: types.SimpleNamespace(**kw),
                               varlen=varlen)
    monkeypatch.setattr(fa4, "_fa4", lambda: ns)
    monkeypatch.setattr(fa4, "cute_mask", lambda f: (lambda b, h, q, k, info, aux, _body=blocks.mask_body(
        f, blocks.TorchOps)[0]: _body(b, h, q, k, aux)))
    monkeypatch.setattr(fa4.KERNEL, "capability", lambda device: (9, 0))
    return ns


@pytest.mark.parametrize("name", ["causal", "document_rows", "prefix_lm_rows", "block_sparse", "block_sparse_heads",
                                  "dilated_causal", "nested"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_call_through_stand_in(stand_in, name, hkv):
    """fa4.attend (forward, backward with dlse) with the tensors FA4 would
    get, against the float64 definition of the pattern."""
    m = PATTERNS[name]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, k, v, do, dl = mk(2, S, 4, 16), mk(2, S, hkv, 16), mk(2, S, hkv, 16), mk(2, S, 4, 16), mk(2, 4, S)
    got = results(lambda q, k, v: fa4.attend(q, k, v, m, 0.25), [q, k, v], do, dl)
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do, dl)
    assert_close(got, want, 1e-6, name)  # lse float32, as FA4 keeps it


def test_graph_choice_reaches_the_call(stand_in, monkeypatch):
    """FlexFa4Tuning.graph_max_tokens: a call of at most that many query tokens (batch x rows) runs its passes
    from CUDA graphs where graphs.usable says so (patched here: CPU tensors never are); the choice reaches
    Fa4Flex, whose passes otherwise run as they are. A tuning of another type, or a negative bound, raises."""
    from longattn import tuning

    seen = []
    real = fa4.Fa4Flex.apply

    def apply(q, k, v, run, graphed=False):
        seen.append(graphed)
        return real(q, k, v, run)  # the passes themselves: no CUDA graph on the CPU
    monkeypatch.setattr(fa4.Fa4Flex, "apply", apply)
    monkeypatch.setattr(fa4.graphs, "usable", lambda x: True)
    m = PATTERNS["causal"]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, k, v, do = mk(2, S, 4, 16), mk(2, S, 2, 16), mk(2, S, 2, 16), mk(2, S, 4, 16)
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do)
    for bound, graphed in ((None, False), (2 * S, True), (2 * S - 1, False), (0, False)):  # default: 0, never
        t = tuning.FLEX_FA4 if bound is None else tuning.FlexFa4Tuning(graph_max_tokens=bound)
        got = results(lambda q, k, v: fa4.attend(q, k, v, m, 0.25, t), [q, k, v], do)
        assert seen[-1] is graphed, (bound, seen)
        assert_close(got, want, 1e-6, f"graph_max_tokens={bound}")
    with pytest.raises(ValueError, match="graph_max_tokens"):
        tuning.FlexFa4Tuning(graph_max_tokens=-1)
    with pytest.raises(TypeError, match="FlexFa4Tuning"):
        longattn.flex_attention(q, k, v, mask_mod=m, tuning=tuning.FLEX_EXCHANGE)


@pytest.mark.parametrize("name", ["causal", "block_sparse_heads"])
def test_graphed_passes_through_stand_in(stand_in, monkeypatch, name):
    """The graphed passes' plumbing (Fa4Flex through PASS_GRAPHS: the executor's forward and backward as the
    graphs' functions, outputs copied) on the CPU, the capture stood in for: every call (eager, captured,
    replayed) equal to the passes run as they are, with and without an lse gradient; one forward graph and a
    backward graph per lse gradient kept."""
    import contextlib

    from longattn import tuning
    from longattn.dilated import graphs

    class FakeGraph:
        def __init__(self, fn, inputs, pool=None):
            self.fn = fn

        def __call__(self, inputs, copies=None):
            return tuple(o.clone() for o in self.fn(*inputs))

    monkeypatch.setattr(graphs, "Graph", FakeGraph)
    monkeypatch.setattr(graphs, "usable", lambda x: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    m = PATTERNS[name]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, k, v, do, dl = mk(2, S, 4, 16), mk(2, S, 2, 16), mk(2, S, 2, 16), mk(2, S, 4, 16), mk(2, 4, S)
    t, eager = tuning.FlexFa4Tuning(graph_max_tokens=2 * S), tuning.FlexFa4Tuning(graph_max_tokens=0)
    fa4.PASS_GRAPHS.clear()
    try:
        for lse_grad in (None, dl):
            want = results(lambda q, k, v: fa4.attend(q, k, v, m, 0.25, eager), [q, k, v], do, lse_grad)
            for i in range(3):
                got = results(lambda q, k, v: fa4.attend(q, k, v, m, 0.25, t), [q, k, v], do, lse_grad)
                assert all(torch.equal(got[n], want[n]) for n in ("out", "lse", "dq", "dk", "dv")), (name, i)
        assert sorted(key[0][0] for key in fa4.PASS_GRAPHS.graphs) == ["bwd", "bwd", "fwd"]
    finally:
        fa4.PASS_GRAPHS.clear()


@pytest.mark.parametrize("name", ["document_cu", "document_rows", "and", "comes_back"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_documents_run_as_varlen(stand_in, name, hkv):
    """Contiguous documents (with causal and a window: "and") run as FA4's
    varlen kernel over every batch row's documents in one call, forward and
    backward with dlse; documents whose ids come back later ("comes_back"),
    or with ``documents_varlen=False``, keep the mask and block sparsity. All
    against the pattern in float64."""
    from longattn import tuning
    from longattn.flex import pieces

    m = PATTERNS.get(name) or masks.and_(masks.causal(), masks.document(torch.arange(S) // 50 % 3))
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, k, v, do, dl = mk(2, S, 4, 16), mk(2, S, hkv, 16), mk(2, S, hkv, 16), mk(2, S, 4, 16), mk(2, 4, S)
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do, dl)
    assert_close(results(lambda q, k, v: fa4.attend(q, k, v, m, 0.25), [q, k, v], do, dl), want, 1e-6, name)
    assert [c["varlen"] for c in stand_in.varlen.calls] == ([] if name == "comes_back" else [True])
    masked = tuning.FlexFa4Tuning(documents_varlen=False)
    run = lambda q, k, v: fa4.Fa4Flex.apply(q, k, v, pieces.single_executor(q, k, m, 0.25, masked))
    assert_close(results(run, [q, k, v], do, dl), want, 1e-6, name)
    assert len(stand_in.varlen.calls) == (0 if name == "comes_back" else 1)  # the mask path made no varlen call


def test_documents_form():
    docs = masks.document(DOCS)
    ids, causal, window = blocks.documents_form(masks.and_(masks.sliding_window(30, 5), masks.causal(), docs).fa4)
    assert ids is docs.fa4.tensors[0] and causal and window == (30, 0)
    nested = masks.and_(masks.and_(docs, masks.sliding_window(-1, 9)), masks.sliding_window(12, 20))
    assert blocks.documents_form(nested.fa4)[1:] == (False, (12, 9))
    assert blocks.documents_form(docs.fa4)[1:] == (False, (-1, -1))
    for other in (masks.causal(), masks.and_(docs, masks.prefix_lm(4)), masks.or_(docs, masks.causal()),
                  masks.and_(docs, masks.document(DOCS.flip(0)))):
        assert blocks.documents_form(other.fa4) is None


def test_ring_step_through_stand_in(stand_in):
    """A zigzag rank's three ring steps through their FA4 executors (the
    interface of FlexStep that the ring's local ops call), each backward from
    the merged out and lse: the out, lse and gradients of the whole (the
    identity the ring relies on)."""
    m = PATTERNS["and"]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    qpos = fp.global_positions("zigzag", 1, 3, 100)
    q, do, dl = mk(2, 100, 4, 16), mk(2, 100, 4, 16), mk(2, 4, 100)
    k, v = mk(2, S, 2, 16), mk(2, S, 2, 16)
    kparts = [fp.global_positions("zigzag", r, 3, 100) for r in range(3)]
    steps = [fa4.ring_executor(m, qpos, kp, 2, 4, 0.25) for kp in kparts]  # Call.run of each step
    assert all(st.calls[0].q1 == 100 and st.calls[0].k1 == 100 for st in steps)
    rec = [st.record(q, k[:, kp.long()], v[:, kp.long()]) for st, kp in zip(steps, kparts)]
    outs = [(o, l) for o, l, _ in rec]
    lse = torch.logsumexp(torch.stack([l for _, l in outs]), 0)
    out = sum(o * torch.exp(l - lse).nan_to_num(0).transpose(1, 2)[..., None] for o, l in outs)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for st, kp in zip(steps, kparts):
        g = st.backward(do, q, k[:, kp.long()], v[:, kp.long()], out, lse, dl, None)
        dq += g[0]
        dk[:, kp.long()] += g[1]
        dv[:, kp.long()] += g[2]

    def whole(q, k, v):
        qm = lambda b, h, i, j: m(b, h, qpos.long()[i], j)
        return flex_ref(q, k, v, qm, scale=0.25)
    want = results(whole, [q, k, v], do, dl)
    assert_close(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), want, 1e-6, "ring steps")


@pytest.mark.parametrize("axis", ["keys", "rows"])
def test_split_step_runs_the_chained_pass_on_views(stand_in, axis):
    """fa4.SplitStep runs on c view rows only the pass whose programs chain along the long side (keys: the
    forward of few rows against many keys; rows: the backward of many rows against few keys), the other as one
    call; out, lse and gradients (from a given lse gradient) equal one call's."""
    from longattn.flex import pieces

    m = masks.local_global(64, 16)
    few, many = torch.arange(128, dtype=torch.int32), torch.arange(512, 1024, dtype=torch.int32)
    qpos, kpos = (few, many) if axis == "keys" else (many, few)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, do, dl = mk(1, len(qpos), 4, 16), mk(1, len(qpos), 4, 16), mk(1, 4, len(qpos))
    k, v = mk(1, len(kpos), 2, 16), mk(1, len(kpos), 2, 16)
    one = pieces.executor(m, qpos, kpos, 1, 4, 0.25, 9)
    split = pieces.executor(m, qpos, kpos, 1, 4, 0.25, 9, split=lambda table, rows, keys: (4, axis))
    assert isinstance(split, fa4.SplitStep) and isinstance(one, fa4.RingStep)
    batches = []
    for name in ("_flash_attn_fwd", "_flash_attn_bwd"):
        real = getattr(stand_in.interface, name)
        setattr(stand_in.interface, name, lambda q, *a, _f=real, _n=name, **kw: batches.append((_n, q.shape[0]))
                or _f(q, *a, **kw))
    res = []
    for run in (one, split):
        out, lse = run.forward(q, k, v)
        res.append(dict(out=out, lse=lse, **dict(zip(("dq", "dk", "dv"), run.backward(do, q, k, v, out, lse, dl)))))
    assert batches[2:] == ([("_flash_attn_fwd", 4), ("_flash_attn_bwd", 1)] if axis == "keys" else
                           [("_flash_attn_fwd", 1), ("_flash_attn_bwd", 4)]), batches
    assert_close(res[1], res[0], 1e-6, f"split {axis}")


def install_stand_in(interface, cap: int = 9):
    """In a spawned worker (no monkeypatch there): FA4's mask calls on ``interface`` (a :class:`_MaskInterface`
    or :func:`_compiled_interface`), its CuTe masks as the torch form of the same body, compute capability
    ``cap``.0, FA4 chosen wherever the pattern has an FA4 form and no score_mod is given (CPU tensors)."""
    ns = types.SimpleNamespace(interface=interface, sparse=lambda **kw: types.SimpleNamespace(**kw))
    fa4._fa4 = lambda: ns
    fa4.cute_mask = lambda f: (lambda b, h, q, k, info, aux, _body=blocks.mask_body(f, blocks.TorchOps)[0]:
                               _body(b, h, q, k, aux))
    fa4.KERNEL.capability = lambda device: (cap, 0)
    fa4.KERNEL.refusals = lambda q, k, v, m, s: [] if s is None and (m is None or m.fa4 is not None) else ["flex"]
    return ns


def _ring_worker(rank, world):
    """Every pattern of test_flex_ring around a gloo ring with FA4's steps
    (through the stand-in with JIT caches; FlexAttention where a score_mod is given), against float64; a
    pattern's second call replays every step's recorded passes (no FA4 entry)."""
    import test_flex_ring as R
    from dist_utils import assert_unsharded_close, run_sharded

    compiled = _compiled_interface(_MaskInterface())
    install_stand_in(compiled)
    built, make = [], fa4.ring_executor
    fa4.ring_executor = lambda *a: built.append(a) or make(*a)
    s = world * R.L

    def check(layout, name, mask, score, hkv):
        torch.manual_seed(7)
        q, k, v = torch.randn(R.B, s, R.H, R.D), torch.randn(R.B, s, hkv, R.D), torch.randn(R.B, s, hkv, R.D)
        do, dl = torch.randn(R.B, s, R.H, R.D), torch.randn(R.B, R.H, s)
        qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
        ro, rl = flex_ref(qr, kr, vr, mask, score)
        ((ro * do).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl).sum()).backward()
        res = run_sharded(longattn.ring_flex_attention, q, k, v, do, dl, layout, mask_mod=mask, score_mod=score,
                          engine="ring")
        assert_unsharded_close(f"{layout} {name}", *res, ro, rl, (qr.grad, kr.grad, vr.grad), 1e-4)

    for layout in ("contiguous", "zigzag"):
        for pattern in R.patterns(world):
            check(layout, *pattern)
    assert built, "no ring step ran through FA4's executor"
    entries = (compiled.fwd, compiled.bwd)
    assert all(entries), entries
    check("zigzag", *next(p for p in R.patterns(world) if p[2] is None))  # its steps recorded above: replayed
    assert (compiled.fwd, compiled.bwd) == entries, ((compiled.fwd, compiled.bwd), entries)


@pytest.mark.dist
def test_ring_through_fa4_steps():
    """ring_flex_attention with FA4's ring executors (schedule.ring_schedule builds
    fa4.ring_executor per non-empty step where fa4.choose says "fa4")."""
    from dist_utils import run_world

    run_world(_ring_worker, 2)


# ------------------------------------------------------------------ GPU: FA4 against float64 and SDPA's bar
@pytest.fixture
def on_fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] not in fa4.KERNEL.capabilities:
        pytest.skip("FA4's masks run on sm_90 / sm_100")
    if _fa4_api.installed_version() == "unknown":
        pytest.skip(f"{_fa4_api.DIST} is not installed ({_fa4_api.INSTALL_HINT})")
    why = fa4.KERNEL.problem()  # installed: a release that moved what longattn calls fails here, not skips
    assert why is None, why


def _sdpa_bar(mask):
    """SDPA in bf16 with the same boolean mask; rows without a key get a dummy
    key (their outputs zeroed after: no gradient flows from them)."""
    import torch.nn.functional as F

    def fn(q, k, v):
        b, sq, h, _ = q.shape
        mm = mask.expand(b, h, sq, k.shape[1])
        has = mm.any(-1, keepdim=True)
        eye = torch.zeros_like(mm)
        eye[..., 0] = True
        k, v = (x.repeat_interleave(h // x.shape[2], 2) for x in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=torch.where(has, mm, eye))
        return o * has.to(o.dtype)
    return lambda q, k, v: fn(q, k, v).transpose(1, 2)


@pytest.mark.parametrize("name", ["dilated_causal", "block_sparse"])
def test_sdpa_bar_is_the_pattern(name):
    """The GPU tests' bar (SDPA with the mask, rows without a key handled) is
    the pattern's attention, gradients included (float64 on CPU)."""
    m = PATTERNS[name]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    q, k, v, do = mk(2, S, 4, 8), mk(2, S, 2, 8), mk(2, S, 2, 8), mk(2, S, 4, 8)
    got = results(_sdpa_bar(dense_mask(m, 2, 4, S)), [q, k, v], do)
    want = results(lambda q, k, v: flex_ref(q, k, v, m)[0], [q, k, v], do)
    assert_close(got, want, 1e-9, name)


GPU_CASES = [(n, 128, 2) for n in PATTERNS] + [("causal", 64, 4), ("block_sparse_heads", 64, 4),
                                                ("document_rows", 96, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,d,hkv", GPU_CASES)
def test_patterns_through_fa4_on_gpu(on_fa4, name, d, hkv):
    """FA4 (and torch's FlexAttention, the other kernel) against float64:
    out and dq/dk/dv within 2x SDPA's bf16 error with the same mask, lse
    within 1e-3 with -inf exactly where a row sees no key."""
    m = PATTERNS[name]
    dev = torch.device("cuda")
    mm = patterns(dev)[name]
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s, sc=1.0: (torch.randn(*s, device=dev, generator=g) * sc).bfloat16()
    q, k, v, do = mk(2, S, 4, d), mk(2, S, hkv, d), mk(2, S, hkv, d), mk(2, S, 4, d)
    dl = mk(2, 4, S, sc=0.3).float()
    assert explain_flex(q, k, v, mask_mod=mm)["kernel"] == "fa4"
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=d ** -0.5), [q.double().cpu(), k.double().cpu(),
                                                                            v.double().cpu()], do.cpu(), dl.cpu())
    want = {n: (t.to(dev) if t is not None else None) for n, t in want.items()}
    mask = dense_mask(m, 2, 4, S).to(dev)
    bar = results(_sdpa_bar(mask), [q, k, v], do)
    bar_want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=d ** -0.5), [x.double().cpu() for x in (q, k, v)],
                       do.cpu())
    tol = {n: 2 * max(rel_err(bar[n], bar_want[n].to(dev)), 1e-3) for n in ("out", "dq", "dk", "dv")}
    for kernel in ("fa4", "flex"):
        got = results(lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mm, return_lse=True, kernel=kernel),
                      [q, k, v], do, dl)
        errs = {n: rel_err(got[n], want[n]) for n in tol}
        assert all(errs[n] <= tol[n] for n in tol), (kernel, name, errs, tol)
        assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, f"{kernel} {name}")


@pytest.mark.gpu
def test_carved_call_on_gpu(on_fa4):
    """A one-device call carved (pieces.CarvedStep) at a tuning whose threshold the global tokens' tiles pass at 16
    tiles: FA4's pieces against float64, out and dq/dk/dv within 2x SDPA's bf16 error with the same mask, lse
    within 1e-3 (an lse gradient too)."""
    from longattn import tuning
    from longattn.flex import pieces

    s, d = 2048, 128
    m = masks.local_global(128, 32)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *sh, sc=1.0: (torch.randn(*sh, device=dev, generator=g) * sc).bfloat16()
    q, k, v, do = mk(1, s, 4, d), mk(1, s, 2, d), mk(1, s, 2, d), mk(1, s, 4, d)
    dl = mk(1, 4, s, sc=0.3).float()
    run = pieces.single_executor(q, k, m, d ** -0.5, tuning.FlexFa4Tuning(split_chain=8))
    assert isinstance(run, pieces.CarvedStep) and run.rows_run is not None and run.keys_run is not None
    cpu = lambda xs: [x.double().cpu() for x in xs]
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=d ** -0.5), cpu((q, k, v)), do.cpu(), dl.cpu())
    want = {n: (t.to(dev) if t is not None else None) for n, t in want.items()}
    bar = results(_sdpa_bar(dense_mask(m, 1, 4, s).to(dev)), [q, k, v], do)
    bar_want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=d ** -0.5), cpu((q, k, v)), do.cpu())
    tol = {n: 2 * max(rel_err(bar[n], bar_want[n].to(dev)), 1e-3) for n in ("out", "dq", "dk", "dv")}
    got = results(lambda q, k, v: fa4.Fa4Flex.apply(q, k, v, run), [q, k, v], do, dl)
    errs = {n: rel_err(got[n], want[n]) for n in tol}
    assert all(errs[n] <= tol[n] for n in tol), (errs, tol)
    assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, "carved")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["block_sparse", "block_sparse_gqa", "local_global_flags", "carved"])
def test_replay_on_gpu(on_fa4, name):
    """On FA4 itself every step's forward and backward replay (compiled kernel calls whose tensors and buffers
    the replay renews): for new inputs a replayed forward equals FA4's own call bit for bit, a replayed
    backward FA4's own within its run-to-run spread (dQ added by float32 atomics), an lse gradient included
    (recorded on one FA4 would copy: zeros expanded from a scalar); GQA's backward too (dK, dV summed over
    query heads in float32 buffers that start as zeros)."""
    from longattn import tuning
    from longattn.flex import pieces

    dev = torch.device("cuda")
    if name == "carved":
        mm, b, s, t = masks.local_global(128, 32), 1, 2048, tuning.FlexFa4Tuning(split_chain=8)
    else:
        mm, b, s, t = patterns(dev)[name.removesuffix("_gqa")], 2, S, tuning.FLEX_FA4
    hkv = 2 if name.endswith("_gqa") else 4
    mk = lambda h=4: torch.randn(b, s, h, 128, device=dev).bfloat16()
    run = pieces.single_executor(mk(), mk(hkv), mm, 0.125, t)
    assert type(run).__name__ == ("CarvedStep" if name == "carved" else "RingStep")
    # without an lse gradient twice, then with one: first all zeros expanded from a scalar (strides 0, which
    # FA4 would copy before its kernels), then a replayed call's own
    for dl in (None, None, torch.zeros((), device=dev).expand(b, 4, s), torch.randn(b, 4, s, device=dev)):
        q, k, v, do = mk().requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk()
        out, lse = fa4.Fa4Flex.apply(q, k, v, run)
        grads = torch.autograd.grad((out, lse) if dl is not None else out, (q, k, v),
                                    (do, dl) if dl is not None else do)
    replays = [(key[0], r) for st in fa4.steps_of(run) for key, r in st.replays.items()]
    assert {p for p, _ in replays} == {"fwd", "bwd"} and all(isinstance(r, _fa4_api.Replay) for _, r in replays), \
        replays
    if name != "carved":
        fa, st = fa4._fa4(), run.step
        want = _fa4_api.masked_forward(fa.interface, q, k, v, 0.125, fa4._mask(st), fa4._sparse(fa, st, "fwd"),
                                       st.aux)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        want = _fa4_api.masked_backward(fa.interface, do, q, k, v, out, lse, 0.125, fa4._mask(st),
                                        fa4._sparse(fa, st, "bwd"), st.aux, dl)
        for g, w in zip(grads, want):
            assert rel_err(g, w) < 1e-2, rel_err(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "document_rows", "block_sparse_heads", "carved"])
def test_graphed_calls_on_gpu(on_fa4, name):
    """flex_attention with its passes replayed from CUDA graphs (FlexFa4Tuning.graph_max_tokens): the first
    call eager, the second captured, the third replayed; with and without an lse gradient (a graph each); every
    call against float64 within 2x SDPA's bf16 error with the same mask, as the eager call (FA4's backward adds
    dQ in float32 atomics, so calls differ from each other by bf16 roundings: carved, by 2.8e-3 in dq), lse
    within 1e-3; the graphs kept per executor and pass."""
    from longattn import tuning

    dev = torch.device("cuda")
    if name == "carved":  # global tokens whose tiles pass a threshold of 8: pieces.CarvedStep, batch 1
        mm, b, s, t = masks.local_global(128, 32), 1, 2048, tuning.FlexFa4Tuning(split_chain=8, graph_max_tokens=2048)
    else:
        mm, b, s, t = patterns(dev)[name], 2, S, tuning.FlexFa4Tuning(graph_max_tokens=2 * S)
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *sh, sc=1.0: (torch.randn(*sh, device=dev, generator=g) * sc).bfloat16()
    q, k, v, do = mk(b, s, 4, 128), mk(b, s, 2, 128), mk(b, s, 2, 128), mk(b, s, 4, 128)
    if name == "causal":  # heads-major memory (B, H, S, D) seen as (B, S, H, D): the graphs' calls take copies
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    dl = mk(b, 4, s, sc=0.3).float()
    m = PATTERNS.get(name, masks.local_global(128, 32))
    cpu = lambda xs: [x.double().cpu() for x in xs]
    bar = results(_sdpa_bar(dense_mask(m, b, 4, s).to(dev)), [q, k, v], do)
    bar_want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=128 ** -0.5), cpu((q, k, v)), do.cpu())
    tol = {n: 2 * max(rel_err(bar[n], bar_want[n].to(dev)), 1e-3) for n in ("out", "dq", "dk", "dv")}
    fa4.PASS_GRAPHS.clear()
    try:
        for lse_grad in (None, dl):
            want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=128 ** -0.5), cpu((q, k, v)), do.cpu(),
                           None if lse_grad is None else lse_grad.cpu())
            want = {n: (x.to(dev) if x is not None else None) for n, x in want.items()}
            eager = lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mm, return_lse=True,
                                                            tuning=dataclasses.replace(t, graph_max_tokens=0))
            graphed = lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mm, return_lse=True, tuning=t)
            # eager; graphed: each pass's graph made on its shape's second call, replayed after (with an lse
            # gradient the forward's graph exists already: only the backward's is new)
            for i, f in enumerate([eager] + [graphed] * 3):
                got = results(f, [q, k, v], do, lse_grad)
                errs = {n: rel_err(got[n], want[n]) for n in tol}
                tag = f"{name} call {i} lse gradient {lse_grad is not None}"
                assert all(errs[n] <= tol[n] for n in tol), (tag, errs, tol)
                assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, tag)
        passes = sorted(key[0][0] for key in fa4.PASS_GRAPHS.graphs)
        assert passes == ["bwd", "bwd", "fwd"], passes  # one forward graph, a backward with and without dlse
    finally:
        fa4.PASS_GRAPHS.clear()


def _sub_ref(m, qpos):
    """flex_ref of queries at global positions ``qpos`` against every key."""
    return lambda q, k, v: flex_ref(q, k, v, lambda b, h, i, j: m(b, h, qpos.long()[i], j), scale=q.shape[-1] ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["and", "block_sparse_heads", "document_rows", "dilated_causal"])
def test_ring_steps_through_fa4_on_gpu(on_fa4, name):
    """A zigzag rank's three ring steps through FA4's ring executors (mask
    at global offsets from aux position tables), merged by lse, each backward
    from the merged out and lse: against float64 over all keys, within 2x
    SDPA's bf16 error."""
    dev = torch.device("cuda")
    m, mcpu = patterns(dev)[name], PATTERNS[name]
    g = torch.Generator(device=dev).manual_seed(1)
    mk = lambda *s, sc=1.0: (torch.randn(*s, device=dev, generator=g) * sc).bfloat16()
    qpos = fp.global_positions("zigzag", 1, 3, 100, dev)
    kparts = [fp.global_positions("zigzag", r, 3, 100, dev) for r in range(3)]
    q, k, v, do = mk(2, 100, 4, 128), mk(2, S, 2, 128), mk(2, S, 2, 128), mk(2, 100, 4, 128)
    dl = mk(2, 4, 100, sc=0.3).float()
    scale = 128 ** -0.5
    steps = [fa4.ring_executor(m, qpos, kp, 2, 4, scale) for kp in kparts]
    outs = [st.forward(q, k[:, kp.long()], v[:, kp.long()]) for st, kp in zip(steps, kparts) if st is not None]
    lse = torch.logsumexp(torch.stack([l for _, l in outs]), 0)
    out = sum(o.float() * torch.exp(l - lse).nan_to_num(0).transpose(1, 2)[..., None] for o, l in outs).bfloat16()
    dq, dk, dv = torch.zeros_like(q, dtype=torch.float32), torch.zeros_like(k, dtype=torch.float32), \
        torch.zeros_like(v, dtype=torch.float32)
    for st, kp in zip(steps, kparts):
        if st is not None:
            gq, gk, gv = st.backward(do, q, k[:, kp.long()], v[:, kp.long()], out, lse, dl, None)
            dq += gq.float()
            dk[:, kp.long()] += gk.float()
            dv[:, kp.long()] += gv.float()
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    cpu = [x.double().cpu() for x in (q, k, v)]
    want = {n: t.to(dev) for n, t in results(_sub_ref(mcpu, qpos.cpu()), cpu, do.cpu(), dl.cpu()).items()}
    mask = dense_mask(mcpu, 2, 4, S)[:, :, qpos.cpu().long()].to(dev)
    bar = results(_sdpa_bar(mask), [q, k, v], do)
    bar_want = results(_sub_ref(mcpu, qpos.cpu()), cpu, do.cpu())
    tol = {n: 2 * max(rel_err(bar[n], bar_want[n].to(dev)), 1e-3) for n in ("out", "dq", "dk", "dv")}
    errs = {n: rel_err(got[n], want[n]) for n in tol}
    assert all(errs[n] <= tol[n] for n in tol), (name, errs, tol)
    assert_close(dict(lse=lse), dict(lse=want["lse"]), 1e-3, name)


@pytest.mark.gpu
def test_choice_on_gpu(on_fa4):
    q = torch.randn(1, 256, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert explain_flex(q, q, q, mask_mod=masks.causal()) == {"kernel": "fa4", "fa4": [], "flex": []}
    own = explain_flex(q, q, q, mask_mod=lambda b, h, i, j: j <= i)
    assert own["kernel"] == "flex" and "no FA4 form" in own["fa4"][0]
    out = longattn.flex_attention(q, q, q, mask_mod=lambda b, h, i, j: j <= i)  # FlexAttention runs it
    assert rel_err(out, longattn.flex_attention(q, q, q, mask_mod=masks.causal())) < 1e-2


# ------------------------------------------------------------------ the bench's rows (CPU)
@pytest.mark.parametrize("name", ["flex_swg_32k", "flex_doc_32k", "flex_prefix_32k", "flex_bsparse_32k",
                                  "flex_swg_tiny"])
def test_bench_rows(monkeypatch, name):
    """The flex configs list the FA4 row beside longattn's FlexAttention and
    torch's; it states why it cannot run on CPU, and the 32K configs'
    patterns (H=16, D=128) all have FA4 forms FA4 takes on sm_90."""
    from longattn.bench import configs
    from longattn.bench import impls as I

    cfg = configs.get(name)
    names = [i.name for i in I.impls_for(cfg)]
    assert {"longattn-flex", "longattn-flex-fa4", "torch-flex"} <= set(names)
    assert "needs CUDA" in I.IMPLS["longattn-flex-fa4"].reason(cfg, torch.device("cpu"))
    monkeypatch.setattr(fa4.KERNEL, "capability", lambda device: (9, 0))
    monkeypatch.setattr(fa4.KERNEL, "problem", lambda: None)
    why = I.IMPLS["longattn-flex-fa4"].reason(cfg, torch.device("cuda"))
    if cfg.head_dim in blocks.HEADDIMS:
        assert why is None and (cfg.seqlen, cfg.heads) in ((32768, 16), (1024, 4))
    else:
        assert "head dims" in why


def test_split_for_cuts_long_chains_only():
    """pieces.split_for splits the pass whose programs chain over more than split_chain tiles, into the fewest
    views that bring every chain to split_chain or below, and only where few programs have such chains: a 64K
    shard's rows against the global keys' tile and 16 window-edge tiles (backward: rows); 128 served rows against
    512 key tiles (forward: keys); a causal document spanning a shard (many long chains: none)."""
    from longattn import tuning
    from longattn.flex import pieces

    t = tuning.FLEX_EXCHANGE
    table = lambda vis: fp.BlockTable(torch.zeros_like(vis), vis)
    halo = torch.zeros(1, 1, 512, 17, dtype=torch.bool)
    halo[..., 0] = True  # every row sees the global keys
    halo[..., :8, 1:9] = halo[..., -8:, 9:] = True  # the window's edges
    assert pieces.split_for(table(halo), 512 * 128, 17 * 128, 1, 16, 16, 9, t) == (8, "rows")
    served = torch.ones(1, 1, 1, 512, dtype=torch.bool)
    assert pieces.split_for(table(served), 128, 512 * 128, 1, 16, 16, 9, t) == (8, "keys")
    assert pieces.split_for(table(served[..., :64]), 128, 64 * 128, 1, 16, 16, 9, t) is None  # 64: short enough
    doc = torch.ones(1, 1, 512, 512, dtype=torch.bool).tril()
    assert pieces.split_for(table(doc), 512 * 128, 512 * 128, 1, 16, 16, 9, t) is None
    assert pieces.split_for(table(halo), 512 * 128, 17 * 128, 2, 16, 16, 9, t) is None  # batch rows: no views
    few = tuning.FlexExchangeTuning(split_min_blocks=128)  # views of at least 128 tiles: the most allowed, 4
    assert pieces.split_for(table(halo), 512 * 128, 17 * 128, 1, 16, 16, 9, few) == (4, "rows")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_carved_call_through_stand_in(stand_in, dtype):
    """A one-device call whose global tokens' tiles chain past the tuning's threshold runs as pieces.CarvedStep
    (the global rows apart on views of the keys, the global keys apart on views of the rows, each cleared from
    the call over the rest): out, lse and every gradient (from an lse gradient too) of the float64 definition,
    GQA; batch 2, or the default tuning on these 8 tiles, run one call. float32 (under TRITON_INTERPRET=1)
    merges the rows' views and sums the keys' gradients with the fused Triton launches, float64 with torch."""
    from longattn import tuning
    from longattn.flex import pieces

    m = masks.local_global(64, 16)
    t = tuning.FlexFa4Tuning(split_chain=4, split_min_blocks=1)  # tile 0's chains: 8 tiles; the others' 4 or fewer
    mk = lambda *s: torch.randn(*s, dtype=dtype)
    q, k, v, do, dl = mk(1, 1024, 4, 16), mk(1, 1024, 2, 16), mk(1, 1024, 2, 16), mk(1, 1024, 4, 16), mk(1, 4, 1024)
    run = pieces.single_executor(q, k, m, 0.25, t)
    assert isinstance(run, pieces.CarvedStep), type(run)
    assert run.rows.tolist() == list(range(128)) and run.keys.tolist() == list(range(128))
    assert (run.rows_run.axis, run.keys_run.axis) == ("keys", "rows")
    got = results(lambda q, k, v: fa4.Fa4Flex.apply(q, k, v, run), [q, k, v], do, dl)
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do, dl)
    assert_close(got, want, 1e-6 if dtype == torch.float64 else 1e-4, "carved")
    assert isinstance(pieces.single_executor(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), m, 0.25, t),
                      fa4.RingStep)
    assert isinstance(pieces.single_executor(q, k, m, 0.25), fa4.RingStep)


@pytest.mark.parametrize("nq,nk,see", [(8, 8, 5), (16, 8, 6), (10, 8, 6), (8, 16, -6), (8, 10, -6)])
def test_carved_call_either_axis(stand_in, nq, nk, see):
    """Carved calls whose chained rows' views cut the keys and whose chained keys' views cut the rows, or the
    other way round (few heads, unequal lengths: split_for picks the pass with the longer chain), run each
    piece in its own direction: out, lse and gradients of the float64 definition (float32, under
    TRITON_INTERPRET=1 through the fused launches where they apply)."""
    from longattn import tuning
    from longattn.flex import pieces

    torch.manual_seed(0)
    lay = torch.eye(nq, nk, dtype=torch.bool)
    if see > 0:
        lay[: nq - 2, :see] = True  # key tiles most query tiles see
    else:
        lay[:-see, : nk - 2] = True  # query tiles that see most key tiles
    m = masks.block_sparse(lay, 128)
    t = tuning.FlexFa4Tuning(split_chain=4, split_min_blocks=1)
    mk = lambda *s: torch.randn(*s, dtype=torch.float32)
    q, k, v, do = mk(1, nq * 128, 1, 16), mk(1, nk * 128, 1, 16), mk(1, nk * 128, 1, 16), mk(1, nq * 128, 1, 16)
    dl = mk(1, 1, nq * 128)
    run = pieces.single_executor(q, k, m, 0.25, t)
    assert isinstance(run, pieces.CarvedStep), type(run)
    got = results(lambda q, k, v: fa4.Fa4Flex.apply(q, k, v, run), [q, k, v], do, dl)
    want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do, dl)
    assert_close(got, want, 1e-4, f"carved {nq}x{nk}")


def _joined_documents(dev, dtype, world: int, rank: int, hkv: int, s: int = 4096, h: int = 8, d: int = 128):
    """The exchange's joined documents (pieces.JoinedDocuments: a zigzag rank's causal documents as FA4's varlen
    kernel, each run's earlier keys from the peers joined to its key segment), alone on one device: (got, want,
    inputs, dout, ref, mask) with got / want the rank's rows' out and lse, dq of its rows and dk/dv of every key (the
    halo's and its own; zero elsewhere), want the float64 reference ``ref`` over every key, ``mask`` the rows' dense
    mask. The documents of tests/test_flex_exchange.py::test_exchange_fa4_on_gpus."""
    from longattn.flex import pieces

    ids = torch.arange(s) * 7 // s
    m_cpu, m_dev = (masks.and_(masks.causal(), masks.document(ids.to(x))) for x in ("cpu", dev))
    c = s // (2 * world)
    pos = torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * world - 1 - rank) * c,
                                                                          (2 * world - rank) * c)])
    mine = torch.zeros(s, dtype=torch.bool)
    mine[pos] = True
    # the peers' keys the shard's runs see: their documents' positions before them, outside the shard
    first = {int(ids[p]): int(p) for p in pos.flip(0)}
    hpos = torch.tensor([j for j in range(s) if not mine[j] and int(ids[j]) in first and j < first[int(ids[j])]],
                        dtype=torch.long)
    assert len(hpos), "the shard has a run with earlier keys elsewhere"
    P, H = pos.to(dev), hpos.to(dev)
    jd = pieces.JoinedDocuments.at(m_dev, P, H, 1, d ** -0.5)
    assert jd is not None

    class Joined(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = jd.forward(q, k[:, H], k[:, P], v[:, H], v[:, P])
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv, dkh, dvh = jd.backward(dout.contiguous(), q, k[:, H], k[:, P], v[:, H], v[:, P], out, lse,
                                               dlse)
            gk, gv = torch.zeros_like(k), torch.zeros_like(v)
            gk[:, P], gv[:, P], gk[:, H], gv[:, H] = dk, dv, dkh, dvh
            return dq, gk, gv

    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *sh, sc=1.0: (torch.randn(*sh, device=dev, generator=g) * sc).to(dtype)
    q, k, v, do = mk(1, len(pos), h, d), mk(1, s, hkv, d), mk(1, s, hkv, d), mk(1, len(pos), h, d)
    dl = mk(1, h, len(pos), sc=0.3).float()
    ref = _sub_ref(m_cpu, pos)
    want = results(ref, [x.double().cpu() for x in (q, k, v)], do.cpu(), dl.cpu())
    want = {n: (t.to(dev) if t is not None else None) for n, t in want.items()}
    return results(Joined.apply, [q, k, v], do, dl), want, (q, k, v), do, ref, dense_mask(m_cpu, 1, h, s)[:, :, pos]


def test_joined_documents_through_stand_in(monkeypatch):
    """The joined documents' plumbing (key segments gathered, gradients scattered back) through FA4's varlen
    convention on the CPU (test_fa4's stand-in for FA4's interface), float64, against the reference."""
    from test_fa4 import _MathInterface

    monkeypatch.setattr(_fa4_api, "_interface", lambda: _MathInterface())
    for world, hkv in ((2, 4), (4, 2)):
        for rank in range(world):  # at 2 ranks rank 1's chunks are adjacent: a document runs across them
            got, want, *_ = _joined_documents(torch.device("cpu"), torch.float64, world, rank, hkv, s=512, h=4, d=16)
            assert_close(got, want, 1e-6, f"joined documents world={world} rank={rank}")


@pytest.mark.gpu
@pytest.mark.parametrize("world,rank,hkv", [(2, 0, 4), (2, 1, 4), (4, 0, 4), (4, 3, 4), (2, 0, 8)])
def test_joined_documents_on_gpu(on_fa4, world, rank, hkv):
    """The joined documents on FA4 (bf16): out and every gradient within 2x SDPA's bf16 error with the same mask,
    lse within 1e-3."""
    got, want, (q, k, v), do, ref, mask = _joined_documents(torch.device("cuda"), torch.bfloat16, world, rank, hkv)
    bar = results(_sdpa_bar(mask.to("cuda")), [q, k, v], do)
    bar_want = results(ref, [x.double().cpu() for x in (q, k, v)], do.cpu())
    tol = {n: 2 * max(rel_err(bar[n], bar_want[n].to("cuda")), 1e-3) for n in ("out", "dq", "dk", "dv")}
    errs = {n: rel_err(got[n], want[n]) for n in tol}
    assert all(errs[n] <= tol[n] for n in tol), (world, rank, hkv, errs, tol)
    assert_close(dict(lse=got["lse"]), dict(lse=want["lse"]), 1e-3, "joined documents")



# ------------------------------------------------------------------ replaying FA4's compiled calls (CPU)
def _compiled_interface(math, calls_per_entry: int = 1, view_of_q: bool = False, drift: bool = False,
                        accum: str = "pre", copies: bool = False, intruder=None, fail_after: int = 0):
    """Stands in for FA4's interface module as the replay sees it. ``_flash_attn_fwd`` (a function with a
    ``compile_cache``, looked up through the module at each call, as FA4's reads its own) allocates out and lse,
    compiles a kernel per layout and mask (a closure over the mask) and calls it with positional arguments
    (q, k, v, out, lse, scale, block tables, aux), which writes out and lse. ``_flash_attn_bwd`` runs three
    compiled kernels as FA4's: preprocessing (delta into a buffer; the dQ accumulator zeroed), main (dQ added
    into the accumulator, reading delta; dK, dV written) and conversion (dQ from the accumulator). ``fwd`` /
    ``bwd`` / ``kernels`` count the Python entries and the kernel calls.

    ``calls_per_entry`` 2: the forward's kernel called twice; ``view_of_q``: an argument that views part of q;
    ``drift``: forward results that change from call to call; ``accum``: "pre" (the preprocessing zeroes the
    accumulator), "zeros" (allocated as zeros instead), "hidden" (a torch op between the kernels makes one
    of their inputs: a replay would not); ``copies``: the backward copies a non-contiguous dlse first (as FA4's
    ``maybe_contiguous``); ``intruder``: run by the forward's kernel on its first call (another thread's FA4
    call meanwhile); ``fail_after``: kernel calls after which every kernel raises an out-of-memory error."""
    ns = types.SimpleNamespace(fwd=0, bwd=0, kernels=0)

    def cached(entry, key, make):
        cache = getattr(ns, entry).compile_cache
        if key not in cache:
            cache[key] = make()
        return getattr(ns, entry).compile_cache[key]

    def forward_kernel(mask_mod):
        def kernel(q, k, v, out, lse, scale, sparse, aux, extra=None):
            ns.kernels += 1
            if fail_after and ns.kernels > fail_after:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            if intruder is not None and ns.kernels == 1:
                intruder(ns)
            o, l_, *_ = math._flash_attn_fwd(q, k, v, softmax_scale=scale, pack_gqa=False, mask_mod=mask_mod,
                                             block_sparse_tensors=sparse, return_lse=True, aux_tensors=aux[0])
            out.copy_(o + ns.kernels if drift else o)
            lse.copy_(l_)
        return kernel

    def _flash_attn_fwd(q, k, v, softmax_scale=None, causal=False, pack_gqa=None, mask_mod=None,
                        block_sparse_tensors=None, return_lse=False, aux_tensors=None):
        ns.fwd += 1
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32)
        kernel = cached("_flash_attn_fwd", (q.shape, k.shape, q.dtype, id(mask_mod)), lambda: forward_kernel(mask_mod))
        extra = q[:, :1] if view_of_q else None
        for _ in range(calls_per_entry):
            kernel(q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, block_sparse_tensors, (aux_tensors,),
                   extra)
        return out, lse, None, None, None

    def pre(out, dout, dlse, delta, acc):
        ns.kernels += 1
        delta.copy_((out.double() * dout.double()).sum(-1).transpose(1, 2) - (0 if dlse is None else dlse))
        if accum != "zeros":
            acc.zero_()

    def main_kernel(mask_mod):
        def kernel(q, k, v, out, dout, lse, dlse, delta, acc, dk, dv, scale, sparse, aux):
            ns.kernels += 1
            lse = lse / 2 if accum == "hidden" else lse
            g = math._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, mask_mod=mask_mod,
                                     aux_tensors=aux[0], block_sparse_tensors=sparse, dlse=dlse)
            acc.add_(g[0].double() + 0 * delta.sum())  # reads delta, as FA4's kernel does
            dk.copy_(g[1])
            dv.copy_(g[2])
        return kernel

    def post(acc, dq):
        ns.kernels += 1
        dq.copy_(acc)

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, mask_mod=None, aux_tensors=None,
                        block_sparse_tensors=None, dlse=None):
        ns.bwd += 1
        if copies and dlse is not None and not dlse.is_contiguous():
            dlse = dlse.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64)
        acc = (torch.zeros if accum == "zeros" else torch.empty)(q.shape, dtype=torch.float64)
        key = (q.shape, k.shape, q.dtype, id(mask_mod))
        cached("_bwd_preprocess", key, lambda: pre)(out, dout, dlse, delta, acc)
        lse_in = lse * 2 if accum == "hidden" else lse
        cached("_flash_attn_bwd", key, lambda: main_kernel(mask_mod))(
            q.detach(), k.detach(), v.detach(), out, dout, lse_in, dlse, delta, acc, dk, dv, softmax_scale,
            block_sparse_tensors, (aux_tensors,))
        cached("_bwd_postprocess_convert", key, lambda: post)(acc, dq)
        return dq, dk, dv

    for f in (_flash_attn_fwd, _flash_attn_bwd, pre, post):
        f.compile_cache = {}
    ns._flash_attn_fwd, ns._flash_attn_bwd, ns._bwd_preprocess, ns._bwd_postprocess_convert = (
        _flash_attn_fwd, _flash_attn_bwd, pre, post)
    return ns


@pytest.mark.parametrize("name", ["block_sparse", "dilated_causal", "local_global_flags"])
def test_passes_replay_their_compiled_calls(stand_in, name):
    """After a layout's first call, a step's forward and backward call FA4's compiled kernels directly (no FA4
    Python entry): out, lse and every gradient still the float64 definition's for new inputs; a new layout
    records again; the replays keep none of the recorded tensors."""
    from longattn.flex import pieces, schedule

    compiled = _compiled_interface(stand_in.interface)
    stand_in.interface = compiled
    schedule.PLANS.clear()  # executors other tests planned hold their stand-in's verdicts
    m = PATTERNS[name]
    mk = lambda *s: torch.randn(*s, dtype=torch.float64)
    run = None
    for i, n in enumerate((S, S, S, S - 44)):
        q, k, v, do = mk(2, n, 4, 16), mk(2, n, 2, 16), mk(2, n, 2, 16), mk(2, n, 4, 16)
        run = pieces.single_executor(q, k, m, 0.25)
        got = results(lambda q, k, v: fa4.Fa4Flex.apply(q, k, v, run), [q, k, v], do)
        want = results(lambda q, k, v: flex_ref(q, k, v, m, scale=0.25), [q, k, v], do)
        assert_close(got, want, 1e-6, f"{name} call {i}")
        if i == 0:
            first = (compiled.fwd, compiled.bwd, compiled.kernels)
            # each entry's kernels, and its replay checked once
            assert first[2] == 2 * (first[0] + 3 * first[1]) and first[0] and first[1], first
        elif i < 3:
            assert (compiled.fwd, compiled.bwd) == first[:2], (i, first)
            assert compiled.kernels == first[2] + i * (first[0] + 3 * first[1]), (i, first)
    assert (compiled.fwd, compiled.bwd) == (2 * first[0], 2 * first[1])  # the shorter layout recorded anew
    replays = [r for s in fa4.steps_of(run) for r in s.replays.values()]
    assert replays and all(isinstance(r, _fa4_api.Replay) for r in replays), replays
    assert all(a[i] is None for r in replays for _, a, slots in r.calls for i in slots)


def _record(interface, case):
    """((results..., replay), inputs) of a masked forward or backward ("fwd" / "bwd") recorded on ``interface``,
    causal, the same inputs every time."""
    torch.manual_seed(0)
    m = PATTERNS["causal"]
    q, k, v, do = (torch.randn(1, 64, 2, 16, dtype=torch.float64) for _ in range(4))
    step = fa4.single_step(q, k, m)
    mask = fa4.cute_mask(step.form)
    if case == "fwd":
        sparse = types.SimpleNamespace(**step.tensors["fwd"], block_size=step.block)
        return _fa4_api.record_masked_forward(interface, q, k, v, 0.25, mask, sparse, step.aux), (q, k, v)
    out, lse = flex_ref(q, k, v, m, scale=0.25)
    sparse = types.SimpleNamespace(**step.tensors["bwd"], block_size=step.block)
    got = _fa4_api.record_masked_backward(interface, do, q, k, v, out.detach(), lse.detach().float(), 0.25, mask,
                                          sparse, step.aux)
    return got, (do, q, k, v, out.detach(), lse.detach().float())


@pytest.mark.parametrize("case,says", [("plain", "no compiled call"), ("view", "views an input"),
                                       ("drift", "differed"), ("hidden", "input lse reached no compiled call")])
def test_replay_refused(stand_in, case, says):
    """A call whose compiled calls a replay cannot repeat is not replayed, with the reason, and its own results
    come back: an interface without JIT caches, an argument viewing part of q (a replay would not renew it),
    forward results that differ on the same inputs, a backward whose kernels read a tensor a torch op made
    from an input between them instead of the input (a replay would not make it)."""
    math = stand_in.interface
    interface = {"plain": math, "view": _compiled_interface(math, view_of_q=True),
                 "drift": _compiled_interface(math, drift=True), "hidden": _compiled_interface(math, accum="hidden")}
    (*res, replay), _ = _record(interface[case], "bwd" if case == "hidden" else "fwd")
    assert isinstance(replay, str) and says in replay, replay
    (*want, _), _ = _record(math if case != "hidden" else _compiled_interface(math), "bwd" if case == "hidden" else "fwd")
    for r, w in zip(res, want):
        assert torch.equal(r, w + (1 if case == "drift" and r.dtype == torch.float64 and r.dim() == 4 else 0))
    assert all(not isinstance(f.compile_cache, _fa4_api._Recorder) for f in _fa4_api._caches(interface[case]).values())


def test_replay_refused_where_inputs_alias(stand_in):
    """Recorded with k and v the same tensor, a replay could not tell their slots apart (a later call may pass
    two tensors): not replayed, the call's own results returned."""
    math = stand_in.interface
    q, kv = (torch.randn(1, 64, 2, 16, dtype=torch.float64) for _ in range(2))
    step = fa4.single_step(q, kv, PATTERNS["causal"])
    sparse = types.SimpleNamespace(**step.tensors["fwd"], block_size=step.block)
    out, lse, replay = _fa4_api.record_masked_forward(_compiled_interface(math), q, kv, kv, 0.25,
                                                      fa4.cute_mask(step.form), sparse, step.aux)
    assert replay == "two of the inputs are the same tensor"
    ref = flex_ref(q, kv, kv, PATTERNS["causal"], scale=0.25)
    assert_close(dict(out=out, lse=lse), dict(out=ref[0], lse=ref[1]), 1e-6, "aliased")


@pytest.mark.parametrize("case", ["two", "pre", "zeros"])
def test_replay_repeats_the_calls(stand_in, case):
    """A forward that calls its kernel twice replays both calls; a backward's three kernels replay with their
    buffers allocated per call, as zeros where the recorded call's started as zeros and nothing else reads them
    first (the accumulator of "zeros"), so new inputs get the call's own results."""
    math = stand_in.interface
    interface = _compiled_interface(math, calls_per_entry=2 if case == "two" else 1,
                                    accum="pre" if case == "two" else case)
    (*_, replay), inputs = _record(interface, "fwd" if case == "two" else "bwd")
    assert isinstance(replay, _fa4_api.Replay), replay
    assert len(replay.calls) == (2 if case == "two" else 3)
    assert (len(replay.zeros) == 1) == (case == "zeros")
    new = [torch.randn_like(x) for x in inputs]
    if case == "two":
        got = replay(q=new[0], k=new[1], v=new[2])
        ref = flex_ref(new[0], new[1], new[2], PATTERNS["causal"], scale=0.25)
        assert_close(dict(out=got[0], lse=got[1]), dict(out=ref[0], lse=ref[1]), 1e-6, case)
        return
    do, q, k, v = new[:4]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = flex_ref(q, k, v, PATTERNS["causal"], scale=0.25)
    want = torch.autograd.grad(out, (q, k, v), do)
    got = replay(**_fa4_api.backward_inputs(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach()))
    assert_close(dict(zip("qkv", got)), dict(zip("qkv", want)), 1e-6, case)


def test_replay_takes_the_lse_gradient_as_given(stand_in):
    """An lse gradient autograd expanded from a scalar (strides 0; all zeros on the first call, as a loss term
    whose weight starts at 0) is one FA4 copies before its kernels: the backward hands FA4 a contiguous one, so
    the recording names the tensor its kernels take, and a later call's nonzero dlse reaches them (a replay that
    kept the recorded zeros would drop it). Recorded on FA4's own copy, a replay is refused, naming the input."""
    math = stand_in.interface
    torch.manual_seed(0)
    m = PATTERNS["causal"]
    q, k, v, do = (torch.randn(1, 64, 2, 16, dtype=torch.float64) for _ in range(4))
    step = fa4.single_step(q, k, m)
    sparse = types.SimpleNamespace(**step.tensors["bwd"], block_size=step.block)
    mask = fa4.cute_mask(step.form)
    out, lse = flex_ref(q, k, v, m, scale=0.25)
    zero = torch.zeros(()).expand(lse.shape)  # float32, as lse
    interface = _compiled_interface(math, copies=True)
    *_, replay = _fa4_api.record_masked_backward(interface, do, q, k, v, out.detach(), lse.detach(), 0.25, mask,
                                                 sparse, step.aux, dlse=zero)
    assert isinstance(replay, _fa4_api.Replay), replay
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = flex_ref(q, k, v, m, scale=0.25)
    dl = torch.ones(()).expand(lse.shape)
    want = torch.autograd.grad((out, lse), (q, k, v), (do, dl))
    got = replay(**_fa4_api.backward_inputs(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dl))
    assert_close(dict(zip("qkv", got)), dict(zip("qkv", want)), 1e-6, "dlse")

    t = dict(_fa4_api.backward_inputs(do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach()),
             dlse=zero)  # as FA4 is given it without backward_inputs: its copy would stand for it
    _, why = _fa4_api.record(interface, lambda: _fa4_api.masked_backward(
        interface, t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], 0.25, mask, sparse, step.aux, t["dlse"]),
        t, exact=False)
    assert why == "input dlse reached no compiled call as itself", why


def test_replay_leaves_out_other_threads_calls(stand_in):
    """Another thread's FA4 call while a call records (FA4's JIT caches are the process's) is not part of the
    recording: the replay makes the recorded call's one kernel call, and the other thread's call gets its own
    results."""
    import threading

    math = stand_in.interface
    other = {}

    def intruder(ns):
        x = torch.randn(1, 32, 2, 16, dtype=torch.float64)
        st = fa4.single_step(x, x, PATTERNS["causal"])
        sp = types.SimpleNamespace(**st.tensors["fwd"], block_size=st.block)
        th = threading.Thread(target=lambda: other.update(
            got=_fa4_api.masked_forward(ns, x, x.clone(), x.clone(), 0.25, fa4.cute_mask(st.form), sp, st.aux),
            want=flex_ref(x, x, x, PATTERNS["causal"], scale=0.25)))
        th.start()
        th.join()

    (*_, replay), inputs = _record(_compiled_interface(math, intruder=intruder), "fwd")
    assert isinstance(replay, _fa4_api.Replay) and len(replay.calls) == 1, replay
    assert_close(dict(out=other["got"][0]), dict(out=other["want"][0]), 1e-6, "other thread")
    new = [torch.randn_like(x) for x in inputs]
    got = replay(q=new[0], k=new[1], v=new[2])
    ref = flex_ref(*new, PATTERNS["causal"], scale=0.25)
    assert_close(dict(out=got[0], lse=got[1]), dict(out=ref[0], lse=ref[1]), 1e-6, "replayed")


def test_replay_check_that_fails_is_a_reason(stand_in):
    """A check of the replay that raises (out of memory: it holds a second set of results) leaves the call's own
    results and a reason, not an error; inputs with NaN still replay (NaN where the call has NaN is alike)."""
    math = stand_in.interface
    (out, lse, replay), inputs = _record(_compiled_interface(math, fail_after=1), "fwd")
    assert isinstance(replay, str) and replay.startswith("checking the replay failed (OutOfMemoryError"), replay
    ref = flex_ref(*inputs, PATTERNS["causal"], scale=0.25)
    assert_close(dict(out=out, lse=lse), dict(out=ref[0], lse=ref[1]), 1e-6, "own results")

    q, k, v = inputs
    q = q.clone()
    q[0, 3, 1, 0] = float("nan")
    step = fa4.single_step(q, k, PATTERNS["causal"])
    sparse = types.SimpleNamespace(**step.tensors["fwd"], block_size=step.block)
    *_, replay = _fa4_api.record_masked_forward(_compiled_interface(math), q, k, v, 0.25, fa4.cute_mask(step.form),
                                                sparse, step.aux)
    assert isinstance(replay, _fa4_api.Replay), replay


def test_replay_keys_and_unaligned_inputs(stand_in):
    """A replay serves only its key: another scale or another batch records again (one FA4 entry each, then
    replays), and an input whose address is not 16-byte aligned (the compiled kernels assume it) takes FA4's own
    entry even where its layout has a replay; every call's out as the float64 definition's."""
    compiled = _compiled_interface(stand_in.interface)
    stand_in.interface = compiled
    m = PATTERNS["causal"]
    mk = lambda b=1: tuple(torch.randn(b, 64, 2, 16, dtype=torch.float64) for _ in range(3))
    step = fa4.single_step(*mk()[:2], m)

    def call(q, k, v, scale):
        out, lse = fa4.step_forward(step, q, k, v, scale)
        ref = flex_ref(q, k, v, m, scale=scale)
        assert_close(dict(out=out, lse=lse), dict(out=ref[0], lse=ref[1]), 1e-6, f"scale {scale} {q.shape}")
        return compiled.fwd

    for scale, b in ((0.25, 1), (0.5, 1), (0.25, 2)):
        before = compiled.fwd
        assert [call(*mk(b), scale) - before for _ in range(3)] == [1, 1, 1], (scale, b)
    assert len(step.replays) == 3 and all(callable(r) for r in step.replays.values())
    flat = torch.randn(64 * 2 * 16 + 1, dtype=torch.float64)[1:]  # 8 bytes past an aligned address
    q = flat.view(1, 64, 2, 16)
    assert q.data_ptr() % 16 and _fa4_api.replay_key(q, scale=1.0) == _fa4_api.replay_key(mk()[0], scale=1.0)
    before = compiled.fwd
    call(q, *mk()[1:], 0.25)
    assert compiled.fwd == before + 1 and len(step.replays) == 3


def test_replay_only_for_calls_the_tuning_takes(stand_in):
    """Fa4Tuning.replay_max_tokens decides: a call of more query or key tokens (batch x rows) takes FA4's own
    entry every time and records nothing; within it the second call replays. A value that is not an int >= 0
    raises, naming the field."""
    from longattn import tuning

    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="replay_max_tokens must be an int >= 0"):
            tuning.Fa4Tuning(replay_max_tokens=bad)

    compiled = _compiled_interface(stand_in.interface)
    stand_in.interface = compiled
    q, k, v = (torch.randn(2, 64, 2, 16, dtype=torch.float64) for _ in range(3))
    for limit, entries, rows in ((127, 3, 64), (128, 1, 64), (127, 3, 16)):
        # 2 x 16 query rows against 2 x 64 keys: the keys' tokens count too (the check's second dK, dV)
        qr = q[:, :rows]
        step = fa4.single_step(qr, k, PATTERNS["causal"])
        compiled.fwd = 0
        for _ in range(3):
            out, lse = fa4.step_forward(step, qr, k, v, 0.25, tuning.Fa4Tuning(replay_max_tokens=limit))
        assert compiled.fwd == entries and bool(step.replays) == (entries == 1), (limit, rows, compiled.fwd)
        assert_close(dict(out=out, lse=lse), dict(zip(("out", "lse"), flex_ref(qr, k, v, PATTERNS["causal"],
                                                                                scale=0.25))), 1e-6, str(limit))


def test_bench_flex_fa4_step(stand_in):
    """longattn.bench.patterns.flex_fa4_step (the call fa4_host_time.py and flex_graph_kernels.py take apart): the
    planned executor of a flex bench config, its fwd+bwd through fa4.Fa4Flex, gradients cleared after."""
    from longattn.bench.configs import CONFIGS
    from longattn.bench.patterns import flex_fa4_step

    cfg = dataclasses.replace(CONFIGS["flex_bsparse_32k"], seqlen=512, heads=2, head_dim=16)
    run, step = flex_fa4_step(cfg, torch.device("cpu"))
    assert type(run).__name__ in ("RingStep", "CarvedStep"), run
    out, grads = step()
    out2, grads2 = step()  # the inputs' gradients were cleared: the second call's are not added to the first's
    assert out.shape == (1, 512, 2, 16) and torch.isfinite(out).all() and torch.equal(out, out2)
    assert all(g is not None and torch.equal(g, g2) for g, g2 in zip(grads, grads2))
