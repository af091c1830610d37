"""Implementations a user would choose between, as benchmark entries.

Each entry says why it cannot run a config on a device (``reason``) or
builds a callable ``fn(q, k, v) -> out`` over (B, S, H, D) tensors that were
made before timing. Baselines are what users would otherwise pick: PyTorch
SDPA backends, FlexAttention, and the gather-then-SDPA dilated algorithm of
dilated-attention-pytorch (heads divided among branches).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import longattn
from longattn import dilated as _dil

from .configs import DTYPES, Config


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    kinds: tuple[str, ...]
    build: Callable[[Config, torch.device], Callable]
    reason: Callable[[Config, torch.device], Optional[str]] = lambda c, d: None
    note: str = ""
    comparable: bool = True
    """its output is compared with the reference (``rel_diff_vs_ref``)."""
    computes: Optional[str] = None
    """set when it computes another function than the config's, named here: its
    rel diff then measures how far that function is from ours, not an error."""
    pair_fraction: Callable[[Config], float] = lambda c: 1.0
    """share of the config's useful pairs this implementation computes (FLOPs count only those)."""


_NO_TRITON = "Triton kernels unavailable here (on CPU they run only under TRITON_INTERPRET=1, the slow interpreter)"


# ------------------------------------------------------------------ helpers
def _sdpa(backend_name: Optional[str]):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    table = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}

    def build(cfg: Config, dev):
        gqa = cfg.hkv != cfg.heads

        def fn(q, k, v):
            with sdpa_kernel([table[backend_name]]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=cfg.causal, enable_gqa=gqa)
            return o.transpose(1, 2)
        return fn

    def reason(cfg: Config, dev):
        if backend_name in ("cudnn", "flash", "efficient") and dev.type != "cuda":
            return f"SDPA {backend_name} backend needs CUDA"
        if cfg.window != (-1, -1):
            return "SDPA has no sliding-window argument"
        if backend_name == "math" and cfg.seqlen > 16384:
            return "math backend materialises S x S scores (skipped above 16K)"
        return None
    return build, reason


def _flex_build(cfg: Config, dev):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    left, right = cfg.window
    causal = cfg.causal

    def mask_mod(b, h, qi, ki):
        ok = qi >= 0
        if causal:
            ok = ok & (ki <= qi)
        if left >= 0:
            ok = ok & (qi - ki <= left)
        if right >= 0:
            ok = ok & (ki - qi <= right)
        return ok

    bm = create_block_mask(mask_mod, None, None, cfg.seqlen, cfg.seqlen, device=dev)
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = cfg.hkv != cfg.heads

    def fn(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=gqa)
        return o.transpose(1, 2)
    return fn


def _flex_reason(cfg: Config, dev):
    if dev.type != "cuda":
        return "FlexAttention is benchmarked on CUDA only (CPU compile time dominates small runs)"
    return None


def headsplit_dilated(q, k, v, segment_lengths, dilation_rates, causal):
    """The dilated-attention-pytorch algorithm (baseline): heads are divided
    among the branches; branch i gathers rows ``offset::r`` (offset = i % r)
    of each segment for its head group, runs SDPA on the copies and scatters
    back; the sum is divided by the number of branches. Needs S divisible by
    every segment length. Not LongNet's definition (see longattn.dilated)."""
    b, s, h, d = q.shape
    n = len(segment_lengths)
    out = torch.zeros_like(q)
    bounds = [round(i * h / n) for i in range(n + 1)]
    g = h // k.shape[2]
    for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates)):
        h0, h1 = bounds[i], bounds[i + 1]
        if h1 == h0:
            continue
        off = i % r
        w = min(w, s)
        qs = q.view(b, s // w, w, h, d)[:, :, off::r, h0:h1]
        kvh = torch.arange(h0, h1, device=q.device) // g
        ks = k.view(b, s // w, w, -1, d)[:, :, off::r].index_select(3, kvh)
        vs = v.view(b, s // w, w, -1, d)[:, :, off::r].index_select(3, kvh)
        m = qs.shape[2]
        x = F.scaled_dot_product_attention(qs.reshape(-1, m, h1 - h0, d).transpose(1, 2),
                                           ks.reshape(-1, m, h1 - h0, d).transpose(1, 2),
                                           vs.reshape(-1, m, h1 - h0, d).transpose(1, 2), is_causal=causal)
        x = x.transpose(1, 2).reshape(b, s // w, m, h1 - h0, d)
        out = out.view(b, s // w, w, h, d)
        out[:, :, off::r, h0:h1] += x
        out = out.view(b, s, h, d)
    return out / n


def _headsplit_reason(cfg: Config, dev):
    if any(cfg.seqlen % min(w, cfg.seqlen) for w in cfg.segment_lengths):
        return "head-split algorithm needs seqlen divisible by every segment length"
    return None


def _flex_dilated_build(cfg: Config, dev):
    """FlexAttention with a LongNet head-split dilated mask (as in the anchors)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segs = torch.tensor(cfg.segment_lengths, device=dev)
    rates = torch.tensor(cfg.dilation_rates, device=dev)
    n, h = len(cfg.segment_lengths), cfg.heads
    branch_of_head = torch.tensor([min(i * n // h, n - 1) for i in range(h)], device=dev)

    def mask_mod(b, hh, qi, ki):
        br = branch_of_head[hh]
        w, r = segs[br], rates[br]
        off = br % r
        ok = (qi // w == ki // w) & ((qi % w) % r == off) & ((ki % w) % r == off)
        if cfg.causal:
            ok = ok & (ki <= qi)
        return ok

    bm = create_block_mask(mask_mod, None, h, cfg.seqlen, cfg.seqlen, device=dev)
    flex = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                    enable_gqa=cfg.hkv != cfg.heads).transpose(1, 2)
    return fn


def _dilated(backend: str):
    def build(cfg: Config, dev):
        def fn(q, k, v):
            return longattn.dilated_attention(q, k, v, segment_lengths=cfg.segment_lengths,
                                              dilation_rates=cfg.dilation_rates, causal=cfg.causal, backend=backend)
        return fn

    def reason(cfg: Config, dev):
        if backend == "triton" and not longattn.kernels_available(dev.type):
            return _NO_TRITON
        return None
    return build, reason


def _dilated_graphed_build(cfg: Config, dev):
    """``longattn-dilated`` captured as CUDA graphs with
    ``torch.cuda.make_graphed_callables`` (one graph per pass): what a user
    who graphs the layer gets. Each call copies q, k, v (and the backward's
    dout) into the graphs' static inputs; that is timed. The graphs' memory
    (static buffers, private pool) is allocated here, before any measured call,
    so the peak-memory columns leave it out."""
    fn = _dilated("auto")[0](cfg, dev)
    dt = DTYPES[cfg.dtype]
    mk = lambda h: torch.randn(cfg.batch, cfg.seqlen, h, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
    return torch.cuda.make_graphed_callables(fn, (mk(cfg.heads), mk(cfg.hkv), mk(cfg.hkv)))


def _dense_ours(backend: str):
    def build(cfg: Config, dev):
        def fn(q, k, v):
            return longattn.attention(q, k, v, causal=cfg.causal, window_size=cfg.window, backend=backend)
        return fn

    def reason(cfg: Config, dev):
        if backend == "triton" and not longattn.kernels_available(dev.type):
            return _NO_TRITON
        if backend == "cudnn" and dev.type != "cuda":
            return "cuDNN needs CUDA"
        return None
    return build, reason


def _varlen(backend: str):
    def build(cfg: Config, dev):
        cu = varlen_cu_seqlens(cfg, dev)
        maxlen = int((cu[1:] - cu[:-1]).max())

        def fn(q, k, v):
            b, s, h, d = q.shape
            o = longattn.attention_varlen(q.reshape(b * s, h, d), k.reshape(b * s, -1, d), v.reshape(b * s, -1, d),
                                          cu, max_seqlen=maxlen, causal=cfg.causal, backend=backend)
            return o.view(b, s, h, d)
        return fn

    def reason(cfg: Config, dev):
        if backend == "triton" and dev.type != "cuda":
            return "the Triton varlen kernel is timed on CUDA only (the CPU interpreter is for tests)"
        if backend == "flash" and dev.type != "cuda":
            return "flash varlen needs CUDA"
        return None
    return build, reason


def _sdpa_per_doc_build(cfg: Config, dev):
    cu = varlen_cu_seqlens(cfg, dev).tolist()

    def fn(q, k, v):
        b, s, h, d = q.shape
        qf, kf, vf = q.reshape(b * s, h, d), k.reshape(b * s, -1, d), v.reshape(b * s, -1, d)
        outs = []
        for a, e in zip(cu[:-1], cu[1:]):
            outs.append(F.scaled_dot_product_attention(qf[a:e].transpose(0, 1)[None], kf[a:e].transpose(0, 1)[None],
                                                       vf[a:e].transpose(0, 1)[None], is_causal=cfg.causal,
                                                       enable_gqa=cfg.hkv != cfg.heads)[0].transpose(0, 1))
        return torch.cat(outs).view(b, s, h, d)
    return fn


def varlen_doc_lengths(cfg: Config) -> list[int]:
    total, lens, i = cfg.batch * cfg.seqlen, [], 0
    while sum(lens) < total:
        lens.append(min(cfg.doc_lengths[i % len(cfg.doc_lengths)], total - sum(lens)))
        i += 1
    return lens


def varlen_cu_seqlens(cfg: Config, dev) -> torch.Tensor:
    lens = torch.tensor([0] + varlen_doc_lengths(cfg))
    return lens.cumsum(0).to(torch.int32).to(dev)


_b = {n: _sdpa(n) for n in ("cudnn", "flash", "efficient", "math")}
_d = {n: _dense_ours(n) for n in ("auto", "triton", "cudnn")}
_g = {n: _dilated(n) for n in ("auto", "triton")}


def _gather_build(cfg, dev):
    """The gather path with the local backend `auto` would pick for its dense
    blocks, the Triton kernel excluded (it is the fused path's)."""
    from longattn import backends as bk

    def fn(q, k, v):
        best = bk.select_backend(q, k, bk.BlockSpec(1.0, cfg.causal), exclude=("triton",)).name
        return longattn.dilated_attention(q, k, v, segment_lengths=cfg.segment_lengths,
                                          dilation_rates=cfg.dilation_rates, causal=cfg.causal, backend=best)
    return fn


def _dense_max_tokens() -> int:
    return int(os.environ.get("LONGATTN_BENCH_DENSE_MAX_TOKENS", 262144))


_HEADSPLIT = "head-split dilated attention (each head in one branch; LongNet puts every head in every branch)"

IMPLS: dict[str, Impl] = {i.name: i for i in (
    Impl("longattn", ("dense", "window"), _d["auto"][0], _d["auto"][1], "longattn.attention, backend auto"),
    Impl("longattn-triton", ("dense", "window"), _d["triton"][0], _d["triton"][1], "our Triton kernel"),
    Impl("sdpa-cudnn", ("dense",), *_b["cudnn"], note="torch SDPA, cuDNN backend"),
    Impl("sdpa-flash", ("dense",), *_b["flash"], note="torch SDPA, flash backend (FA2)"),
    Impl("sdpa-efficient", ("dense",), *_b["efficient"], note="torch SDPA, mem-efficient backend"),
    Impl("sdpa-math", ("dense",), *_b["math"], note="torch SDPA, math backend"),
    Impl("flex", ("dense", "window"), _flex_build, _flex_reason, "FlexAttention, compiled"),
    Impl("longattn-dilated", ("dilated",), *_g["auto"],
         note="longattn.dilated_attention, auto (MHA on Hopper: cuDNN on strided views; else fused Triton)"),
    Impl("longattn-dilated-triton", ("dilated",), *_g["triton"], note="fused Triton dilated kernels"),
    Impl("longattn-dilated-graphed", ("dilated",), _dilated_graphed_build,
         lambda c, d: None if d.type == "cuda" else "CUDA graphs need CUDA",
         "longattn-dilated in CUDA graphs (torch.cuda.make_graphed_callables; input copies timed, graph memory "
         "not in the peaks)"),
    Impl("longattn-dilated-gather", ("dilated",), _gather_build, lambda c, d: None,
         "LongNet-exact per-part path + best local backend + lse merge (MHA: strided views, GQA: gathered copies)"),
    Impl("headsplit-gather", ("dilated",), lambda c, d: (lambda q, k, v: headsplit_dilated(
        q, k, v, c.segment_lengths, c.dilation_rates, c.causal)), _headsplit_reason,
        "dilated-attention-pytorch algorithm: heads split among branches, gather + SDPA",
        computes=_HEADSPLIT, pair_fraction=lambda c: 1.0 / len(c.segment_lengths)),
    Impl("flex-dilated", ("dilated",), _flex_dilated_build, _flex_reason, "FlexAttention, head-split dilated mask",
         computes=_HEADSPLIT, pair_fraction=lambda c: 1.0 / len(c.segment_lengths)),
    Impl("dense-same-length", ("dilated", "varlen"), lambda c, d: (lambda q, k, v: longattn.attention(
        q, k, v, causal=c.causal)), lambda c, d: ("dense attention above 256K tokens takes minutes per call (its cost grows"
                                           " as S^2: see the 128K row; LONGATTN_BENCH_DENSE_MAX_TOKENS raises the limit)"
                                           if c.seqlen * c.batch > _dense_max_tokens() else None),
        "dense attention at the same length (auto: cuDNN on CUDA)",
        comparable=False, computes="dense attention at the same length (a cost reference)"),
    Impl("longattn-varlen", ("varlen",), *_varlen("auto"), note="longattn.attention_varlen, backend auto"),
    Impl("longattn-varlen-triton", ("varlen",), *_varlen("triton"), note="attention_varlen, our Triton varlen kernel"),
    Impl("longattn-varlen-flash", ("varlen",), *_varlen("flash"), note="attention_varlen, PyTorch's flash varlen"),
    Impl("sdpa-per-doc", ("varlen",), _sdpa_per_doc_build, lambda c, d: None, "SDPA called once per document"),
)}


def impls_for(cfg: Config) -> list[Impl]:
    kind = "window" if cfg.kind == "dense" and cfg.window != (-1, -1) else cfg.kind
    return [i for i in IMPLS.values() if kind in i.kinds]


def useful_pairs(cfg: Config) -> float:
    """(query, key) pairs per (batch, head) counted as flash-attn does for
    dense (S^2, half for causal) and exactly for sparse patterns."""
    s = cfg.seqlen
    if cfg.kind == "flex":
        return flex_pairs(cfg)
    if cfg.kind == "dilated":
        return _dil.pair_count(s, cfg.segment_lengths, cfg.dilation_rates, cfg.heads, cfg.causal) / cfg.heads
    if cfg.kind == "varlen":
        lens = varlen_doc_lengths(cfg)
        return sum(n * n / (2 if cfg.causal else 1) for n in lens) / cfg.batch
    left, right = cfg.window
    if left < 0 and right < 0:
        return s * s / (2 if cfg.causal else 1)
    i = torch.arange(s, dtype=torch.float64)
    hi = torch.minimum(i + (0 if cfg.causal else (right if right >= 0 else s)), torch.tensor(s - 1.0))
    lo = torch.clamp(i - (left if left >= 0 else s), min=0)
    return float((hi - lo + 1).clamp(min=0).sum())


def fwd_flops(cfg: Config) -> float:
    return 4.0 * cfg.batch * cfg.heads * cfg.head_dim * useful_pairs(cfg)


# ------------------------------------------------------------------ attention patterns (FlexAttention masks)
# Configs of kind "flex" (configs.FlexConfig): longattn.flex_attention against torch's compiled
# FlexAttention and dense cuDNN on one device; for `dist`, ring_flex_attention against torch's
# context_parallel running FlexAttention (K/V all-gathered).
def _flex_doc_lengths(cfg: Config) -> list[int]:
    total, lens, i = cfg.seqlen, [], 0
    while sum(lens) < total:
        lens.append(min(cfg.pattern_args[i % len(cfg.pattern_args)], total - sum(lens)))
        i += 1
    return lens


def _flex_layout(cfg: Config) -> torch.Tensor:
    block, band, density, seed = cfg.pattern_args
    n = -(-cfg.seqlen // block)
    i = torch.arange(n)
    lay = (i[:, None] - i[None, :]).abs() <= band
    lay |= (i[:, None] == 0) | (i[None, :] == 0)
    return lay | (torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) < density)


def flex_mask(cfg: Config, dev):
    """The config's mask_mod (tensors on ``dev``), and-ed with causal when ``cfg.causal``."""
    from longattn import masks

    p, a = cfg.pattern, cfg.pattern_args
    if p == "local_global":
        m = masks.local_global(a[0], a[1])
    elif p == "causal_document":
        cu = torch.tensor([0] + _flex_doc_lengths(cfg)).cumsum(0)
        m = masks.and_(masks.causal(), masks.document(cu_seqlens=cu.to(dev)))
    elif p == "prefix_lm":
        m = masks.prefix_lm(int(cfg.seqlen * a[0]))
    else:
        m = masks.block_sparse(_flex_layout(cfg).to(dev), a[0])
    return masks.and_(masks.causal(), m) if cfg.causal else m


@functools.lru_cache(maxsize=64)
def flex_pairs(cfg: Config) -> float:
    """Visible (query, key) pairs of the pattern per (batch, head), counted exactly."""
    s, a = cfg.seqlen, cfg.pattern_args
    q = torch.arange(s, dtype=torch.float64)
    if cfg.causal:
        return _flex_pairs_by_rows(cfg)
    if cfg.pattern == "block_sparse":
        sizes = torch.full((-(-s // a[0]),), float(a[0]), dtype=torch.float64)
        sizes[-1] = s - a[0] * (len(sizes) - 1)
        return float((_flex_layout(cfg).double() * sizes[:, None] * sizes[None, :]).sum())
    if cfg.pattern == "local_global":
        w, n = a
        lo, hi = (q - w).clamp(min=0), (q + w).clamp(max=s - 1)
        band_in_globals = (hi.clamp(max=n - 1) - lo + 1).clamp(min=0)
        per_row = torch.where(q < n, torch.tensor(float(s)), (hi - lo + 1) + n - band_in_globals)
        return float(per_row.sum())
    if cfg.pattern == "causal_document":
        return float(sum(n * (n + 1) / 2 for n in _flex_doc_lengths(cfg)))
    return float(torch.maximum(q + 1, torch.tensor(float(int(s * a[0])))).sum())  # prefix_lm


def _flex_pairs_by_rows(cfg: Config, rows: int = 1024) -> float:
    """The mask evaluated in row chunks (on CUDA when present): patterns without a closed form."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, s, total = flex_mask(cfg, dev), cfg.seqlen, 0
    k = torch.arange(s, device=dev).view(1, 1, 1, -1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    for r0 in range(0, s, rows):
        q = torch.arange(r0, min(s, r0 + rows), device=dev).view(1, 1, -1, 1)
        total += int(m(zero, zero, q, k).expand(1, 1, q.shape[2], s).sum())
    return float(total)


def _longattn_flex_build(cfg: Config, dev):
    mask = flex_mask(cfg, dev)
    return lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mask)


def _torch_flex_build(cfg: Config, dev):
    """torch's FlexAttention as its docs use it: the block mask made by a compiled
    create_block_mask (no S x S mask in memory), flex_attention compiled."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    bm = torch.compile(create_block_mask, dynamic=False)(flex_mask(cfg, dev), None, None, cfg.seqlen, cfg.seqlen,
                                                         device=dev)
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = cfg.hkv != cfg.heads
    return lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                                enable_gqa=gqa).transpose(1, 2)


def _cuda_only(what: str):
    return lambda cfg, dev: None if dev.type == "cuda" else f"{what} needs CUDA"


IMPLS.update({i.name: i for i in (
    Impl("longattn-flex", ("flex",), _longattn_flex_build,
         lambda c, d: None if d.type == "cuda" or c.seqlen * c.batch <= 4096 else
         "on CPU FlexAttention runs eagerly with dense scores (shapes up to 4K tokens)",
         "longattn.flex_attention (compiled FlexAttention on CUDA, block masks cached per pattern)"),
    Impl("torch-flex", ("flex",), _torch_flex_build, _cuda_only("torch's FlexAttention backward (and its compile)"),
         "torch flex_attention, compiled, create_block_mask compiled"),
    Impl("dense-cudnn", ("flex",), _b["cudnn"][0], _cuda_only("SDPA cuDNN"),
         "dense attention (SDPA cuDNN) at the same length: what the pattern saves",
         comparable=False, computes="dense attention at the same length (a cost reference)"),
)})

FLEX_DIST_IMPLS = ("flex-ring", "flex-ring-contiguous", "torch-cp-flex")
"""`dist` rows of flex configs: ring_flex_attention (zigzag, contiguous) and torch's
context_parallel with FlexAttention; T_single is ``torch-flex`` on one device."""


def flex_dist_reason(cfg: Config, impl: str, dev) -> Optional[str]:
    import torch.distributed as dist

    if impl not in FLEX_DIST_IMPLS:
        return f"flex configs run {', '.join(FLEX_DIST_IMPLS)}"
    if impl == "torch-cp-flex":
        if dev.type != "cuda":
            return "torch's context-parallel FlexAttention compiles FlexAttention with a backward: CUDA only"
        if cfg.seqlen % (dist.get_world_size() * 128):
            return "torch's _create_cp_block_mask needs seqlen divisible by ranks x 128"
    elif dev.type != "cuda" and cfg.seqlen * cfg.batch > 4096:
        return "on CPU FlexAttention runs eagerly with dense scores (shapes up to 4K tokens)"
    return None


def flex_dist_build(cfg: Config, impl: str, q, k, v):
    """``(fn, (ql, kl, vl))``: this rank's shards of the global q, k, v (B, S, H, D)
    and the call timed on them (its output shaped like ``ql``)."""
    if impl == "torch-cp-flex":
        return _torch_cp_flex(cfg, q, k, v)
    layout = "contiguous" if impl == "flex-ring-contiguous" else "zigzag"
    mask = flex_mask(cfg, q.device)
    shards = tuple(longattn.shard(x, layout=layout) for x in (q, k, v))
    return (lambda q_, k_, v_: longattn.ring_flex_attention(q_, k_, v_, mask_mod=mask, layout=layout)), shards


class _FlexModule(torch.nn.Module):
    def __init__(self, gqa: bool):
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention

        self.flex, self.gqa = torch.compile(flex_attention, dynamic=False), gqa

    def forward(self, q, k, v, block_mask):
        return self.flex(q, k, v, block_mask=block_mask, enable_gqa=self.gqa)


def _torch_cp_flex(cfg: Config, q, k, v):
    """torch's context-parallel FlexAttention (torch.distributed.tensor.experimental):
    the module wrapper all-gathers K/V before each call (reduce-scatters dK/dV
    after), the block mask of the local queries against the whole sequence from
    ``_create_cp_block_mask``; head-tail balancing, which is longattn's zigzag
    order. Shards (B, H, L, D), as FlexAttention takes them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel, _HeadTailLoadBalancer
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.distributed.tensor.parallel import parallelize_module

    world, s = dist.get_world_size(), q.shape[1]
    mesh = init_device_mesh(q.device.type, (world,))
    balancer = _HeadTailLoadBalancer(s, world, q.device)
    bm = _create_cp_block_mask(flex_mask(cfg, q.device), 1, 1, s, s, mesh, load_balancer=balancer)
    module = parallelize_module(_FlexModule(cfg.hkv != cfg.heads), mesh,
                                _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    shards = tuple(longattn.shard(x, layout="zigzag").transpose(1, 2).contiguous() for x in (q, k, v))
    return (lambda q_, k_, v_: module(q_, k_, v_, block_mask=bm)), shards
