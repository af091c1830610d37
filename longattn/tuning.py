"""Measured thresholds behind longattn's automatic choices, one frozen object per concern.

Every field that steers a choice carries the measurement it came from: its
``reason`` and the result file under ``benchmarks/results/`` (see
:func:`describe`). The choices themselves are made in one function per op
(``longattn.dilated.plan.choose``, ``longattn.backends.varlen.choose``,
``longattn.distributed.plan.worth_fusing``), once per call, from these values
and the backends' capabilities; forward and backward follow the same plan.

Callers that need other values (benchmarks, tests, a user on other hardware)
pass their own object, e.g.
``dilated_attention(..., tuning=DilatedTuning(gather_max_rows=0))``; nothing
reads thresholds from globals or the environment.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["DilatedTuning", "VarlenTuning", "RingVarlenTuning", "DecodeTuning", "DocShardTuning", "FlexExchangeTuning",
           "Fa4Tuning", "DILATED", "VARLEN", "RING_VARLEN", "DECODE", "DOC_SHARD", "FLEX_EXCHANGE", "FA4", "describe"]

DILATED_SCHEDULES = ("auto", "views", "grouped", "dedup", "per_branch", "per_branch_zero_fill", "gather")


def measured(value: Any, reason: str, source: str = "") -> Any:
    """A dataclass field holding a measured value, its reason and its result file."""
    return dataclasses.field(default=value, metadata={"reason": reason, "source": source})


@dataclasses.dataclass(frozen=True)
class DilatedTuning:
    """Which engine runs a single-device dilated call, and how the views path cuts it.

    Engines: ``views`` (a local backend, cuDNN on CUDA, on strided views of
    q/k/v: no copies), ``fused`` (our Triton kernels: grouped or per-branch
    launches), ``gather`` (parts copied into dense blocks; GQA whose rates and
    group size do not divide)."""

    views_min_tokens: int = measured(
        8192, "MHA, and GQA whose rates and group size divide each other: cuDNN on the views (graphed below "
              "graph_max_tokens / _d64 / _gqa) beats the fused kernels from 8K tokens, both passes (x dense fwd / "
              "bwd, cold). D=128 (one H100): 8K 0.64 / 0.63 against 0.46 / 0.33, causal 0.47 / 0.53 against 0.33 / "
              "0.16; 16K 0.63 / 0.70 against 0.46 / 0.41; one H200 from 32K: views/fused time fwd 0.72x at 32K, "
              "0.66x at 128K, 0.73x at 1M, bwd 0.69x, 0.67x, 0.64x. D=64 (one H200): 8K 0.75 / 0.58 graphed "
              "against 0.56 / 0.26, causal 0.51 / 0.42 against 0.46 / 0.23; 32K 0.71 / 0.79 against 0.69 / 0.40, "
              "causal 0.57 / 0.57 against 0.44 / 0.30; 64K 0.79 / 0.82 eager against 0.68 / 0.44. GQA 32q/8kv "
              "(one H200): 8K 0.62 / 0.75 against 0.55 / 0.49, causal 0.48 / 0.54 against 0.41 / 0.34; 16K 0.67 / "
              "0.82 against 0.48 / 0.55, causal 0.52 / 0.59 against 0.39 / 0.37; one H100, fwd / bwd ms: 32K 4.22 / "
              "13.68 against 5.36 / 19.35, 128K 15.07 / 49.81 against 20.91 / 72.64, 1M 131 / 412 against 167 / "
              "606. Below 8K not measured",
        "dilated_short_seq_h100_5ebe4f0.json, run_dilated_d128_h200_6fbc591.json, "
        "dilated_short_seq_d64_h200_2cf2fd6.json, dilated_short_seq_gqa_h200_2cf2fd6.json, "
        "run_dilated_gqa_h100_0aa75dc.json")
    grouped_max_keys: int = measured(
        512, "keys per segment class (w / r) up to which the fused passes run grouped where branches nest: "
             "segments 256-1K grouped vs per-branch fwd / bwd 0.79 / 2.05 vs 0.94 / 3.08 ms; LongNet's 2048-key "
             "classes lose (32K causal fwd 3.37 vs 1.91 ms), a grouped block spanning the whole segment",
        "triton_grouped_ab_h100_00acb45.json")
    dedup_max_head_dim: int = measured(
        64, "fused per-branch launches compute every pair of the union once (schedule 'dedup', LongNet: 76% of "
            "the pairs) up to this head dim; the multiplicity weights cost an extra multiply per score. One H200, "
            "static tiles, fwd+bwd ms dedup / per-branch: D=64 8K 2.71 / 3.08, 8K causal 2.12 / 2.74, 16K 4.52 / "
            "4.67, 32K 8.47 / 8.56, 32K causal 5.60 / 6.33, 128K 32.3 / 32.2, 128K causal 20.2 / 22.5; D=128 8K "
            "3.96 / 3.88, 32K 16.4 / 13.5, 32K causal 10.7 / 9.5, 128K 62.8 / 50.5, 128K causal 40.2 / 34.5 (the "
            "D=128 forward alone is faster deduplicated, 2-15%, its backward 4-33% slower)",
        "dedup_ab_d64_h200_0b53d4c.json, dedup_ab_d128_h200_0b53d4c.json, dedup_ab_short_d64_h200_0b53d4c.json, "
        "dedup_ab_short_d128_h200_0b53d4c.json")
    grouped_backward_noncausal: bool = measured(
        True, "the non-causal backward of short nested classes runs grouped even where the views run the "
              "forward: 2.06 / 6.92 ms at 32K / 128K against the views' 3.64 / 8.83; causal 128K 8.35 against "
              "7.96, so the causal backward stays on the views", "run_dilated_short_h100_aca95a7.json")
    gather_max_rows: int = measured(
        128 * 2048, "a branch of at most this many (row, head) pairs (S * H / r) whose classes do not stack "
                    "into one view runs as one call on gathered copies: at 32K a call's host time (100-300 us) "
                    "outweighs copying 1/r of q, k, v; gathering rate 4 at 128K too cost more in copies "
                    "(32K causal fwd 1.78 vs 2.23 ms). GQA branches (whose classes never stack as views) under the "
                    "same bound, in passes not replayed from graphs (gather_graphed): LongNet 32q/8kv at 128K, "
                    "31 -> 16 calls per pass, one H100 on cuDNN, alternating: causal fwd 10.02 vs 10.07 ms (host "
                    "4.27 vs 5.86), bwd 33.14 vs 33.34 (host 10.19 vs 12.28); non-causal fwd 15.79 vs 16.02 (host "
                    "6.38 vs 10.39); out, dK, dV bit-identical. On FA4 (python benchmarks/dilated_gather_ab.py "
                    "--heads 32 --kv-heads 8 --seqlens 131072) the GPU time ties and the host's drops: one H100 "
                    "causal fwd 10.32 vs 13.48 ms (host 8.72 vs 13.39), bwd 30.58 vs 30.60 (12.67 vs 19.68); one "
                    "H200 causal fwd 10.02 vs 10.16 (4.09 vs 6.44), bwd 28.53 vs 28.93 (6.15 vs 9.69), non-causal "
                    "bwd 44.17 vs 44.45",
        "dilated_gather_ab_h200_d28c735.json, dilated_gather_ab_gqa_h100_cb382ff.json, "
        "dilated_gather_ab_gqa_fa4_h100_926d70c.json, dilated_gather_gqa_h200_7884a90.json")
    gather_graphed: bool = measured(
        False, "gather small branches inside passes replayed from CUDA graphs too: there the host time they save "
               "is already gone and their copies remain. One H200 on FA4, LongNet MHA (16 heads, D=128), "
               "gathered vs one call per class, alternating, graphed passes: 8K causal fwd 0.526 vs 0.503 ms, bwd "
               "1.164 vs 1.121; 16K causal 0.918 vs 0.860, 2.121 vs 2.028; 32K causal 1.787 vs 1.645, 4.072 vs "
               "3.829; non-causal fwd 8K 0.693 vs 0.682, 16K 1.239 vs 1.177 (python benchmarks/"
               "dilated_gather_ab.py --graphed --seqlens 8192 16384 32768; the file's run, at 0a3c91b, gathered "
               "MHA in graphed passes without the flag; the same run's eager 32K non-causal forward, host-bound, "
               "gathered 2.427 vs 2.952: gather_max_rows); again at 5edc28f, six rounds: 8K causal 0.566 vs 0.550, "
               "1.176 vs 1.104; 16K causal 0.931 vs 0.859, 2.213 vs 2.118; 32K causal 1.812 vs 1.675, 4.118 vs "
               "3.933. GQA 32q/8kv at 32K (graphed), one H100 on "
               "cuDNN: causal fwd 3.37 vs 3.21 ms, bwd 9.51 vs 9.16; non-causal fwd 4.78 vs 4.62",
        "dilated_gather_ab_h200_0a3c91b.json, dilated_gather_ab_graphed_h200_5edc28f.json, "
        "dilated_gather_ab_gqa_h100_cb382ff.json")
    gather_noncausal_backward: bool = measured(
        False, "the non-causal backward is GPU-bound: gathered 6.59 vs 6.35 ms at 32K, 24.52 vs 24.42 at 128K",
        "dilated_gather_ab_h200_d28c735.json")
    adopt_bwd_max_elems: int = measured(
        2 ** 29, "the backward takes the base branch's gradients whole up to this many elements: cuDNN keeps dQ "
                 "in a float32 buffer of the call's size (2 GiB at 2**29); at 1M tokens the whole call was 5% "
                 "faster and 7 GiB more peak", "adopt_1m_h200_probe.json")
    graph_max_tokens: int = measured(
        16384, "MHA, D > 64, non-causal, cuDNN running the views' blocks (FA4: graph_max_tokens_fa4): up to this "
               "many tokens (batch x seqlen) each views pass replays a CUDA graph captured per shape (LongNet, "
               "D=128, one H100, x dense cuDNN fwd / bwd, cold): 8K 0.64 / 0.63 graphed against "
               "0.22 / 0.26 eager (2.0 ms of forward host time), causal 0.47 / 0.53 against 0.11 / 0.16; 16K 0.63 "
               "/ 0.70 against 0.54 / 0.45; at 32K the eager views win (0.72 / 0.77 against 0.62 / 0.74: the "
               "input and output copies cost more than the host time they hide; one H200: 0.75 / 0.77 against "
               "0.63 / 0.82, causal 0.53 / 0.48 against 0.52 / 0.51)",
        "dilated_short_seq_h100_5ebe4f0.json, dilated_short_seq_gqa_h200_2cf2fd6.json")
    graph_max_tokens_fa4: int = measured(
        32768, "MHA, D > 64, non-causal, FA4 running the views' blocks: FA4's Python makes each call's host time "
               "about twice cuDNN's (LongNet 32K forward, 2.66 ms of host time a call against cuDNN's 1.32: "
               "run_dilated_targets_h200_8a6c230.json, run_dilated_targets_h200_04ee473.json), past its GPU time "
               "(about 2.1 ms), so graphs pay up to 32K there. One H200, 32K, views graphed against eager, three "
               "alternating rounds, cold: fwd+bwd 7.57 / 7.72 / 7.74 ms against 7.95 / 8.19 / 8.06, fwd 2.17-2.19 "
               "against 2.21-2.31; causal (graphed in both arms, a control) 5.10-5.13 against 5.12-5.14 (python "
               "benchmarks/dilated_short_seq.py --seqlens 32768 --variants auto views_graphs --rounds 3 "
               "--cold-only --iters 10). Back to back not measured: eagerly the host (2.66 ms) stays behind the GPU",
        "dilated_graphs_32k_fa4_h200_5c17a0f.json, run_dilated_targets_h200_8a6c230.json, "
        "run_dilated_targets_h200_04ee473.json")
    graph_max_tokens_causal: int = measured(
        32768, "MHA, D > 64, causal: a causal pass launches as many kernels as a non-causal one for half the GPU "
               "work, so graphs pay further. One H200, views graphed against eager, two alternating rounds, x dense "
               "fwd / bwd, cold: 32K causal 0.49 / 0.58 and 0.50 / 0.59 against 0.56 / 0.47, 0.36 / 0.54 (the same "
               "engine as the default: 0.40 / 0.48, 0.33 / 0.50), host share 20-23% against 90-110%; non-causal "
               "32K a tie on the GPU (0.67 / 0.79, 0.72 / 0.79 against 0.63-0.77 / 0.73-0.84) and eager ahead "
               "with the host running ahead (batched fwd 0.67-0.73 against 0.75-0.81), so graph_max_tokens stays. "
               "Earlier H200 runs agree on the causal backward (0.51 against 0.48; 0.59 against 0.52)",
        "dilated_short_seq_32k_rounds_h200_b0f2978.json, dilated_short_seq_d128_32k_h200_de8faef.json")
    graph_max_tokens_d64: int = measured(
        32768, "MHA, D <= 64: half the FLOPs and half the bytes to copy per token, so graphs pay further: graphed "
               "against eager views (one H200, x dense fwd / bwd, cold) 16K 0.65 / 0.74 against 0.43 / 0.46; 32K "
               "0.71 / 0.79 against 0.56 / 0.68, causal 0.57 / 0.57 against 0.29 / 0.42; at 64K eager wins (0.79 / "
               "0.82 against 0.75 / 0.79, causal 0.63 / 0.62 against 0.61 / 0.59)",
        "dilated_short_seq_d64_h200_2cf2fd6.json")
    graph_max_tokens_gqa: int = measured(
        32768, "GQA: graphed views at 32K 0.69 / 0.79 x dense against 0.47 / 0.60 eager, causal 0.56 / 0.55 "
               "against 0.34 / 0.42 (64K not measured), measured with every class its own call (31 per pass, as "
               "graphed passes still run: gather_graphed)", "dilated_short_seq_h100_5ebe4f0.json")
    concurrent_calls: str = measured(
        "graphs", "when the views path launches its calls on side streams at once: 'graphs' (inside the "
                  "captured passes only), 'always', 'never'. Graphed, concurrent against in order: 8K causal "
                  "0.47 / 0.53 against 0.41 / 0.46 x dense, 16K causal 0.50 / 0.46 against 0.47 / 0.41, GQA 32K "
                  "causal 0.56 / 0.55 against 0.46 / 0.47; eager the extra host time loses (8K causal forward "
                  "host 8.1 against 4.2 ms)", "dilated_short_seq_h100_5ebe4f0.json")
    piece_bytes: int = measured(
        128 << 20, "a views call is cut into pieces of at most this many output bytes so its transient tensors "
                   "stay small beside the (B, S, H, D) result (a memory bound, not a speed choice)")
    schedule: str = measured(
        "auto", "force one engine for A/B measurements and tests: 'views', 'gather', or a fused schedule "
                "('grouped' wherever branches nest, 'dedup' wherever they form a chain, 'per_branch', "
                "'per_branch_zero_fill'); 'auto' decides")
    autotune: str = measured(
        "", "tiles of the fused kernels: '1' autotuned per shape, '0' the built-in table, '' as "
            "LONGATTN_TRITON_AUTOTUNE says (unset: autotuned on CUDA)")

    def __post_init__(self):
        if self.schedule not in DILATED_SCHEDULES:
            raise ValueError(f"DilatedTuning.schedule={self.schedule!r}: choose one of {DILATED_SCHEDULES}")
        if self.concurrent_calls not in ("graphs", "always", "never"):
            raise ValueError(f"DilatedTuning.concurrent_calls={self.concurrent_calls!r}: choose 'graphs', 'always' "
                             "or 'never'")
        if self.autotune not in ("", "0", "1"):
            raise ValueError(f"DilatedTuning.autotune={self.autotune!r}: choose '1', '0' or '' (the environment's)")
        for f in ("gather_noncausal_backward", "gather_graphed"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"DilatedTuning.{f} must be a bool, got {getattr(self, f)!r}")
        for f in ("views_min_tokens", "grouped_max_keys", "dedup_max_head_dim", "gather_max_rows",
                  "adopt_bwd_max_elems", "piece_bytes", "graph_max_tokens", "graph_max_tokens_fa4",
                  "graph_max_tokens_causal", "graph_max_tokens_d64", "graph_max_tokens_gqa"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                raise ValueError(f"DilatedTuning.{f} must be a non-negative int, got {getattr(self, f)!r}")

    def graphs(self, tokens: int, mha: bool, head_dim: int, causal: bool = False, fa4: bool = False) -> bool:
        """Whether a views call of ``tokens`` (batch x seqlen) replays its passes from CUDA graphs (``fa4``:
        FlashAttention-4 runs its blocks)."""
        if not mha:
            return tokens <= self.graph_max_tokens_gqa
        if head_dim <= 64:
            return tokens <= self.graph_max_tokens_d64
        if causal:
            return tokens <= self.graph_max_tokens_causal
        return tokens <= (self.graph_max_tokens_fa4 if fa4 else self.graph_max_tokens)

    def graphs_up_to(self, tokens: int) -> "DilatedTuning":
        """This tuning with every graph threshold (MHA, causal, D <= 64, GQA) set
        to ``tokens``: 0 never graphs, a huge value always does (A/B runs, tests)."""
        return dataclasses.replace(self, graph_max_tokens=tokens, graph_max_tokens_fa4=tokens,
                                   graph_max_tokens_causal=tokens, graph_max_tokens_d64=tokens,
                                   graph_max_tokens_gqa=tokens)

    def concurrent(self, graphs: bool) -> bool:
        """Whether the views path launches its calls on side streams at once."""
        return self.concurrent_calls == "always" or (graphs and self.concurrent_calls == "graphs")


@dataclasses.dataclass(frozen=True)
class VarlenTuning:
    """Which kernel runs ``attention_varlen`` on CUDA."""

    loop_min_mean_tokens: int = measured(
        3072, "documents of at least this mean length run as one cuDNN call each, shorter ones through "
              "FlashAttention-2's varlen kernel: mean 3641 tokens (varlen_mix_32k) per-document cuDNN 2.95 / 7.75 ms "
              "fwd / bwd vs flash varlen 4.55 / 12.55; mean 1170 (varlen_chat_16k) 1.94 / 6.49 vs 1.04 / 2.74; "
              "the crossing between the two means is not measured (the transformers training benchmark's 2048-token "
              "documents ran on flash varlen)", "run_varlen_h200_e12dbda.json")


@dataclasses.dataclass(frozen=True)
class RingVarlenTuning:
    """Cost model that decides whether a packed-document ring step runs its
    document blocks as one varlen launch or one backend call each. Measured
    with FlashAttention-2's varlen launch against cuDNN calls; where FA4 runs,
    both sides are FA4's (varlen and dense) and the model is pending
    measurement there (``python -m longattn.bench dist`` varlen rows)."""

    call_seconds: float = measured(
        2e-4, "host time of one backend call with its merge", "dist_varlen_2xh200_7284f9f.json")
    call_flops: float = measured(
        500e12, "FLOP/s of a per-block cuDNN call", "dist_varlen_2xh200_7284f9f.json")
    fused_flops: float = measured(
        260e12, "FLOP/s of a fused varlen launch on these blocks (113 short documents: 3-10x faster fused)",
        "dist_varlen_2xh200_7284f9f.json")


@dataclasses.dataclass(frozen=True)
class DocShardTuning:
    """Document-aware sharding of packed batches (:func:`longattn.shard_documents`)."""

    imbalance: float = measured(
        0.1, "a rank may take this much more than the mean tokens and causal work before a document is split "
             "instead (its K/V then travel): at 0.1, varlen_mix_32k / varlen_chat_16k at 128K and 512K over 2 and 4 "
             "ranks split nothing, the work per rank within 0.2% of the mean (tokens at most 4.1% above), fwd+bwd 0.85-0.98 "
             "of one GPU; batches whose documents must split are not measured", "dist_docs128k_4xh100_e714914.json")


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """How ``decode_attention`` (and :class:`longattn.KVCache`) runs under
    ``backend="auto"`` on CUDA: FA4's split-KV forward from ``fa4_min_keys``
    keys on; the split-KV Triton kernel (:mod:`longattn.kernels.decode`) for
    decode-sized calls over rows of different lengths (one launch for the
    batch) and under CUDA graph capture; rows of one length as
    ``split_kv_equal_rows`` says; else a dense backend on views of the cache.
    And the split kernel's tiles."""

    auto_excludes: tuple = measured(
        ("cudnn", "fa4"), "a decode step's key length changes every call, and our cuDNN call on (B, S, H, D) views "
                    "of the cache paid for it: one query over 128K cached tokens took 39.3 ms through cuDNN against "
                    "0.30 ms through flash (one H100); SDPA's cuDNN call over a growing (B, H, S, D) cache pays it in a "
                    "loop of steps too (38.7 / 59.5 ms per step at 128K / 1M, one H200, "
                    "decode_batched_h200_52770af.json; one isolated step 0.25 / 1.14, decode_h200_52770af.json, "
                    "not profiled why). fa4: as a dense backend its calls run "
                    "one KV split per (batch, kv head), a few programs over the whole cache; FA4 with splits is "
                    "the fa4 engine (fa4_min_keys)",
        "decode_1xh100_38fed5d.json, decode_batched_h200_52770af.json, decode_h200_52770af.json")
    fa4_min_keys: Optional[int] = measured(
        None, "FA4's split-KV forward (one launch for the batch, its own split count from the SM count, the "
              "query heads of a kv head in one tile; longattn.decode.engine's \"fa4\" engine) exists on sm_100 "
              "only (fa4_refusals); on sm_90 backend=\"fa4\" runs unsplit on views of the cache: 1.41 / 10.9 ms "
              "per token at 128K / 1M against 0.162 / 0.993 for the split-KV Triton kernel (one H200, python -m "
              "longattn.bench decode --timing batched). sm_100 is not measured. None: auto never takes it; a key "
              "count: auto takes it from that many keys on", "decode_batched_h200_52770af.json")
    fa4_num_splits: int = measured(
        0, "KV splits per (batch, kv head) of the fa4 engine; 0: FA4's heuristic (SMs / (batch x kv heads), at "
           "most 128 and the key tiles). Not measured: the fa4 engine runs on sm_100 only (fa4_min_keys), and the GPUs "
           "measured here are sm_90 (H100, H200)", "")
    split_kv_equal_rows: bool = measured(
        False, "rows of one length: the flash kernel on views is one aten launch, the split-KV kernel two Triton "
               "launches whose host time an eager step pays; one H100, one cold step (append + attend) at 128K: "
               "0.248 ms flash vs 0.262 split-KV (B=1), 1.417 vs 1.455 (B=8); equal within 1% at 1M",
        "decode_split_kv_b1_h100_3020618.json")
    graph_steps: bool = measured(
        True, "an eager step is host-bound at 128K (two copies, the checks, the launches: ~0.1-0.2 ms against "
              "0.14 ms of GPU work); KVCache's steps replayed from graphs, one H200, cold, 128K: 0.208 ms "
              "against 0.234 for the eager flash step (SDPA 0.186 cuDNN, 0.206 flash); 1M 1.090 vs 1.143",
        "decode_1xh200_ea260f1.json")
    split_kv_max_rows: int = measured(
        64, "query rows per kv head (q_len * nheads // nheads_kv) one split program holds in registers; "
            "longer calls are prefill-sized and the dense kernels take them", "")
    block_n: int = measured(
        64, "tiles swept (block_n 32/64/128 x warps 4/8 x stages 2/3/4 x programs per SM 1/2/4), kernel time from "
            "CUDA-graph replays; block 64, 4 warps, 2 stages is within 3% of the best tile in every case at its "
            "best programs per SM (128K B=1 and B=8, 1M, head dim 64: 2.9-3.1 TB/s at D=128); the best per case "
            "lost up to 18% elsewhere",
        "decode_split_kv_b1_h100_3020618.json")
    num_warps: int = measured(4, "see block_n", "decode_split_kv_b8_h100_3020618.json")
    num_stages: int = measured(2, "see block_n", "decode_split_kv_d64_h100_3020618.json")
    h200_num_stages: int = measured(
        3, "pipeline stages of the split kernel on an H200 (HBM3e: more bytes in flight pay), head dim 65-128, "
           "bf16/fp16 caches (the shapes swept; others keep num_stages): the "
           "same sweep on one H200 (block_n 64/128 x warps 4/8 x stages 2/3/4 x programs per SM 2/4/8, B=1): "
           "64/4/3/2 is the best tile at 1M (0.964 ms, 4457 GB/s) and within 0.5% of it at 128K (0.1371 against "
           "0.1365 for 128/4/2/2), where 64/4/2/2 takes 0.1488 and 1.043 ms (8-9% slower). On H100 the third "
           "stage tied at B=1 and lost 4-5% at B=8 and head dim 64, so it stays there; B=8 on H200 not swept",
        "decode_split_kv_h200_7884a90.json")
    h200_block_n: int = measured(
        128, "keys per tile of the split kernel on an H200 where h200_num_stages applies, with h200_heads_fastest: "
             "one H200, B=1, 32 query / 8 kv heads, 3 stages, 4 warps, 2 programs per SM, kernel time from graph "
             "replays, 128 heads first against 64 (pointer loads) 129.7 / 131.7 us at 128K, 248.1 / 248.4 at 256K, "
             "481.5 / 482.7 at 512K, 948.4 / 956.4 at 1M (4529 GB/s), 1881.9 / 1900.2 at 2M; with descriptor loads "
             "128.9 / 131.4 at 128K. 128 in the splits' order loses (962 / 1905 us at 1M / 2M). A step back to back "
             "at 1M 0.953 ms against 0.964 with 64 and 0.957 for SDPA cuDNN, 2M 1.885 / 1.907 / 1.899 (the same "
             "runs). A wider sweep at 1M (block 64/128 x warps 4/8 x stages 3/4 x 1/2/3 programs per SM x both "
             "orders x both loads, the host's other GPUs busy) printed the same best tile at 0.948 ms; its JSON did "
             "not come back. B=8 not swept",
        "decode_split_kv_tile_h200_e816f3e.json, decode_split_kv_tile_ctx_h200_e816f3e.json")
    h200_heads_fastest: bool = measured(
        True, "launch order of the split programs on an H200 where h200_num_stages applies: see h200_block_n",
        "decode_split_kv_tile_h200_e816f3e.json")
    programs_per_sm: int = measured(
        2, "programs per SM of the split kernel (the cache's splits fill the device this deep), head dim > 64: "
           "block 64/4/2, kernel time from graph replays, one H100, 2 against 4 per SM: 128K B=1 0.184 / 0.190 "
           "ms (2916 / 2827 GB/s), 0.180 / 0.185 in an earlier sweep, 0.191 / 0.204 with the merge in the launch; 1M "
           "1.352 / 1.359, 1.389 / 1.407; 128K B=8 1.359 / 1.400",
        "decode_sweep_128k_h100_391761d.json, decode_order_h100_55957b6.json, decode_split_kv_b1_h100_3020618.json, "
        "decode_split_kv_b8_h100_3020618.json")
    programs_per_sm_d64: int = measured(
        4, "programs per SM at head dim <= 64 (half the bytes per key: shorter splits pay): 128K B=1 0.097 ms at "
           "4 against 0.112 at 2, 0.173 at 1", "decode_split_kv_d64_h100_3020618.json")
    heads_fastest: bool = measured(
        False, "launch order of the split programs: True puts the kv heads of one token range next to each other "
               "(adjacent bytes of the cache's rows), False one head's splits. A tie (one H100, kernel time from "
               "graph replays, 2 per SM): 128K 0.1904 / 0.1910 ms, 1M 1.3907 / 1.3894; the cache is read at "
               "2.8-3.1 TB/s either way", "decode_order_h100_55957b6.json")
    descriptor_loads: str = measured(
        "replayed", "where the split kernel reads K and V through tensor descriptors (TMA) instead of pointers, "
                    "on an H200 at the shapes the tiles were swept for (as h200_num_stages; elsewhere pointers, "
                    "not measured): \"replayed\" in KVCache's steps replayed from CUDA graphs (their first, eager "
                    "call compiles the same kernel), \"always\", or \"never\". One H200, the default tile "
                    "64/4/3/2 (python benchmarks/decode_split_kv.py --block-n 64 128 --warps 4 8 --stages 3 4 "
                    "--programs-per-sm 2 4 --heads-fastest 0 --descriptors 0 1): kernel time from graph replays "
                    "128K 134.0 against 138.0 us (-2.9%), 1M 957.9 against 959.9 (a tie); the best tile of each "
                    "kind at 128K 132.9 (128/4/3/2) against 137.2. An eager launch pays the descriptors' encoding "
                    "on the host: one eager step at 1M, cold, 1.127 ms against 1.072 (host 0.150 against 0.113), "
                    "back to back 0.987 against 0.986; hence replayed steps only, where the host work is done at "
                    "capture. cuDNN's decode kernel on the same machine: 122.7 us + 2.9 for its reduction at 128K, "
                    "946.2 + 3.0 at 1M (decode_step_profile_h200_4014518.json)",
        "decode_split_kv_tma_h200_4014518.json, decode_step_profile_h200_4014518.json")
    merge_floats_per_thread: int = measured(
        128, "float32 of the splits' partial outputs each thread of the merging program reads per step (the "
             "splits per step: a power of two), head dim > 64 (2 programs per SM). One H100, kernel time from "
             "graph replays, 32 query / 8 kv heads, B=1 (33 splits per kv head), 64 / 128 / 256: 128K 186.5 / "
             "183.8 / 183.4 us, 1M 1387.8 / 1386.1 / 1384.8, 16K 34.4 / 31.1 / 33.4 (cuDNN 181.6 / 1380.9 / "
             "30.1); the merge itself 7.5 / 4.9 / 5.0 us at 128K (the kernel's timeline). 128 takes 166 "
             "registers (ptxas, sm_90, G 4 and 8), 256 spills; the split kernel with the outputs' loads after "
             "the lse's reductions (two trips to L2 per step), 16 splits per step: 190.0 / 1392.3 us (its merge "
             "9.4 us)",
        "decode_kernel_timeline_merge_h100_6d05e9c.json, decode_kernel_timeline_h100_195480c.json")
    merge_floats_per_thread_d64: int = measured(
        64, "the same at head dim <= 64, where 4 programs share an SM (programs_per_sm_d64): 128 floats take 184 "
            "registers there (ptxas), more than 4 programs of 128 threads hold at once; 64 take 110. Not timed "
            "at 128", "")
    min_split: int = measured(
        256, "a split shorter than four 64-token tiles is mostly its merge; not varied (the contexts measured "
             "split into thousands of tokens per program)", "")
    sharded_checks: str = measured(
        "auto", "where a sharded KVCache step's cross-rank checks travel: \"with_partials\" in the header of the "
                "all-gather of the ranks' partial results (one collective, read back after it: the host waits for "
                "the step's attention), \"apart\" in a small all-gather of their own issued from a side stream "
                "before the step's attention kernels (two collectives; the host waits for the previous step's, up "
                "to one step ahead of the GPU), "
                "\"auto\" apart where the partials are on a GPU: 2 H100, 1M tokens over 2 ranks, ms per layer, apart "
                "against with_partials, one step from an idle GPU 1.237 vs 1.596, 8 back to back 1.107 vs 1.678, "
                "NCCL alone 1.563 vs 1.636 (each rank's attention alone 0.73-0.77). On the CPU nothing waits for a "
                "device either way: one collective",
        "decode_sharded_profile_2xh100_219c17a.json, decode_sharded_batched_2xh100_219c17a.json, "
        "decode_sharded_nccl_2xh100_219c17a.json")

    def __post_init__(self):
        # made alike on every rank; checked here, where it is made, not inside a sharded step's collectives
        if self.descriptor_loads not in ("replayed", "always", "never"):
            raise ValueError(f"DecodeTuning.descriptor_loads must be 'replayed', 'always' or 'never', got "
                             f"{self.descriptor_loads!r}")
        if self.sharded_checks not in ("auto", "apart", "with_partials"):
            raise ValueError(f"DecodeTuning.sharded_checks must be 'auto', 'apart' or 'with_partials', got "
                             f"{self.sharded_checks!r}")

    def kernel_args(self, interpreted: bool, head_dim: int = 128, device_name: str = "", itemsize: int = 2,
                    replayed: bool = False) -> dict:
        """The split kernel's tiles for ``head_dim`` and the cache's element size
        on the GPU named ``device_name`` (``torch.cuda.get_device_name``); the CPU
        interpreter takes small ones (tests). ``replayed``: the launch is a
        step replayed from a CUDA graph (``descriptor_loads``)."""
        pps = self.programs_per_sm_d64 if head_dim <= 64 else self.programs_per_sm
        mf = self.merge_floats_per_thread_d64 if head_dim <= 64 else self.merge_floats_per_thread
        if interpreted:
            # pointer loads, as off the H200; the descriptor loads have their own CPU test
            return dict(block_n=16, num_warps=1, num_stages=1, programs_per_sm=pps, min_split=16,
                        heads_fastest=self.heads_fastest, descriptors=False, merge_floats=mf)
        # where it was swept: D=128 in 2-byte dtypes (a stage holds a K and a V tile; larger ones are not measured)
        h200 = device_name.startswith("NVIDIA H200") and 64 < head_dim <= 128 and itemsize == 2
        stages = self.h200_num_stages if h200 else self.num_stages
        return dict(block_n=self.h200_block_n if h200 else self.block_n, num_warps=self.num_warps,
                    num_stages=stages, programs_per_sm=pps, min_split=self.min_split,
                    heads_fastest=self.h200_heads_fastest if h200 else self.heads_fastest,
                    merge_floats=mf,
                    descriptors=h200 and (self.descriptor_loads == "always"
                                          or (self.descriptor_loads == "replayed" and replayed)))


@dataclasses.dataclass(frozen=True)
class UlyssesTuning:
    """How a Ulysses call pipelines its exchanges with its local attention.

    With ``chunks`` > 1 the heads a rank attends with are cut into that many
    groups: group c+1's inputs travel while group c's attention runs, group
    c-1's outputs land once group c's kernel is queued, and the backward runs
    the same schedule on the gradients. Only the first group's inputs and the
    last group's outputs are waited for with the GPU idle. Two groups are in
    flight at most, so a group costs about one more group's exchange buffers
    while each kernel call's own workspace shrinks to the group's."""

    max_chunks: int = measured(
        4, "most head groups per call. 2 x H200, 128K tokens, bf16, D=128: dense MHA in 2 groups and GQA "
           "32q/8kv in 4 ran fwd+bwd in 454 / 237 / 474 ms against 457 / 241 / 473 with the unpipelined "
           "exchange of df7b171 (dense_128k, dense_128k_causal, gqa_32q8kv_128k_causal): the exchange (~1.5 "
           "ms a pass over NVLink, 384 MiB q/k/v and 128 MiB out per rank at MHA) is ~1% of the attention, "
           "so 1 and 2 groups were not told apart and not measured alone; packed short documents "
           "(varlen_chat_16k at 128K, 4 groups) ran in 21.3 ms against 29.9 with fewer copies as well, the "
           "pipelining's share not measured. Memory: two groups in flight at most cost about one group's "
           "exchange buffers, and the local backward kernel's own workspace shrinks with the group (inferred "
           "from the peaks of df7b171 and d71baeb against longattn.bench.ulysses_memory's accounting: ~2 "
           "shards at 128K MHA, ~8 at GQA 32q/8kv, one shard = a rank's local q at 16 heads): predicted "
           "fwd+bwd peaks 11.0 shards for dense 128K MHA at 1 or 2 groups, 20.1 / 16.6 / 15.8 for GQA at "
           "1 / 2 / 4 (not measured)",
        "dist_ulysses_2xh200_d71baeb.json")
    min_chunk_rows: int = measured(
        1 << 19, "least query rows x heads per kernel call of one group (dense: batch x seqlen x heads/group; "
                 "per-document varlen calls: the mean document length x heads/group), 4096 tiles of 128 rows: "
                 "ring steps of that size (4 x H200, 128K, 16 heads, 32K x 32K blocks) ran at 0.964 / 1.02 x "
                 "one GPU (non-causal / causal forward) with their exchange and merges, so calls cut that small "
                 "lose little; smaller calls were not measured. At 128K a rank's 8 heads (16 over 2) run in 2 "
                 "groups, GQA's 16 query heads in 4; 32K and per-document calls stay whole. 1 group for dense "
                 "128K MHA (no measured gain from 2) would leave its predicted peak where it is (11.05 against "
                 "11.03 shards): kept at 2",
        "dist_4xh200_all_9e305a2.json")

    def __post_init__(self):
        if not isinstance(self.max_chunks, int) or self.max_chunks < 1:
            raise ValueError(f"UlyssesTuning.max_chunks must be an int >= 1, got {self.max_chunks!r}")
        if not isinstance(self.min_chunk_rows, int) or self.min_chunk_rows < 0:
            raise ValueError(f"UlyssesTuning.min_chunk_rows must be a non-negative int, got {self.min_chunk_rows!r}")

    def chunks(self, heads, call_rows: int) -> int:
        """Head groups for a call (``heads``: its
        :class:`longattn.distributed.ulysses.HeadPlan`) whose local kernel calls each hold ``call_rows``
        query rows per head: the most (up to ``max_chunks``) that divide both the
        query and the kv heads of a rank and keep ``min_chunk_rows`` per call.
        GQA whose kv heads do not split over the ranks runs in one group."""
        if not heads.splits_kv:
            return 1
        m, w = heads.nheads // heads.world, heads.nheads_kv // heads.world
        return max(n for n in range(1, min(self.max_chunks, m) + 1)
                   if n == 1 or (m % n == 0 and w % n == 0 and call_rows * (m // n) >= self.min_chunk_rows))


@dataclasses.dataclass(frozen=True)
class FlexExchangeTuning:
    """When ``ring_flex_attention`` runs its exchange engine (sparse K/V halos
    and shipped query rows, :mod:`longattn.flex.exchange`) instead of the ring,
    and which query blocks it ships."""

    heavy_fraction: float = measured(
        0.125, "a query block that sees more than this fraction of a peer's key blocks is a candidate to ship to "
               "that peer (its rows, dout, out and lse: about 4 rows of traffic a row) instead of fetching those "
               "key blocks (2 rows of K/V each, forward, and dK/dV back); ship_ratio and ship_max_work decide which "
               "candidates ship. Plans only, not timed: on the flex configs at 128K (window + global, causal "
               "documents, prefix-LM, block-sparse) over 2, 3 and 4 ranks every plan is the same for any value "
               "from 0.05 to 0.99 (below, window + global's window rows become candidates), so no value in that "
               "range times differently (python benchmarks/flex_exchange_sweep.py)",
        "flex_exchange_sweep_cpu_277d35e.json")
    heavy_min_blocks: int = measured(
        4, "a query block is a candidate to ship only where it sees at least this many key blocks of the peer "
           "(fewer are cheaper fetched). Plans only, not timed: the flex configs' plans at 128K over 2, 3 and 4 "
           "ranks are the same for any value from 1 to 64 (window + global with 8K windows: to 32)",
        "flex_exchange_sweep_cpu_277d35e.json, flex_exchange_sweep_window8192_cpu_277d35e.json")
    ship_ratio: float = measured(
        1.0, "a pair's candidate blocks ship only where their bytes (q, dout, out there; out and dq back) stay "
             "under this ratio of the bytes of the key blocks only they see (K/V there, dK/dV back); inf ships "
             "every candidate, 0 none. Window + global at 128K ships its global rows for any value from 0.1 up "
             "(flex_exchange_sweep_cpu_277d35e.json); never shipping them (0) fetches every key to the rank that "
             "holds them and computes them there: fwd+bwd 21.3 ms against 12.2 on 2 H200, 17.5 against 8.95 on "
             "4 H200 (python -m longattn.bench dist --config flex_swg_128k --impl flex-exchange flex-ring "
             "flex-exchange:ship_ratio=0 --warmup 2 --iters 6 under torchrun). Other values change the flex "
             "configs' plans only below 0.1 (that one) and from 4 up (causal documents at 3 ranks, block-sparse "
             "at inf: rows shipped), not timed",
        "flex_exchange_sweep_cpu_277d35e.json, dist_flex_traffic_swg_2xh200_a56d649.json, "
        "dist_flex_ship_swg_4xh200_ab30d5d.json")
    ship_max_work: float = measured(
        0.5, "candidate blocks ship only where the tiles they move to the peer (computed there) stay under this "
             "fraction of the peer's own tiles; inf: no bound. Window + global's global rows move 0.06-0.07 of a "
             "peer's tiles and shipping them wins (ship_ratio). Prefix-LM zigzag: rank 0's later chunk sees every "
             "key block of the peer, 0.80-1.20 of its tiles, fewer bytes shipped than fetched; shipped, the peer "
             "outlasts it: fwd+bwd 320 ms against 242 fetched (ring 235) on 2 H200, 187 against 130 (ring 133) on "
             "4 H200, one run each (python -m longattn.bench dist --config flex_prefix_128k --impl flex-exchange "
             "flex-ring flex-exchange:ship_max_work=inf --warmup 2 --iters 6); 319 against 238 with ship_ratio=0 "
             "in an earlier run. Between 0.07 and 0.80 not timed: 0.5 also ships the global rows of short shards "
             "(4-16 blocks a rank, as in the CPU tests: 0.25-0.4)",
        "dist_flex_ship_prefix_2xh200_ab30d5d.json, dist_flex_ship_prefix_4xh200_ab30d5d.json, "
        "dist_flex_traffic_prefix_2xh200_a56d649.json, flex_exchange_sweep_cpu_277d35e.json")
    min_world: int = measured(
        2, "engine='auto' runs the exchange from this many ranks on; it leads the ring at 2, 3 and 4. 128K "
           "(129024 at 3), FA4, fwd+bwd ms, exchange / ring / torch CP + FlexAttention on H100s: 2 ranks window + "
           "global 15.3 / 15.9 / 24.6, documents 19.4 / 22.1 / 34.2; 3 ranks 11.9 / 18.2 and 17.6 / 22.9; 4 ranks "
           "9.76 / 17.4 / 20.1 and 11.3 / 19.9 / 21.5 (peak MiB at 2: 1967 / 3084 / 2568 and 1562 / 3084 / 2568)",
        "dist_flex_exchange_2xh100_3d96269.json, dist_flex_exchange_3xh100_3d96269.json, "
        "dist_flex_exchange_4xh100_3d96269.json")
    concurrent: bool = measured(
        True, "on CUDA the pieces other than the own one (halos, served rows: small grids, long chains where one "
              "key block is seen by every row) run on a side stream beside the own piece. 4 H100 ranks, 128K, FA4, "
              "fwd+bwd ms (two alternating runs, side stream / serial): window + global 10.77, 10.37 / 11.38, "
              "11.31; documents 10.52, 10.90 / 10.53, 11.06; peak 798 / 886 MiB (the own piece's outputs become "
              "the sums before the others arrive). 2 ranks: 14.44 / 13.79 and 19.68 / 19.91, within the run's "
              "noise. The forward's side stream set up before the own piece or after it (so its pieces follow "
              "it), 4 H200, two alternating runs each: 2 ranks window + global 14.04, 14.10 / 14.19, 14.10, "
              "documents 19.13, 18.97 / 18.97, 19.03; 4 ranks 10.13, 9.75 / 10.82, 8.79 and 10.64, 10.39 / "
              "10.85, 10.24: a tie, kept beside as in the backward. FA4's persistent kernels hold every SM, so "
              "the side pieces mostly run after the own piece's launch ends. At f4c34bd, 2 H100 ranks, window + "
              "global, slowest rank, two alternating rounds: 13.81, 13.55 / 13.48, 13.52: a tie. With few-keys pieces (2 H200, "
              "a681bba, slowest rank, each call after a barrier, two alternating rounds): 11.81, 12.16 / 12.17, "
              "12.37; back to back 11.92, 12.90 / 12.14, 12.22; peak 1685 / 2413 MiB",
        "flex_exchange_side_4xh100_3d96269.json, flex_exchange_fwd_side_4xh200_261a205.json, "
        "flex_exchange_side_2xh100_f4c34bd.json, serial_ab_2xh200_a681bba.json")
    split_chain: int = measured(
        64, "an FA4 piece of the exchange runs a pass on a view of that pass's long side as c batch rows "
            "(longattn.flex.fa4.SplitStep: the global tokens' rows served against a shard, forward; a shard's rows "
            "against the global keys, backward) where a program of the pass (a query tile forward, a key tile "
            "backward) sees more than this many tiles of the other side, c the fewest that bring every view to "
            "this many or fewer. Kernels alone, 64K shard, H=16, D=128, ms by c (1 = one call), one H200: 128 "
            "served rows against 512 key tiles, forward 0.80 / c=2 0.72, 4 0.40, 8 0.37, 16 0.38, 32 0.43 (best: "
            "64 tiles a view); a 32K shard's rows (256 tiles) against 1152 halo keys, backward 2.56 / 1.73, 1.26, "
            "1.29, 1.49, 1.92 (64 to 32). The exchange at 2 ranks, window + global (a shard's rows against 17 "
            "halo key tiles, the global keys' 512 query tiles long: 8 views), fwd+bwd ms alternating in one run, "
            "2 H100: 13.59, 13.73 / 14.89, 14.56 unsplit (documents within noise: nothing to split); 4 H200 at 128K, "
            "the slowest rank, ten alternating rounds: 8.11-8.44 (median 8.28) split against 7.94-8.49 "
            "(8.32) unsplit, a tie",
        "flex_split_pieces_h200_e900875.json, flex_exchange_split_chain_2xh100_7a2a346.json, "
        "flex_exchange_split_4xh200_c444150.json")
    split_programs: int = measured(
        264, "a pass is split (split_chain) only where fewer of its programs than this have chains longer than "
             "split_chain: more keep every SM busy whatever their length (264 = 2 programs per SM); 0: never. "
             "Documents at 2 and 4 ranks (many long programs where a document spans a shard edge) ran within 2% "
             "split or not; flex_exchange_split_4xh200_e900875.json, flex_exchange_split_4xh200_76484d1.json")
    split_min_blocks: int = measured(
        4, "each view row keeps at least this many tiles of the long side (fewer: the repeated short side and the "
           "merge cost more than the programs gain: the served rows' forward at c=32, 4 key tiles a view, 0.43 ms "
           "against 0.37 at 8); flex_split_pieces_h200_e900875.json")
    join_halo: bool = measured(
        False, "a rank's halo keys join its own piece, one FA4 call per pass for both: causal documents as varlen "
               "with each run's earlier keys from the peers in its key segment (pieces.JoinedDocuments, where no "
               "rows are shipped), other patterns on [halo keys | shard keys] where the halo fills whole key blocks "
               "(pieces.JoinedKeys; carved as a one-device call where no rows are shipped, pieces.carved). It saves "
               "a call per pass, the halo's merge and dQ sum and some dispatches (CPU stand-ins, window + global: "
               "135-157 per rank at 2 ranks, 161-213 at 4, against 164-188 and 190-244; "
               "flex_exchange_ops_join_cpu_9c847ff.json) and costs a copy of the shard's K/V per pass (documents: "
               "a gather of the keys and a scatter of their dK/dV). Off: on 2 and 4 H100, alternating, the slowest "
               "rank's fwd+bwd, documents lost 9% at 2 GPUs (19.7-19.8 ms against 17.9-18.1 one call at a time, "
               "back to back 20.2-20.8 against 17.9-19.1; bench dist batched efficiency 0.874 against 0.952) and "
               "1-2% at 4 (10.2-10.3 against 10.0-10.3; 0.833 against 0.853); window + global tied (2 GPUs "
               "13.1-13.2 against 13.3-13.8, back to back 12.9-13.4 against 13.1-13.3; 4 GPUs back to back 7.40-7.42 "
               "against 7.46-7.49; the joined rows skipped the call's argument checks there, which only favours them) and the "
               "peak rose 66-526 MiB. And wrong for causal documents on GPUs up to 3e7765f: in "
               "tests/test_flex_exchange.py::test_exchange_fa4_on_gpus[2] (2 H100, 2 H200) the joined documents' "
               "output error is 4e-2 to 1e-1 against the ring's 1.3e-3, on rank 0's rows of the document that starts "
               "on rank 1: the halo rank 0 received holds rows unlike rank 1's keys (54 of 640 on 2 H200) though the "
               "ranks planned the same rows. The cause, fixed in exchange_run.Transfer.wait: the waiting side stream "
               "let the allocator recycle the send buffer on the main stream before the collective had read it; "
               "the test ([2] and [4]) and test_transfer_waited_on_another_stream pass on 4 H200 at e816f3e; "
               "flex_exchange_join_ab_2xh100_7a87d75.json, "
               "flex_exchange_join_ab_4xh100_7a87d75.json, dist_flex_join_batched_2xh100_7a87d75.json, "
               "dist_flex_join_batched_4xh100_7a87d75.json")
    max_traffic: float = measured(
        0.15, "engine='auto' runs the exchange where the most bytes a rank sends (forward + backward) stay under "
              "this x the ring's steps (those that move K/V) of the ring's bytes (K/V forward, K/V and dK/dV "
              "backward): the ring hides its transfers behind its steps' kernels, the exchange only behind its own "
              "piece, and a ring of more steps loses more than its bytes to each step's wait and merge. H200, 128K, "
              "fwd+bwd ms exchange / ring at (bytes / ring's), window + global with windows of 1024 (the config), "
              "4096, 8192 and 16384 (--pattern-args W,128), prefix-LM, block-sparse, one run each: 2 ranks (1 "
              "step: bound 0.15) 0.022 12.2 / 14.5, 0.085 32.1 / 32.0, 0.168 59.7 / 57.9, 0.378 121 / 110, 0.50 "
              "(prefix-LM) 242 / 235, 0.667 (block-sparse) 31.3 / 16.9; 4 ranks (3 steps: 0.45) 0.029 8.95 / 16.0, "
              "0.112 18.2 / 22.8, 0.223 35.6 / 36.7, 0.445 60.6 / 68.5, 0.50 130 / 133 (peak 4615 against 2566 "
              "MiB), 0.667 23.4 / 15.2. The bound picks the faster engine in each but prefix-LM on 4 ranks (the "
              "ring 2% slower in 0.56x the memory). 3 ranks (bound 0.30): window + global 0.034 and causal "
              "documents 0.050 ran the exchange ahead (min_world), prefix-LM (0.46) not timed. Ratios: python "
              "benchmarks/flex_exchange_sweep.py; times: python -m longattn.bench dist --config flex_swg_128k "
              "[--pattern-args W,128] --impl flex-exchange flex-ring --warmup 2 --iters 6 under torchrun",
        "dist_flex_traffic_swg_2xh200_a56d649.json, dist_flex_ship_swg_4xh200_ab30d5d.json, "
        "dist_flex_window4096_2xh200_72f5730.json, dist_flex_window4096_4xh200_72f5730.json, "
        "dist_flex_window8192_2xh200_72f5730.json, dist_flex_window8192_4xh200_72f5730.json, "
        "dist_flex_window16384_2xh200_72f5730.json, dist_flex_window16384_4xh200_72f5730.json, "
        "dist_flex_ship_prefix_2xh200_ab30d5d.json, dist_flex_ship_prefix_4xh200_ab30d5d.json, "
        "dist_flex_traffic_bsparse_2xh200_a56d649.json, dist_flex_traffic_bsparse_4xh200_ab30d5d.json, "
        "flex_exchange_sweep_cpu_277d35e.json, flex_exchange_sweep_window4096_cpu_277d35e.json, "
        "flex_exchange_sweep_window8192_cpu_277d35e.json, flex_exchange_sweep_window16384_cpu_277d35e.json")
    graph_max_tokens: int = measured(
        0, "an exchange whose ranks hold at most this many query tokens each (batch x local rows) replays its "
           "forward and its backward from CUDA graphs, transfers and side stream included "
           "(longattn.dilated.graphs.GraphCache: a shape's first call eager, its second captured on every rank, "
           "later ones replayed; not inside another capture nor torch.compile); 0: never. Off: the copies in and "
           "out cost more GPU time than the host time they hide. 2 H100 at 128K (64K rows a rank), fwd / bwd ms "
           "graphed against eager, cold: window + global 4.26 / 15.4 against 4.28 / 13.4, documents 5.39 / 19.8 "
           "against 4.80 / 17.8; batched 4.05 / 15.1 against 3.17 / 12.9 and 5.41 / 19.7 against 4.76 / 17.4 "
           "(one device, graphed calls lose from 8K tokens: FlexFa4Tuning.graph_max_tokens). 4 H200 at 128K (32K "
           "rows a rank, where the host is behind for window + global: host 8.7 ms a fwd+bwd against 6.7 on the "
           "GPU), batched, fwd / fwd+bwd ms graphed against eager: window + global 2.08 / 7.50 against 2.18 / "
           "6.73, documents 2.73 / 10.4 against 2.41 / 9.51 (the graphed peak 548 / 521 MiB against 1240 / "
           "798). Measure with python -m longattn.bench dist --config flex_swg_128k flex_doc_128k "
           "--impl flex-exchange flex-exchange:graph_max_tokens=1048576 under torchrun",
        "dist_flex_graphs_cold_2xh100_086877a.json, dist_flex_graphs_batched_2xh100_086877a.json, "
        "dist_flex_graphs_batched_4xh200_e816f3e.json")

    few_keys: int = measured(
        128, "a run of at most this many halo keys that every row of a rank sees (the global tokens' keys on the "
             "ranks without them) is a few-keys piece (longattn.flex.pieces.FewKeys: Triton passes that merge into "
             "the own piece's out and lse and add into its dQ in place, dK/dV as two GEMMs) instead of rows of an "
             "FA4 halo piece (whose backward runs on row views, the keys repeated, then merged and summed), where "
             "the rank holds few_keys_min_rows query rows or more; the other halo pieces then run only on the rows "
             "that see other halo keys; 0: never. Those calls alone, one H200, 128 keys, H=16, D=128, bf16, fwd + "
             "bwd ms: 64K rows 0.38 + 1.07 against FA4's 0.52 + 1.18 (0.45 + 1.22 against 0.63 + 1.50 on another "
             "H200); 32K rows 0.22 + 0.60 against 0.31 + 0.74 (python benchmarks/few_keys_ab.py --rows 65536 --keys "
             "128). In the exchange (2 H200 ranks, 128K window + global, kernels under the profiler) the rank "
             "without the global tokens runs 0.86 ms less of FA4's kernels and 0.4 ms fewer merges and bf16 sums, "
             "and 1.47 ms of few-keys kernels (forward 0.37, backward 0.69, dK/dV GEMMs 0.41) plus 0.18 of float32 "
             "halo-gradient sums: about as much GPU time, yet it finishes sooner (few_stack_2xh200_8834ff6.json)",
        "few_keys_ab_h200_c07fcc6.json, few_keys_ab_32k_h200_c07fcc6.json, few_keys_ab_lib_h200_f67e93b.json, "
        "few_stack_2xh200_8834ff6.json")
    few_keys_min_rows: int = measured(
        65536, "few-keys pieces run only on ranks holding at least this many query rows (batch x local rows). 128K "
               "window + global, fwd+bwd ms few-keys / FA4 halo pieces, slowest rank, each pair from one run. 2 "
               "ranks (64K rows a rank): 2 H200 at b92c4c4, cold 12.0, 12.1 / 12.4, 12.4, back to back 11.9 / 12.2, "
               "peak 1685 / 2107 MiB (python -m longattn.bench dist --config flex_swg_128k --impl flex-exchange "
               "flex-exchange:few_keys=0 ...); on a 4-H200 host at 5b5217e (the own piece carved in both) cold 12.1 "
               "/ 12.4, back to back 11.8 / 12.1, each call after a barrier, alternating, 11.88, 12.20 / 12.24, "
               "12.52 (benchmarks/flex_exchange_profile.py). 4 ranks (32K rows), 4 H200: at 5b5217e cold 9.04 / "
               "8.53, back to back 7.49 / 6.69; at 8834ff6 the profiler's barrier-timed calls 8.05 / 8.76; at "
               "f67e93b on a host at half speed cold 14.3 / 13.2, back to back 13.7 / 13.8 (2 ranks 25.4 / 25.4); "
               "peak 1091 / 1240: where the host issues about as fast as the GPU runs (4 ranks, docs/performance.md "
               "section 8) the extra launches of the pieces around the few-keys runs cost more than their kernels "
               "save. Between 32K and 64K rows not measured",
        "dist_flex_swg_2xh200_b92c4c4.json, dist_flex_swg_2xh200_b92c4c4_run2.json, "
        "dist_flex_swg_batched_2xh200_b92c4c4.json, dist_flex_swg_carve_2xh200_5b5217e.json, "
        "dist_flex_swg_carve_batched_2xh200_5b5217e.json, few_ab_2xh200_5b5217e.json, "
        "dist_flex_swg_carve_4xh200_5b5217e.json, dist_flex_swg_carve_batched_4xh200_5b5217e.json, "
        "few_stack_4xh200_8834ff6.json, dist_flex_swg_few_4xh200_f67e93b.json, "
        "dist_flex_swg_few_batched_4xh200_f67e93b.json, dist_flex_swg_few_batched_2xh200_f67e93b.json")
    few_keys_share: float = measured(
        0.125, "a few-keys piece runs over each run of a rank's rows that see no other halo key and hold at least "
               "this share of its rows (global tokens with windows: the middles of a shard's chunks, most of its "
               "rows); shorter runs keep those keys in their halo pieces, whose launches they would otherwise "
               "split. Plans only: window + global at 128K, the runs hold 0.97 of a rank's rows at 2 ranks (its "
               "two chunks adjacent), 0.44-0.45 each at 3 and 4; with 4096 / 8192 / 16384-token windows 0.88 / "
               "0.75 / 0.50 at 2 ranks, at 4 ranks 0.25 each with 4096 (python benchmarks/flex_exchange_sweep.py "
               "--pattern-args W,128): any value up to 0.25 gives these plans. Few-keys pieces against FA4 halo "
               "pieces are timed in few_keys_min_rows (whose gate keeps them off at 4 ranks of 128K); where runs "
               "of 0.25 or less of a rank's rows would pay is not timed",
        "flex_exchange_sweep_cpu_277d35e.json, flex_exchange_sweep_window4096_cpu_277d35e.json, "
        "flex_exchange_sweep_window8192_cpu_277d35e.json, flex_exchange_sweep_window16384_cpu_277d35e.json")

    def __post_init__(self):
        if not 0 <= self.heavy_fraction <= 1:
            raise ValueError(f"FlexExchangeTuning.heavy_fraction must be in [0, 1], got {self.heavy_fraction!r}")
        if not isinstance(self.heavy_min_blocks, int) or self.heavy_min_blocks < 1:
            raise ValueError(f"FlexExchangeTuning.heavy_min_blocks must be an int >= 1, got {self.heavy_min_blocks!r}")
        if not self.ship_ratio >= 0:
            raise ValueError(f"FlexExchangeTuning.ship_ratio must be >= 0, got {self.ship_ratio!r}")
        if not self.ship_max_work >= 0:
            raise ValueError(f"FlexExchangeTuning.ship_max_work must be >= 0 (inf: no bound), got "
                             f"{self.ship_max_work!r}")
        if not isinstance(self.min_world, int) or self.min_world < 2:
            raise ValueError(f"FlexExchangeTuning.min_world must be an int >= 2, got {self.min_world!r}")
        if not self.max_traffic >= 0:
            raise ValueError(f"FlexExchangeTuning.max_traffic must be >= 0, got {self.max_traffic!r}")
        if not 0 < self.few_keys_share <= 1:
            raise ValueError(f"FlexExchangeTuning.few_keys_share must be in (0, 1], got {self.few_keys_share!r}")
        for name, least in (("split_chain", 1), ("split_programs", 0), ("split_min_blocks", 1),
                            ("graph_max_tokens", 0), ("few_keys", 0), ("few_keys_min_rows", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < least:
                raise ValueError(f"FlexExchangeTuning.{name} must be an int >= {least}, got {getattr(self, name)!r}")
        for name in ("concurrent", "join_halo"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FlexExchangeTuning.{name} must be True or False, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class FlexFa4Tuning:
    """How ``flex_attention`` on FA4 runs contiguous documents (as varlen, one
    device and the exchange's own piece: :class:`longattn.flex.pieces.DocumentsStep`)
    and, on one device, a pattern with a few long chains
    (:class:`longattn.flex.pieces.CarvedStep`) and short calls (CUDA graphs)."""

    split_chain: int = measured(
        64, "FA4 runs a program per query tile forward and per key tile backward, each a chain over the tiles of the "
            "other side it sees, and its backward grid runs key tiles head by head, so a key tile every query tile "
            "sees (global tokens' keys) starts its chain late for the last heads and outlasts the pass. Tiles whose "
            "chain exceeds this many tiles run apart on views of the other side (c the fewest that bring each view "
            "to this many; longattn.flex.fa4.SplitStep), the rest in one call with them cleared: the forward's rows "
            "written in place, the backward's dK/dV columns written and dQ summed. One H100, fwd / bwd ms, one "
            "call / carved (python benchmarks/flex_chains.py): block-sparse 32K 0.863 / 0.714 (c=4), 2.687 / 2.514; "
            "window + global 32K 1.382 / 1.293, 4.026 / 4.023; 128K (c=16) 5.652 / 5.526, 16.572 / 16.647",
        "flex_chains_h100_3118328.json, flex_chains_h100_3277dc9.json")
    split_programs: int = measured(
        264, "tiles are carved only where fewer programs than this (tiles x heads) have chains over split_chain: more "
             "keep every SM busy whatever their length (264 = 2 programs per SM); 0: never carve. Prefix-LM and "
             "causal documents at 32K have none to carve (flex_chains_h100_3277dc9.json)")
    split_min_blocks: int = measured(
        4, "each view keeps at least this many tiles of the long side (FlexExchangeTuning.split_min_blocks: the same "
           "views, flex_split_pieces_h200_e900875.json)")
    documents_varlen: bool = measured(
        True, "documents alone or with causal and windows, each document one contiguous run, run as FA4's varlen "
              "kernel (one launch over every document's own tiles, no mask calls, no block tables) instead of the "
              "mask_mod with block sparsity: the same 9 causal documents at 32K (H=16, D=128), one H100, kernels "
              "under the profiler: varlen 2.07 + 5.79 ms fwd / bwd (cold_gaps_h100_ab8626a.json, varlen_mix_32k), "
              "mask_mod 2.24 + 6.28 (same file, flex_doc_32k); flex_doc_32k fwd+bwd against torch's compiled "
              "FlexAttention in one run, one H100: 8.69 vs 13.86 ms cold, 8.82 vs 13.48 batched (the mask path: "
              "1.47x / 1.41x in other runs, run_flex_fa4_h100_07d4664.json, run_flex_fa4_batched_h100_ab8626a.json)",
        "cold_gaps_h100_ab8626a.json, run_flex_doc_fa4_h100_4b282da.json, run_flex_doc_fa4_batched_h100_4b282da.json")
    graph_max_tokens: int = measured(
        0, "a one-device call on FA4 with at most this many query tokens (batch x rows) replays its forward and "
           "its backward from CUDA graphs (longattn.dilated.graphs.GraphCache: a shape's first call eager, its "
           "second captured, later ones copy their inputs in, replay and return copies; not inside another "
           "capture nor torch.compile); 0: never. Each pass already replays FA4's compiled calls without its "
           "Python (Fa4Tuning.replay_max_tokens), so a graph saves little host time and adds its copies' GPU "
           "time: one H200, fwd+bwd ms, the planned executor eager against graphed (torch's compiled "
           "FlexAttention), cold: block-sparse 4K 0.519 against 0.623 (0.932), 8K 0.875 against 0.980 (1.307); "
           "window + global 4K 0.656 against 0.726 (1.189), 8K 1.302 against 1.491 (2.014); the GPU's time "
           "alone (after a 20 ms sleep) 0.330 against 0.475 at 4K block-sparse; a second run, 4K 0.592 against "
           "0.641 and 0.752 against 0.856, 8K 0.997 against 1.004 and 1.300 against 1.482 (python benchmarks/"
           "flex_carve_timing.py --rounds 3 --seqlen 4096 8192 flex_bsparse_32k flex_swg_32k); at 32K the "
           "graphed fwd+bwd runs the same kernels plus 0.85 ms of copies (1.5 GiB in and out at 128 MiB a tensor): block-sparse 3.70 "
           "against 2.83 ms, window + global 5.34 against 4.47",
        "flex_carve_timing_short_h200_0a3c91b.json, flex_carve_timing_short_h200_5edc28f.json, "
        "flex_graph_kernels_h200_2307ec6.json")

    def __post_init__(self):
        if not isinstance(self.documents_varlen, bool):
            raise ValueError(f"FlexFa4Tuning.documents_varlen must be a bool, got {self.documents_varlen!r}")
        for name, least in (("split_chain", 1), ("split_programs", 0), ("split_min_blocks", 1),
                            ("graph_max_tokens", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < least:
                raise ValueError(f"FlexFa4Tuning.{name} must be an int >= {least}, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Fa4Tuning:
    """Where the fa4 backend (:class:`longattn.backends.fa4.FA4Backend`) overrides
    FlashAttention-4's own kernel choices. Its tile sizes are FA4's: on the ops'
    own calls (one H100, ``python benchmarks/fa4_tiles.py``: the dilated views
    of LongNet at 128K, D=128 and 64, causal and not, GQA; dense 32K; varlen 32K)
    no other forward tile (128x144 ... 128x192, register-held P off) or backward
    query tile (64 / 80) beat FA4's choice by more than the spread between two
    identical variants (about 1%), and D=64's 192x160 / 192x192 forwards lost
    30-45% (fa4_tiles_h100_8048d53.json, fa4_tiles_h100_586da65.json)."""

    unpacked_gqa_causal_rows: tuple = measured(
        (512, 2048), "causal GQA squares (queries and keys alike) of this many rows (inclusive range) run FA4's "
                     "forward with each query head in its own tiles (pack_gqa=False; FA4 packs a kv head's query "
                     "heads into one tile). One H100, 32q/8kv, D=128, forward ms unpacked / packed / FA4's choice "
                     "again (a control), medians of 6 rounds: dense causal squares, batch x rows = 128K, 512 rows 1.77 / 2.02 / 2.01 (fwd+bwd "
                     "10.18 / 10.46 / 10.42), 1024 rows 2.67 / 2.89 / 2.84, 2048 rows 4.47 / 4.48 / 4.47, 4096 and "
                     "8192 rows within 1%; LongNet causal at 128K (the dilated views: strided causal squares of 2048 "
                     "rows) 10.08 / 10.38 / 10.14 and, in other runs, 10.12 / 10.47 / 10.52 and 10.13 / 10.64. "
                     "Longer calls keep FA4's choice (dense causal 32K: unpacked 13.66 against 13.49 / 13.41), as "
                     "do shorter ones (unmeasured; one query row per head would fill a tile alone). Not profiled why",
        "fa4_tiles_pack_h100_aeb1d8c.json, fa4_tiles_h100_586da65.json, fa4_tiles_h100_8048d53.json")

    replay_max_tokens: int = measured(
        65536, "an FA4 call of at most this many query tokens and key tokens (batch x rows, each) records its "
               "compiled kernel calls and replays them after, without FA4's per-call Python "
               "(longattn.backends._fa4_api.Replay; the decision: longattn.backends.fa4.replays); 0: never. A mask "
               "call (each pass of a step of flex_attention, the ring or the exchange: longattn.flex.fa4.step_forward "
               "/ step_backward) records on its layout's first call, a dense call of the fa4 backend on its second "
               "(FA4Backend.REPLAY_SIGHTINGS). Dense, one H200, the backend's fwd+bwd cold, replayed against FA4's "
               "entries: B=4 4K H=12 D=128 causal window 512 0.530-0.537 / 0.586-0.658 ms, non-causal 2.25-2.32 / "
               "2.48-2.49, 2K 32q/8kv causal 0.351-0.480 / 0.436-0.627, 8K 3.12-3.38 / 3.37-3.51; back to back "
               "within 1-2% (fa4_dense_replay_h200_788641c.json). Masks: "
               "FA4's Python is about 0.3 ms of host time per call: one H200, 32K block-sparse fwd+bwd issued in 3.13 "
               "ms, 1.55 of it inside FA4's four entries, 0.27 in their compiled calls (fa4_host_time_h200_039606c."
               "json); with both passes replayed no FA4 entry runs after a layout's first call, 2.71 ms to issue "
               "against 2.80 of GPU time (fa4_host_time_h200_64a78d2.json), and a cold call runs 2.99 ms against 3.95 "
               "without replays, 1.78x torch's compiled FlexAttention against 1.36x (run_flex_fa4_h200_64a78d2.json, "
               "run_flex_fa4_h200_2307ec6.json); 4 H200, the exchange's window + global at 128K (32K rows a rank, "
               "both passes replayed): 6.4-7.7 ms to issue a fwd+bwd against 6.1-6.6 of GPU time per rank "
               "(flex_exchange_host_4xh200_c444150.json). Past 64K "
               "tokens a call's GPU time (twice 32K's and more) dwarfs the 0.3 ms, and recording checks the replay "
               "once with a second set of the call's outputs and buffers (dK, dV and their float32 accumulators "
               "as long as the keys), memory a long call may not spare",
        "fa4_host_time_h200_039606c.json, fa4_host_time_h200_64a78d2.json, run_flex_fa4_h200_64a78d2.json, "
        "flex_exchange_host_4xh200_c444150.json, fa4_dense_replay_h200_788641c.json")

    def __post_init__(self):
        r = self.unpacked_gqa_causal_rows
        if not (isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, int) for x in r) and 0 <= r[0]):
            raise ValueError(f"Fa4Tuning.unpacked_gqa_causal_rows must be a (low, high) pair of ints >= 0 "
                             f"(high < low: never), got {r!r}")
        if not isinstance(self.replay_max_tokens, int) or self.replay_max_tokens < 0:
            raise ValueError(f"Fa4Tuning.replay_max_tokens must be an int >= 0 (0: never), got "
                             f"{self.replay_max_tokens!r}")


DILATED = DilatedTuning()
VARLEN = VarlenTuning()
DECODE = DecodeTuning()
RING_VARLEN = RingVarlenTuning()
ULYSSES = UlyssesTuning()
DOC_SHARD = DocShardTuning()
FLEX_EXCHANGE = FlexExchangeTuning()
FLEX_FA4 = FlexFa4Tuning()
FA4 = Fa4Tuning()
TUNINGS = (DILATED, VARLEN, RING_VARLEN, DECODE, ULYSSES, DOC_SHARD, FLEX_EXCHANGE, FLEX_FA4, FA4)
"""Every tuning object (``describe`` lists their fields)."""


def describe() -> str:
    """Every measured threshold with its value, reason and result file (one line each)."""
    lines = []
    for obj in TUNINGS:
        for f in dataclasses.fields(obj):
            src = f.metadata.get("source")
            lines.append(f"{type(obj).__name__}.{f.name} = {getattr(obj, f.name)!r}: {f.metadata.get('reason', '')}"
                         + (f" [benchmarks/results/{src}]" if src else ""))
    return "\n".join(lines)
