"""python -m longattn.bench decode: long-context inference.

For each context length: the prefill of one attention layer (``attention`` on
one rank, ``ring_attention`` zigzag under torchrun; ``dilated_attention`` for
dilated rows) and the building of its :class:`longattn.KVCache`, then decoding:
one token per step through ``--layers`` layers' caches (the token's K/V
appended in the attend call, ``attend(q, k_new=, v_new=)``), timed per step
with CUDA events (``measure.time_ms``:
``--timing cold``, one isolated step per sample, host time counts; or
``batched``, steps back to back as in a generation loop). Under torchrun the cache is
sharded over the ranks (one all-gather of the partial outputs per layer and
token). On one rank, beside it: SDPA decoding over one layer's whole cache
(``scaled_dot_product_attention`` of one query over a preallocated
``(batch, kv_heads, context, head_dim)`` cache, each backend that runs),
where it fits; the same over a context that grows by one token per step
(``*-growing`` rows: SDPA's default choice, and cuDNN, which builds a plan
for every new length); and one step of each captured in a CUDA graph and replayed
(``*-graphed`` rows: the GPU's time, as a serving loop that captures its
steps sees it; ``fa4-graphed``: FA4's split-KV forward itself, where it is
installed). The default backends on CUDA put our decode engines side by side:
``triton`` (the split-KV kernel, replayed from graphs by the cache), ``fa4``
(FA4's split-KV forward, :func:`longattn.decode.engine.dense_engine`),
``flash`` and ``cudnn`` on views, and ``auto``.

Rows: ``impl`` (``longattn`` with ``backend``, ``longattn-dilated``,
``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient``), ``prefill_ms`` (one
layer's attention), ``cache_build_ms``, ``decode_ms_per_layer`` (one token, one
layer: append + attend), ``step_ms`` (all layers), ``tokens_per_s``
(``batch`` tokens per step over ``step_ms``: the attention part of a model's
step), ``cache_bytes_per_rank`` (all layers), ``peak_mem_bytes``. A
measurement that fails (out of memory) is recorded with its reason.

Examples::

    python -m longattn.bench decode                                   # defaults for this device
    python -m longattn.bench decode --context 131072 1048576 --json benchmarks/results/decode_h100.json
    torchrun --nproc_per_node=2 -m longattn.bench decode --context 1048576 --layers 24
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

import longattn
from longattn.backends import _fa4_api
from longattn.decode.engine import fa4_refusals

from . import measure
from .configs import DTYPES
from .dist import _agree, _free, _init
from .single import _failure


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longattn.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+",
                   help="context lengths (default: 131072 1048576 on CUDA, 1024 4096 on CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="query heads (default 32 on CUDA, 4 on CPU)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default 8 on CUDA, 2 on CPU)")
    p.add_argument("--head-dim", type=int, help="head dim (default 128 on CUDA, 64 on CPU)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--layers", type=int, default=1, help="attention layers whose caches are held and decoded "
                                                          "each step (model-sized memory; default 1)")
    p.add_argument("--backend", nargs="+", help="our local backends to time (default: auto triton fa4 flash "
                                                "cudnn on CUDA, auto on CPU)")
    p.add_argument("--segment-lengths", type=int, nargs="+", help="also time dilated decoding with these branches")
    p.add_argument("--dilation-rates", type=int, nargs="+", help="the branches' rates (with --segment-lengths)")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA rows")
    p.add_argument("--warmup", type=int, default=20,
                   help="untimed decode steps first (default 20: a cache captures its step on its third, and "
                        "whichever backend is timed first after the prefill ran its first isolated steps up to "
                        "0.4 ms slower for several steps, benchmarks/decode_cold_probe.py)")
    p.add_argument("--iters", type=int, default=20, help="timed decode steps (the median is reported; default 20)")
    p.add_argument("--timing", choices=["cold", "batched"], default="cold",
                   help="cold: one step per sample, the GPU idle at its start (host time counts); batched: steps "
                        "back to back, time per step (the host runs ahead, as in a generation loop; CUDA only)")
    p.add_argument("--json", help="write the results to this JSON file (rank 0; and a CSV beside it)")
    a = p.parse_args(argv)
    if (a.segment_lengths is None) != (a.dilation_rates is None):
        p.error("--segment-lengths and --dilation-rates go together")
    return a


def _fresh(dev) -> None:
    """Free what the last row left (``dist._free``) and start the peak counter
    over: a row's ``peak_mem_bytes`` is its own."""
    _free(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def _peak(dev) -> Optional[int]:
    return int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None


def _head(a, n: int, dt, impl: str, backend: Optional[str], world: int = 1, layers: int = 1, **extra) -> dict:
    """The fields every row carries, whatever became of it."""
    return dict(impl=impl, backend=backend, world=world, context=n, batch=a.batch, heads=a.heads,
                kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=str(dt).replace("torch.", ""), layers=layers,
                **extra, status="ok")


def _timed(row: dict, t: dict, layers: int, batch: int, dev) -> None:
    """``row`` gets the step's times (``t`` from ``measure.time_ms``) and the peak memory."""
    row.update(step_ms=t["median_ms"], step_min_ms=t["min_ms"], step_max_ms=t["max_ms"], host_ms=t["host_ms"],
               decode_ms_per_layer=t["median_ms"] / layers, tokens_per_s=batch * 1e3 / t["median_ms"],
               peak_mem_bytes=_peak(dev))


def bench_longattn(a, n: int, dev, dt, world: int, backends, branches: Optional[dict]) -> list[dict]:
    """Prefill one layer (backend auto), hold ``layers`` caches, time a decode
    step through all of them with each of ``backends``: one row per backend."""
    g = dist.group.WORLD if world > 1 else None
    b, h, hkv, d = a.batch, a.heads, a.kv_heads, a.head_dim
    layout = "contiguous" if branches else "zigzag"
    base = _head(a, n, dt, "longattn-dilated" if branches else "longattn", None, world, a.layers,
                 layout=layout if world > 1 else None, **(branches or {}))
    if n % (world if branches else 2 * world):
        return [dict(base, backend=be, status="unsupported",
                     reason=f"context {n} does not split over {world} ranks ({layout})") for be in backends]
    _fresh(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    local = n // world
    q, k, v = (torch.randn(b, local, hh, d, device=dev, dtype=dt, generator=gen) for hh in (h, hkv, hkv))
    if branches:
        prefill = lambda: longattn.dilated_attention(q, k, v, causal=True, group=g, **branches)
    elif g is None:
        prefill = lambda: longattn.attention(q, k, v, causal=True)
    else:
        prefill = lambda: longattn.ring_attention(q, k, v, causal=True, layout=layout, group=g)
    # batched timing: a probe step, then per sample up to 10 timed steps and one lead step
    reserve = len(backends) * (a.warmup + 1 + 11 * a.iters) + 8
    with torch.no_grad():
        try:
            base["prefill_ms"] = measure.time_ms(prefill, dev, warmup=1, iters=1)["median_ms"]
        except ValueError as e:
            # shapes the op refuses (segments that do not align with the shards): the same on every rank
            return [dict(base, backend=be, status="unsupported", reason=_failure(e)) for be in backends]
        del q
        build = lambda: longattn.KVCache.from_prefill(k, v, layout=layout, group=g, reserve=reserve)
        caches = []  # the timed build is the first layer's cache
        base["cache_build_ms"] = measure.time_ms(lambda: caches.append(build()), dev, warmup=0, iters=1)["median_ms"]
        caches += [build() for _ in range(a.layers - 1)]
    del k, v
    base["cache_bytes_per_rank"] = sum(2 * c.k.numel() * c.k.element_size() for c in caches)
    kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    qn = torch.randn(b, 1, h, d, device=dev, dtype=dt, generator=gen)
    rows = []
    for be in backends:
        def step():
            for c in caches:
                c.attend(qn, k_new=kn, v_new=vn, backend=be, **(branches or {}))

        row = dict(base, backend=be)
        try:
            t = measure.time_ms(step, dev, warmup=a.warmup, iters=a.iters, batched=a.timing == "batched",
                                agree=None if g is None else _agree)
            _timed(row, t, a.layers, b, dev)
        except ValueError as e:  # a backend that cannot take the call says why, on every rank
            row.update(status="unsupported", reason=_failure(e))
        rows.append(row)
    return rows


def bench_sdpa(a, n: int, dev, dt, kernel: str, growing: bool = False) -> dict:
    """SDPA decoding over one layer's cache (the one-GPU baseline): the whole
    preallocated cache of ``n + 1`` tokens every step, or (``growing``) the
    first ``pos + 1`` tokens at step ``pos``, as a loop whose context grows
    does. ``kernel`` "default": SDPA's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, hkv, d = a.batch, a.heads, a.kv_heads, a.head_dim
    row = _head(a, n, dt, f"sdpa-{kernel}" + ("-growing" if growing else ""), kernel)
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}.get(kernel)
    _fresh(dev)
    try:
        gen = torch.Generator(device=dev).manual_seed(0)
        extra = a.warmup + 1 + 11 * a.iters + 8 if growing else 0  # as bench_longattn's reserve
        kc, vc = (torch.randn(b, hkv, n + 1 + extra, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
        kn, vn = (torch.randn(b, hkv, 1, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
        qn = torch.randn(b, h, 1, d, device=dev, dtype=dt, generator=gen)
        row["cache_bytes_per_rank"] = 2 * kc.numel() * kc.element_size()
        pos = [n]

        def step():
            p = pos[0]
            kc[:, :, p:p + 1] = kn  # the new token's K/V into the preallocated cache, as a static cache does
            vc[:, :, p:p + 1] = vn
            if growing:
                pos[0] += 1
            with (sdpa_kernel(which) if which is not None else contextlib.nullcontext()):
                return sdpa(qn, kc[:, :, :p + 1], vc[:, :, :p + 1], enable_gqa=hkv != h)

        with torch.no_grad():
            t = measure.time_ms(step, dev, warmup=a.warmup, iters=a.iters, batched=a.timing == "batched")
        _timed(row, t, 1, b, dev)
    except Exception as e:  # noqa: BLE001 - recorded, never filled in
        row.update(status="failed", reason=_failure(e))
    return row


def _captured(step):
    """``step`` captured in a CUDA graph (after warm-up calls on a side stream,
    which compile and plan); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


# The decode kernel benchmarks' shape: one query, batch 1, 32 query / 8 kv heads, D=128 (32q/8kv as Llama 3 8B)
KERNEL_HEADS, KERNEL_KV_HEADS, KERNEL_HEAD_DIM = 32, 8, 128


def kernel_case(n: int, dev, dt=torch.bfloat16):
    """The decode kernel benchmarks' call at context ``n``: ``(q, k_cache,
    v_cache, sdpa_call)``, q ``(1, 1, 32, 128)`` and token-major caches ``(1,
    n, 8, 128)`` (seeded); ``sdpa_call(SDPBackend.X)`` is a call of SDPA with
    that backend over head-major copies of the caches (``enable_gqa``), its
    output ``(1, 32, 1, 128)``."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device=dev).manual_seed(0)
    kc, vc = (torch.randn(1, n, KERNEL_KV_HEADS, KERNEL_HEAD_DIM, device=dev, dtype=dt, generator=g)
              for _ in range(2))
    q = torch.randn(1, 1, KERNEL_HEADS, KERNEL_HEAD_DIM, device=dev, dtype=dt, generator=g)
    kt, vt, qt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous(), q.transpose(1, 2)

    def sdpa_call(which):
        def call():
            with sdpa_kernel(which):
                return sdpa(qt, kt, vt, enable_gqa=True)
        return call
    return q, kc, vc, sdpa_call


def replayed_ms(fn, dev, iters: int, reps: int = 10) -> float:
    """Kernel time of one ``fn()`` call in ms: ``reps`` calls captured in one
    CUDA graph (:func:`_captured`), the replay timed (``measure.time_ms``,
    median of ``iters``), divided by ``reps``; a short call is otherwise
    bound by the host's launch time."""
    def calls():
        for _ in range(reps):
            fn()
    return measure.time_ms(_captured(calls), dev, warmup=2, iters=iters)["median_ms"] / reps


def bench_graphed(a, n: int, dev, dt) -> list[dict]:
    """One decode step captured in a CUDA graph and replayed, as a serving loop
    that captures its steps runs it (no host time): the new token's K/V into a
    preallocated ``(batch, n + 1, ...)`` cache, then attention over it, ours
    (``decode_attention``, lengths on the device) and SDPA's (flash, cuDNN;
    ``(batch, kv_heads, n + 1, head_dim)``) and FA4's split-KV forward where it is installed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    b, h, hkv, d = a.batch, a.heads, a.kv_heads, a.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=dt, generator=gen)
    qn, kn, vn = mk(b, 1, h, d), mk(b, 1, hkv, d), mk(b, 1, hkv, d)
    lens = torch.full((b,), n + 1, dtype=torch.int32, device=dev)

    def ours(kc, vc):
        kc[:, n:] = kn
        vc[:, n:] = vn
        return longattn.decode_attention(qn, kc, vc, cache_seqlens=lens)

    def theirs(kc, vc, which):
        kc[:, :, n:] = kn.transpose(1, 2)
        vc[:, :, n:] = vn.transpose(1, 2)
        with sdpa_kernel(which):
            return sdpa(qn.transpose(1, 2), kc, vc, enable_gqa=hkv != h)

    def fa4(kc, vc):  # the kernel itself, as dense_part's "fa4" engine calls it (lengths on the device)
        kc[:, n:] = kn
        vc[:, n:] = vn
        return _fa4_api.decode(qn, kc, vc, lens, n + 1, d ** -0.5, False)

    variants = [("longattn-graphed", "auto", (b, n + 1, hkv, d), ours)]
    variants += [(f"sdpa-{k}-graphed", k, (b, hkv, n + 1, d), lambda kc, vc, w=w: theirs(kc, vc, w))
                 for k, w in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))]
    if _fa4_api.problem() is None and not fa4_refusals(qn, qn):  # its split-KV forward (sm_100 only)
        variants.append(("fa4-graphed", "fa4", (b, n + 1, hkv, d), fa4))
    rows = []
    for impl, backend, shape, fn in variants:
        row = _head(a, n, dt, impl, backend)
        _fresh(dev)
        try:
            kc, vc = mk(*shape), mk(*shape)
            row["cache_bytes_per_rank"] = 2 * kc.numel() * kc.element_size()
            with torch.no_grad():
                replay = _captured(lambda: fn(kc, vc))
                t = measure.time_ms(replay, dev, warmup=a.warmup, iters=a.iters, batched=a.timing == "batched")
            _timed(row, t, 1, b, dev)
            del kc, vc, replay
        except Exception as e:  # noqa: BLE001 - recorded, never filled in
            row.update(status="failed", reason=_failure(e))
        rows.append(row)
    return rows


def format_table(rows) -> str:
    head = "| impl | backend | world | context | layers | prefill ms | decode ms/layer | tokens/s | cache MiB/rank |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r.get('backend')} | {r['world']} | {r['context']} | {r['layers']} | "
                         f"{r['status']}: {r.get('reason', '')} | | | |")
            continue
        pre = f"{r['prefill_ms']:.1f}" if r.get("prefill_ms") is not None else "-"
        lines.append(f"| {r['impl']} | {r.get('backend')} | {r['world']} | {r['context']} | {r['layers']} | {pre} | "
                     f"{r['decode_ms_per_layer']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['cache_bytes_per_rank'] / 2**20:.1f} |")
    return "\n".join(lines)


def run(a) -> dict:
    rank, world, dev = _init(one_rank=True)
    cuda = dev.type == "cuda"
    a.context = a.context or ([131072, 1048576] if cuda else [1024, 4096])
    a.heads = a.heads or (32 if cuda else 4)
    a.kv_heads = a.kv_heads or (8 if cuda else 2)
    a.head_dim = a.head_dim or (128 if cuda else 64)
    dt = DTYPES[a.dtype or ("bf16" if cuda else "fp32")]
    if not cuda and dt != torch.float32:
        dt = torch.float32  # CPU kernels have no fast half path
    backends = a.backend or (["auto", "triton", "fa4", "flash", "cudnn"] if cuda else ["auto"])
    branches = None if a.segment_lengths is None else dict(segment_lengths=a.segment_lengths,
                                                            dilation_rates=a.dilation_rates)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if rank == 0 else (lambda m: None)
    rows = []
    for n in a.context:
        for br in [None] + ([branches] if branches else []):
            log(f"decode: context {n}, {'dilated' if br else 'dense'}, world {world}, backends {backends}")
            try:
                rows += bench_longattn(a, n, dev, dt, world, backends, br)
            except Exception as e:  # noqa: BLE001 - under torchrun a rank out of memory stops the run
                if world > 1:
                    raise
                rows.append(dict(impl="longattn-dilated" if br else "longattn", backend=",".join(backends),
                                 world=world, context=n, layers=a.layers, status="failed", reason=_failure(e)))
        if world == 1 and not a.no_sdpa and cuda:
            for kernel in ("flash", "cudnn", "efficient"):
                log(f"decode: context {n}, sdpa-{kernel}")
                rows.append(bench_sdpa(a, n, dev, dt, kernel))
            for kernel in ("default", "cudnn"):
                log(f"decode: context {n}, sdpa-{kernel}-growing")
                rows.append(bench_sdpa(a, n, dev, dt, kernel, growing=True))
            log(f"decode: context {n}, steps captured in CUDA graphs (ours, sdpa-flash, sdpa-cudnn, fa4)")
            rows += bench_graphed(a, n, dev, dt)
    return dict(kind="decode", env=measure.environment(dev), world=world, timing=a.timing, results=rows)


def main(argv=None) -> int:
    a = parse(argv)
    res = run(a)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if a.json:
            a.json = measure.result_path(a.json)
            measure.write_json(a.json, res)
            print(f"wrote {a.json}", file=sys.stderr)
        print(format_table(res["results"]))
    if dist.is_initialized():
        dist.barrier()  # no rank tears down while a peer still talks to it
        dist.destroy_process_group()
    return 0
