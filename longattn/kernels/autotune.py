"""Per-shape tile choice of the dilated Triton launches.

A dilated launch picks its tiles per (kind, device, dtype, head dim, GQA
group, rows per segment class and batch x heads x segments, each rounded up to
a power of two, causal): the first call of a new shape times the candidates
below on scratch buffers (the real outputs are accumulated in place, so a
trial must not touch them) and keeps the fastest. The grid's size is in the
key because small grids fill the GPU only with small tiles (one H100: at 32K
the LongNet branches of 1-2 segments ran faster with 64-row tiles, at 128K
slower). A trial covers all segments up to ``scratch_bytes`` of scratch.

Dense and varlen launches and mode ``"0"`` use the static table
(:mod:`.geometry`); calls under torch.compile tracing or CUDA-graph capture use
a choice made before (in this process or saved), else the static table.
Choices persist in ``<cache_dir>/triton_tiles.json``, keyed also by the GPU's
name, the Triton version and a hash of the kernels' source: tuning compiles
every candidate for every branch (one H100: 1.5 min for the LongNet branches'
first fwd+bwd at 32K, 4-5x the untuned first call) and is paid once per machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from typing import Callable, Optional

import torch

from .._config import ENV
from ._common import HAS_TRITON
from .geometry import static_tiles

if HAS_TRITON:
    import triton

_C = lambda m, n, w, s: dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
# Head dims <= 128: the tiles the autotuner chose on one H100 over the LongNet, GQA,
# D=64 and short-segment cases (triton_autotune_ab_h100_8da1ef7.json), out of an H200
# sweep's five per kind: fewer candidates, less tuning.
CANDIDATES = {
    "fwd": [_C(128, 128, 8, 3), _C(128, 64, 8, 3), _C(64, 64, 4, 3), _C(128, 32, 4, 4)],
    "dkdv": [_C(32, 64, 4, 3), _C(32, 128, 4, 3), _C(64, 128, 8, 3)],
    "dq": [_C(128, 64, 8, 3), _C(128, 32, 4, 3), _C(64, 32, 4, 3)],
}
CPU_CANDIDATES = [_C(16, 16, 4, 1), _C(32, 16, 4, 1), _C(16, 32, 4, 1)]  # the interpreter (tests)


def _source_hash() -> str:
    from . import attention_jit, grouped_jit, ranges_jit

    h = hashlib.sha1()
    for mod in (attention_jit, grouped_jit, ranges_jit):
        with open(mod.__file__, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def time_ms(fn, device: torch.device) -> float:
    """Fastest of five runs after one warm-up (compiling) run, in ms."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return min(times)


class Autotuner:
    """Tile choices of the dilated launches (see the module docstring).

    Args:
        mode: ``"1"`` on (also under the CPU interpreter), ``"0"`` off, ``""``
            on for CUDA (default: ``LONGATTN_TRITON_AUTOTUNE``).
        cache_dir: where choices persist (default: ``LONGATTN_CACHE_DIR``).
        timer: ``timer(fn, device) -> ms`` for a trial (default: CUDA events).
        scratch_bytes: most output scratch one trial allocates.
    """

    def __init__(self, mode: Optional[str] = None, cache_dir: Optional[str] = None,
                 timer: Optional[Callable] = None, scratch_bytes: int = 256 << 20):
        self.mode = ENV.triton_autotune if mode is None else mode
        self.cache_dir = cache_dir or ENV.cache_dir
        self.timer = timer or time_ms
        self.scratch_bytes = scratch_bytes
        self.by_shape: dict = {}  # tune key -> config, this process
        self._on_disk: Optional[dict] = None
        self._announced = False

    @property
    def cache_file(self) -> str:
        return os.path.join(self.cache_dir, "triton_tiles.json")

    def on(self, q: torch.Tensor) -> bool:
        return self.mode == "1" or (self.mode != "0" and q.is_cuda)

    def config(self, kind: str, q, k, geo, trial) -> dict:
        """The launch config of a kernel; ``trial(cfg, nseg)`` runs it on scratch."""
        static = static_tiles(q.shape[-1], q.device, kind)
        big = geo.dilated and max(static["BLOCK_M"], static["BLOCK_N"]) > 1 << max(4, (geo.max_m - 1).bit_length())
        if big or not _divides(geo, static):
            static = candidates(kind, q.shape[-1], q.device, geo)[0]  # tiles no larger than the rows
        if not geo.dilated or not self.on(q):
            return static
        key = tune_key(kind, q, k, geo)
        cfg = self.by_shape.get(key)
        if cfg is None:
            disk = _disk_key(key, q.device)
            cfg = self._persisted().get(disk)
            if cfg is None and _can_time(q):
                self._announce()
                cfg = self._tune(candidates(kind, q.shape[-1], q.device, geo), trial, self._trial_segments(q, geo),
                                 q.device) or static
                self._persist(disk, cfg)
            if cfg is not None:
                self.by_shape[key] = cfg
        return cfg or static

    def _announce(self) -> None:
        """Once per tuner: a first call that stalls for a minute says why."""
        if not self._announced:
            self._announced = True
            warnings.warn("longattn: autotuning the fused Triton dilated kernels' tiles for a new shape (a minute "
                          f"or two, once per machine: saved to {self.cache_file}); LONGATTN_TRITON_AUTOTUNE=0 skips it",
                          stacklevel=4)

    def _persisted(self) -> dict:
        if self._on_disk is None:
            try:
                with open(self.cache_file) as fh:
                    self._on_disk = json.load(fh)
            except (OSError, ValueError):
                self._on_disk = {}
        return self._on_disk

    def _persist(self, disk_key: str, cfg: dict) -> None:
        """Adds one choice to the cache file (re-read first: other processes may
        have added theirs), written atomically."""
        path = self.cache_file
        self._on_disk = None
        merged = dict(self._persisted(), **{disk_key: cfg})
        self._on_disk = merged
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(merged, fh, indent=0)
            os.replace(tmp, path)
        except OSError as e:
            warnings.warn(f"longattn: cannot save Triton tile choices to {path} ({e}); set LONGATTN_CACHE_DIR")

    def _trial_segments(self, q, geo) -> int:
        """Segments a trial runs: all of them (the real grid), or as many as
        ``scratch_bytes`` of output scratch hold (grids that large are many
        waves; the first segments stand for the rest)."""
        if q.device.type == "cpu":
            return 1
        per_seg = q.shape[0] * min(geo.w, geo.sq) * q.shape[2] * q.shape[3] * q.element_size()
        return max(1, min(geo.nseg, self.scratch_bytes // per_seg))

    def _tune(self, cands: list[dict], trial, nseg: int, device: torch.device) -> Optional[dict]:
        if len(cands) == 1:
            return cands[0]
        best = None
        for cfg in cands:
            try:
                t = self.timer(lambda: trial(cfg, nseg), device)
            except triton.runtime.errors.OutOfResources:  # this tile does not fit the device: not a candidate
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        return None if best is None else best[1]


_defaults: dict = {}


def default_tuner(mode: str = "") -> Autotuner:
    """The process's tuner for ``mode`` ('' : the environment's, see
    longattn._config; '0' / '1'); choices persist in the one cache file."""
    if mode not in _defaults:
        _defaults[mode] = Autotuner(mode or None)
    return _defaults[mode]


def _can_time(q: torch.Tensor) -> bool:
    """Real tensors, outside tracing and CUDA-graph capture."""
    if type(q) not in (torch.Tensor, torch.nn.Parameter) or torch.compiler.is_compiling():
        return False
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def _divides(geo, cfg: dict) -> bool:
    """A deduplicated branch's tiles lie inside one of its sub-blocks."""
    inner = getattr(geo, "inner", 0)
    return not inner or (inner % cfg["BLOCK_M"] == 0 and inner % cfg["BLOCK_N"] == 0)


def candidates(kind: str, d: int, device: torch.device, geo) -> list[dict]:
    if device.type == "cpu":
        cands = [c for c in CPU_CANDIDATES if _divides(geo, c)]
        return cands or [_C(16, 16, 4, 1)]
    if d > 128:
        cands = [static_tiles(d, device, kind)]
    else:
        rows = 1 << max(4, (max(geo.max_m, 1) - 1).bit_length())
        cands = CANDIDATES[kind.removeprefix("grouped_")]
        fit = [c for c in cands if c["BLOCK_M"] <= rows and c["BLOCK_N"] <= rows]
        cands = fit or [min(cands, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"])]
    fit = [c for c in cands if _divides(geo, c)]
    if fit:
        return fit
    # dedup_chain makes every sub-block a multiple of 16 rows
    side = min(64, getattr(geo, "inner", 16) & -getattr(geo, "inner", 16))
    return [_C(side, side, 4, 2)]


def tune_key(kind, q, k, geo):
    pow2 = lambda n: (max(n, 1) - 1).bit_length()
    return (kind, str(q.device), q.dtype, q.shape[-1], q.shape[2] // k.shape[2], bool(getattr(geo, "inner", 0)),
            pow2(geo.max_m), pow2(q.shape[0] * q.shape[2] * geo.nseg), geo.causal)


_hash: list = []


def _disk_key(key, device: torch.device) -> str:
    if not _hash:
        _hash.append(_source_hash())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return json.dumps([name, triton.__version__, _hash[0], key[0], str(key[2]), *key[3:]])


def trial_rows(geo, nseg: int) -> int:
    return min(geo.sq, nseg * geo.w)


def scratch(x: torch.Tensor, geo, nseg: int) -> torch.Tensor:
    """(B, rows of the first nseg segments, H, D) buffer like x."""
    return torch.zeros((x.shape[0], trial_rows(geo, nseg), *x.shape[2:]), dtype=x.dtype, device=x.device)


def scratch_lse(lse: torch.Tensor, geo, nseg: int) -> torch.Tensor:
    return torch.full((*lse.shape[:2], trial_rows(geo, nseg)), float("-inf"), dtype=lse.dtype, device=lse.device)
