"""Implementations a user would choose between, as benchmark entries.

Each entry says why it cannot run a config on a device (``reason``) or
builds a callable ``fn(q, k, v) -> out`` over (B, S, H, D) tensors that were
made before timing. Baselines are what users would otherwise pick: PyTorch
SDPA backends, FlexAttention, the gather-then-SDPA dilated algorithm of
dilated-attention-pytorch (heads divided among branches) and LongNet's own
function written the direct way (gather per branch, SDPA, merge by lse), see
``baselines``. Flex patterns live in ``patterns``.
"""
from __future__ import annotations

import dataclasses
import os
import types
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import longattn
from longattn import dilated as _dil

from .baselines import headsplit_dilated, longnet_gather_dilated
from .configs import DTYPES, Config
from .patterns import flex_mask, flex_pairs  # noqa: F401 - flex_mask: one import place for callers


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
    backward_reason: Optional[str] = None
    """set for a forward-only implementation: why it has no backward (the row says so)."""


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


def _block_mask(mask_mod, heads, seqlen: int, dev):
    """A BlockMask as FlexAttention's docs make one for long sequences: create_block_mask compiled, which
    evaluates the mask block by block (called eagerly it holds heads x S x S of the mask and its index
    arithmetic at once: out of memory at 32K with 16 heads on an H200)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)(mask_mod, None, heads, seqlen, seqlen, device=dev)


def _flex_build(cfg: Config, dev):
    from torch.nn.attention.flex_attention import flex_attention

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

    bm = _block_mask(mask_mod, None, cfg.seqlen, dev)
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


def _headsplit_reason(cfg: Config, dev):
    if any(cfg.seqlen % min(w, cfg.seqlen) for w in cfg.segment_lengths):
        return "head-split algorithm needs seqlen divisible by every segment length"
    return None


def _flex_dilated_build(cfg: Config, dev):
    """FlexAttention with a LongNet head-split dilated mask (as in the anchors)."""
    from torch.nn.attention.flex_attention import flex_attention

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

    bm = _block_mask(mask_mod, h, cfg.seqlen, dev)
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

    return build, _ours_reason(backend)


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

    return build, _ours_reason(backend)


def _ours_reason(backend: str):
    def reason(cfg: Config, dev):
        if backend == "triton" and not longattn.kernels_available(dev.type):
            return _NO_TRITON
        return _backend_reason(backend, dev)
    return reason


def _backend_reason(backend: str, dev) -> Optional[str]:
    """Why a forced local backend cannot run on ``dev`` at all (shape refusals are the run's)."""
    import importlib.util

    if backend in ("cudnn", "fa4") and dev.type != "cuda":
        return f"{backend} needs CUDA"
    if backend == "fa4" and (importlib.util.find_spec("flash_attn") is None
                             or importlib.util.find_spec("flash_attn.cute") is None):
        return "flash-attn-4 is not installed (pip install 'longattn[fa4]')"
    return None


def _varlen(backend: str):
    def build(cfg: Config, dev):
        cu = varlen_cu_seqlens(cfg, "cpu")  # on the host, as attention_varlen's docstring advises
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
        return _backend_reason(backend, dev)
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
_d = {n: _dense_ours(n) for n in ("auto", "triton", "cudnn", "fa4")}
_g = {n: _dilated(n) for n in ("auto", "triton", "cudnn")}


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
    Impl("longattn-fa4", ("dense", "window"), *_d["fa4"], note="longattn.attention, FlashAttention-4 (CuTe DSL)"),
    Impl("longattn-cudnn", ("dense",), *_d["cudnn"], note="longattn.attention, cuDNN (auto without flash-attn-4)"),
    Impl("sdpa-cudnn", ("dense",), *_b["cudnn"], note="torch SDPA, cuDNN backend"),
    Impl("sdpa-flash", ("dense",), *_b["flash"], note="torch SDPA, flash backend (FA2)"),
    Impl("sdpa-efficient", ("dense",), *_b["efficient"], note="torch SDPA, mem-efficient backend"),
    Impl("sdpa-math", ("dense",), *_b["math"], note="torch SDPA, math backend"),
    Impl("flex", ("dense", "window"), _flex_build, _flex_reason, "FlexAttention, compiled"),
    Impl("longattn-dilated", ("dilated",), *_g["auto"],
         note="longattn.dilated_attention, auto (from 8K tokens: FA4, else cuDNN, on strided views; below, "
              "fused Triton)"),
    Impl("longattn-dilated-triton", ("dilated",), *_g["triton"], note="fused Triton dilated kernels"),
    Impl("longattn-dilated-cudnn", ("dilated",), *_g["cudnn"],
         note="longattn.dilated_attention on cuDNN (strided views; auto's blocks without flash-attn-4)"),
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
    Impl("longnet-gather", ("dilated",), lambda c, d: (lambda q, k, v: longnet_gather_dilated(
        q, k, v, c.segment_lengths, c.dilation_rates, c.causal)), lambda c, d: None,
        "LongNet's function the direct way: per branch and offset gather the rows, one SDPA (cuDNN aten op, "
        "for its lse) over all segments, merge by lse; forward only",
        backward_reason="forward-only: the lse of SDPA's aten ops carries no gradient, which LongNet's merge of "
                        "the branches needs"),
    Impl("flex-dilated", ("dilated",), _flex_dilated_build, _flex_reason, "FlexAttention, head-split dilated mask",
         computes=_HEADSPLIT, pair_fraction=lambda c: 1.0 / len(c.segment_lengths)),
    Impl("dense-same-length", ("dilated", "varlen"), lambda c, d: (lambda q, k, v: longattn.attention(
        q, k, v, causal=c.causal)), lambda c, d: ("dense attention above 256K tokens takes minutes per call (its cost grows"
                                           " as S^2: see the 128K row; LONGATTN_BENCH_DENSE_MAX_TOKENS raises the limit)"
                                           if c.seqlen * c.batch > _dense_max_tokens() else None),
        "dense attention at the same length (auto: FA4 where installed, else cuDNN, on CUDA)",
        comparable=False, computes="dense attention at the same length (a cost reference)"),
    Impl("longattn-varlen", ("varlen",), *_varlen("auto"), note="longattn.attention_varlen, backend auto"),
    Impl("longattn-varlen-triton", ("varlen",), *_varlen("triton"), note="attention_varlen, our Triton varlen kernel"),
    Impl("longattn-varlen-flash", ("varlen",), *_varlen("flash"), note="attention_varlen, PyTorch's flash varlen"),
    Impl("longattn-varlen-fa4", ("varlen",), *_varlen("fa4"), note="attention_varlen, FlashAttention-4 varlen (one launch)"),
    Impl("longattn-varlen-cudnn", ("varlen",), *_varlen("cudnn"), note="attention_varlen, one cuDNN call per document"),
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


def _longattn_flex(kernel: str, tuning=None):
    def build(cfg: Config, dev):
        mask = flex_mask(cfg, dev)
        return lambda q, k, v: longattn.flex_attention(q, k, v, mask_mod=mask, kernel=kernel, tuning=tuning)
    return build


def _flex_fa4_reason(cfg: Config, dev) -> Optional[str]:
    """Why FA4 cannot run the config's pattern here (longattn.flex.fa4's refusals, on the config's shapes)."""
    from longattn.flex import fa4

    like = lambda h: types.SimpleNamespace(device=dev, dtype=DTYPES[cfg.dtype], shape=(cfg.batch, cfg.seqlen, h,
                                                                                        cfg.head_dim))
    why = fa4.explain(like(cfg.heads), like(cfg.hkv), like(cfg.hkv), flex_mask(cfg, "cpu"), None)["fa4"]
    return "; ".join(why) or None


def _torch_flex_build(cfg: Config, dev):
    """torch's FlexAttention as its docs use it: the block mask made by a compiled
    create_block_mask (no S x S mask in memory), flex_attention compiled."""
    from torch.nn.attention.flex_attention import flex_attention

    bm = _block_mask(flex_mask(cfg, dev), None, cfg.seqlen, dev)
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = cfg.hkv != cfg.heads
    return lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                                enable_gqa=gqa).transpose(1, 2)


def _cuda_only(what: str):
    return lambda cfg, dev: None if dev.type == "cuda" else f"{what} needs CUDA"


IMPLS.update({i.name: i for i in (
    Impl("longattn-flex", ("flex",), _longattn_flex("flex"),
         lambda c, d: None if d.type == "cuda" or c.seqlen * c.batch <= 4096 else
         "on CPU FlexAttention runs eagerly with dense scores (shapes up to 4K tokens)",
         "longattn.flex_attention, kernel='flex' (compiled FlexAttention on CUDA, block masks cached per pattern)"),
    Impl("longattn-flex-fa4", ("flex",), _longattn_flex("fa4"), _flex_fa4_reason,
         "longattn.flex_attention, kernel='fa4' (FlashAttention-4 with the pattern's CuTe mask and exact block "
         "sparsity; what kernel='auto' runs where FA4 is installed)"),
    Impl("longattn-flex-fa4-graphs", ("flex",),
         _longattn_flex("fa4", longattn.tuning.FlexFa4Tuning(graph_max_tokens=2 ** 40)), _flex_fa4_reason,
         "longattn.flex_attention, kernel='fa4', its passes replayed from CUDA graphs at every length "
         "(FlexFa4Tuning.graph_max_tokens; the shape's first call eager, its second captured)"),
    Impl("torch-flex", ("flex",), _torch_flex_build, _cuda_only("torch's FlexAttention backward (and its compile)"),
         "torch flex_attention, compiled, create_block_mask compiled"),
    Impl("dense-cudnn", ("flex",), _b["cudnn"][0], _cuda_only("SDPA cuDNN"),
         "dense attention (SDPA cuDNN) at the same length: what the pattern saves",
         comparable=False, computes="dense attention at the same length (a cost reference)"),
)})

