"""Named benchmark configurations (a registry of frozen dataclasses)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

LONGNET_SEGMENTS = (2048, 4096, 8192, 16384, 32768)
LONGNET_RATES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark problem."""

    name: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    kv_heads: Optional[int] = None
    """kv heads for GQA/MQA; None means equal to heads."""
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    """sliding window (left, right); -1 unbounded."""
    dtype: str = "bf16"
    """bf16, fp16 or fp32 (CPU runs switch bf16 to fp32)."""
    segment_lengths: Optional[tuple[int, ...]] = None
    """set for dilated-attention configs."""
    dilation_rates: Optional[tuple[int, ...]] = None
    doc_lengths: Optional[tuple[int, ...]] = None
    """set for packed variable-length configs: the document length pattern, repeated to fill batch*seqlen."""
    note: str = ""

    def __post_init__(self):
        if min(self.batch, self.seqlen, self.heads, self.head_dim) <= 0:
            raise ValueError(f"config {self.name}: sizes must be positive")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"config {self.name}: heads {self.heads} not a multiple of kv_heads {self.kv_heads}")
        if (self.segment_lengths is None) != (self.dilation_rates is None):
            raise ValueError(f"config {self.name}: segment_lengths and dilation_rates go together")
        if self.dtype not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"config {self.name}: dtype must be bf16, fp16 or fp32")

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kind(self) -> str:
        if self.segment_lengths is not None:
            return "dilated"
        if self.doc_lengths is not None:
            return "varlen"
        return "dense"

    def with_overrides(self, **kw) -> "Config":
        kw = {k: v for k, v in kw.items() if v is not None}
        if not kw:
            return self
        if "pattern_args" in kw and not isinstance(self, FlexConfig):
            raise ValueError(f"pattern_args (--pattern-args) applies to flex configs only; {self.name} is a "
                             f"{self.kind} config")
        return dataclasses.replace(self, **kw)

    def describe(self) -> str:
        s = f"B={self.batch} S={self.seqlen} H={self.heads}"
        if self.hkv != self.heads:
            s += f"/{self.hkv}kv"
        s += f" D={self.head_dim} {'causal' if self.causal else 'full'} {self.dtype}"
        if self.window != (-1, -1):
            s += f" window={self.window}"
        if self.kind == "dilated":
            s += f" w={list(self.segment_lengths)} r={list(self.dilation_rates)}"
        if self.kind == "varlen":
            s += f" docs={list(self.doc_lengths)}"
        return s


CONFIGS: dict[str, Config] = {}


def _add(c: Config) -> None:
    CONFIGS[c.name] = c


for _c in (
    Config("tiny", 2, 1024, 8, 64, note="default on CPU"),
    Config("small", 4, 4096, 12, 128),
    Config("medium", 4, 8192, 24, 128),
    Config("large", 4, 16384, 32, 128),
    Config("large_seq", 4, 32768, 24, 128),
    Config("xlarge", 8, 32768, 32, 128),
    Config("hd256", 2, 8192, 16, 256, note="head dim 256"),
    Config("many_heads", 2, 8192, 64, 64, note="many small heads"),
    Config("window_small", 4, 4096, 12, 128, causal=True, window=(512, 0)),
    Config("window_medium", 4, 8192, 24, 128, causal=True, window=(512, 0)),
    Config("window_large_seq", 2, 32768, 16, 128, causal=True, window=(512, 0)),
    Config("gqa_llama70b", 1, 16384, 64, 128, kv_heads=8, causal=True, note="Llama-3-70B: 64q/8kv d128"),
    Config("gqa_llama8b", 1, 32768, 32, 128, kv_heads=8, causal=True, note="Llama-3-8B: 32q/8kv d128"),
    Config("gqa_32q4kv_d64", 2, 16384, 32, 64, kv_heads=4, causal=True, note="32q/4kv d64 (e.g. Qwen2-1.5B-like)"),
    Config("mqa", 2, 16384, 32, 128, kv_heads=1, causal=True),
    Config("dense_32k", 1, 32768, 16, 128, note="anchor shape"),
    Config("dense_32k_causal", 1, 32768, 16, 128, causal=True),
    Config("dense_32k_d64", 1, 32768, 16, 64, note="head dim 64"),
    Config("dense_32k_d64_causal", 1, 32768, 16, 64, causal=True, note="head dim 64"),
    Config("dense_128k", 1, 131072, 16, 128),
    Config("dense_128k_causal", 1, 131072, 16, 128, causal=True),
    Config("gqa_32q8kv_32k", 1, 32768, 32, 128, kv_heads=8, note="context-parallel GQA shape"),
    Config("gqa_32q8kv_32k_causal", 1, 32768, 32, 128, kv_heads=8, causal=True),
    Config("gqa_32q8kv_128k", 1, 131072, 32, 128, kv_heads=8),
    Config("gqa_32q8kv_128k_causal", 1, 131072, 32, 128, kv_heads=8, causal=True),
):
    _add(_c)

for _s, _tag in ((8192, "8k"), (32768, "32k"), (131072, "128k"), (1 << 20, "1m"), (1 << 22, "4m")):
    for _d in (128, 64):
        for _causal in (False, True):
            _add(Config(f"longnet_{_tag}{'_d64' if _d == 64 else ''}{'_causal' if _causal else ''}", 1, _s, 16, _d,
                        causal=_causal, segment_lengths=LONGNET_SEGMENTS, dilation_rates=LONGNET_RATES,
                        note="LongNet segments 2K..32K, rates 1..16"))
_add(Config("dilated_tiny", 1, 2048, 8, 64, segment_lengths=(256, 512, 1024), dilation_rates=(1, 2, 4),
            note="default on CPU"))
for _s, _tag in ((32768, "32k"), (131072, "128k"), (1 << 20, "1m")):
    for _causal in (False, True):
        _add(Config(f"longnet_gqa_{_tag}{'_causal' if _causal else ''}", 1, _s, 32, 128, kv_heads=8,
                    causal=_causal, segment_lengths=LONGNET_SEGMENTS, dilation_rates=LONGNET_RATES,
                    note="LongNet, GQA 32q/8kv"))
for _s, _tag in ((32768, "32k"), (131072, "128k")):
    for _causal in (False, True):
        _add(Config(f"dilated_short_{_tag}{'_causal' if _causal else ''}", 1, _s, 16, 128, causal=_causal,
                    segment_lengths=(256, 512, 1024), dilation_rates=(1, 2, 4),
                    note="short segments 256..1K, rates 1..4 (256 rows per class)"))
_add(Config("varlen_tiny", 1, 2048, 8, 64, causal=True, doc_lengths=(512, 128, 1024, 64, 320)))
_add(Config("varlen_mix_32k", 1, 32768, 16, 128, causal=True,
            doc_lengths=(8192, 512, 2048, 128, 4096, 1024, 256, 16384 - 128),
            note="document-length mix, long and short"))
_add(Config("varlen_chat_16k", 1, 16384, 32, 128, kv_heads=8, causal=True, doc_lengths=(300, 900, 1500, 2400, 700),
            note="short chat-like documents"))


def get(name: str) -> Config:
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; `python -m longattn.bench list` shows them")
    return CONFIGS[name]


# ------------------------------------------------------------------ attention patterns (FlexAttention masks)
@dataclasses.dataclass(frozen=True)
class FlexConfig(Config):
    """A config whose pattern is a :mod:`longattn.masks` mask (kind "flex"),
    built by ``impls.flex_mask``: ``pattern`` names it, ``pattern_args`` are
    its parameters (fractions of the seqlen where the pattern scales with it)."""

    pattern: str = "local_global"
    pattern_args: tuple = ()

    def __post_init__(self):
        super().__post_init__()
        if self.pattern not in FLEX_PATTERNS:
            raise ValueError(f"config {self.name}: pattern must be one of {FLEX_PATTERNS}")

    @property
    def kind(self) -> str:
        return "flex"

    def describe(self) -> str:
        # "full" would misname a masked pattern; "causal" stays (the mask is then and-ed with causal)
        return super().describe().replace(" full ", " ") + f" mask={self.pattern}{list(self.pattern_args)}"


FLEX_PATTERNS = ("local_global", "causal_document", "prefix_lm", "block_sparse")
"""local_global (window, global tokens): Longformer/BigBird band + global tokens;
causal_document (doc lengths...): causal packed documents, the lengths repeated
to fill the sequence; prefix_lm (prefix fraction,); block_sparse (block, band,
density, seed): BigBird-like layout (a band of blocks, the first block row and
column, random blocks)."""

for _s, _tag in ((1024, "tiny"), (32768, "32k"), (131072, "128k")):
    _big = _s > 1024
    _shape = dict(batch=1, seqlen=_s, heads=16 if _big else 4, head_dim=128 if _big else 64)
    _add(FlexConfig(f"flex_swg_{_tag}", **_shape, pattern="local_global",
                    pattern_args=(1024, 128) if _big else (64, 16),
                    note="sliding window +-w and global tokens (Longformer/BigBird)"))
    _add(FlexConfig(f"flex_doc_{_tag}", **_shape, pattern="causal_document",
                    pattern_args=(8192, 512, 2048, 128, 4096, 1024, 256, 16256) if _big else (300, 60, 500, 164),
                    note="causal packed documents (lengths repeated to fill the sequence)"))
    _add(FlexConfig(f"flex_prefix_{_tag}", **_shape, pattern="prefix_lm", pattern_args=(0.25,),
                    note="prefix-LM: bidirectional first quarter, causal rest"))
    _add(FlexConfig(f"flex_bsparse_{_tag}", **_shape, pattern="block_sparse",
                    pattern_args=(128, 1, 0.02, 0) if _big else (64, 1, 0.1, 0),
                    note="block-sparse layout: band of blocks, first block row/column, random blocks"))
