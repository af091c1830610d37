"""Split-KV decoding (flash-decoding): the queries of the newest tokens over a
long KV cache, in one launch.

One query per kv-head group gives a dense kernel ``batch * nheads`` programs,
too few to stream a 128K-token cache at the memory's rate. Here the cache's
tokens are cut into splits and every (split, batch row, kv head) is one
program: it loads the ``q_len * G`` query rows that read this kv head (``G =
nheads // nheads_kv``: the cache is read once per kv head, whatever the
grouping), streams its split's keys and values once, and writes a float32
partial output and lse. The last program of a (batch row, kv head) to finish
(an arrival counter per pair) merges its splits by their lse and writes the
output: no second launch, no gap between two kernels on the step's critical
path. Rows may hold different lengths (one launch for the batch). Causal is
bottom-right: query ``i`` of row ``b`` sees the keys before
``lens[b] - q_len + i + 1``.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ._common import HAS_TRITON, LOG2E, d_pad, ieee, launchable
from .launch import _strides

# A traced launch's record per program: the global timer (ns) and the SM's
# cycle counter at the program's start, after its key loop, after its
# arrival, at its end (after the merge, for the program that merges), its SM,
# whether it merged
TRACE_FIELDS = 10

if HAS_TRITON:
    import triton
    import triton.language as tl

    try:  # host-side tensor descriptors (TMA): Triton 3.4 on
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - older Triton: the kernel reads through pointers
        TensorDescriptor = None

    from .attention_jit import _dot, _online_step

    # Lengths, split sizes and counts change every step: not specialised, so a
    # step captured in a CUDA graph finds the kernel compiled by a warm-up call.
    @triton.jit(do_not_specialize=["LEN", "SPLIT", "NSPLIT", "CAP", "ADV"])
    def _split_kernel(Q, K, V, KD, VD, OP, LP, O, L, CNT, LENS, TR, sln, LEN, CAP, ADV, NPAIR, sqb, sqs, sqh, skb,
                      sks, skh, svb, svs, svh, sob, sos, soh, slb, slh, HKV, LQ, SPLIT, NSPLIT, qk_scale,
                      G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                      S_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PER_ROW: tl.constexpr,
                      IEEE: tl.constexpr, HEADS_FAST: tl.constexpr, DESC: tl.constexpr, TRACE: tl.constexpr):
        if TRACE:
            g0, c0 = _clocks()
        qk_scale = tl.full([], qk_scale, tl.float32)
        # HEADS_FAST: programs launched next to each other read the kv heads of one
        # token range (adjacent bytes of the (B, S, Hkv, D) cache's rows) rather than
        # one head's next range
        s = tl.program_id(1) if HEADS_FAST else tl.program_id(0)
        bh = tl.program_id(0) if HEADS_FAST else tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        kh = (bh % HKV).to(tl.int64)
        if PER_ROW:
            # lengths read on the device (any row, a captured step): clamped to
            # the capacity, and each row cut into NSPLIT splits of its own
            # length, at least SPLIT tokens each, so every program has work;
            # ADV tokens appended since the lengths were written count
            raw = tl.load(LENS + b * sln) + ADV
            n = tl.minimum(raw, CAP)
            SPLIT = tl.maximum(SPLIT, ((n + NSPLIT - 1) // NSPLIT + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
        else:
            n = LEN
        rows = tl.arange(0, BLOCK_M)
        qi = rows // G
        head = kh * G + rows % G
        offs_d = tl.arange(0, D_PAD)
        dmask = offs_d < D
        row_ok = rows < LQ * G
        q = tl.load(Q + b * sqb + qi[:, None].to(tl.int64) * sqs + head[:, None] * sqh + offs_d[None, :],
                    mask=row_ok[:, None] & dmask[None, :], other=0.0)
        k_ptr = K + b * skb + kh * skh
        v_ptr = V + b * svb + kh * svh
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, n)
        last = n - LQ + qi  # causal: the last key row qi sees
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        b32, kh32 = b.to(tl.int32), kh.to(tl.int32)
        if DESC:
            # tensor descriptors (TMA on sm_90+): the split's whole tiles, then its last, partial one (slots
            # past the row's length hold anything, unwritten memory may be NaN: V is cleared there)
            full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
            for j in range(lo, full, BLOCK_N):
                acc, l_i, m_i = _kv_tile(q, acc, l_i, m_i, k_ptr, v_ptr, KD, VD, b32, kh32, sks, svs, offs_d, dmask, j,
                                         hi, last, offs_n, qk_scale, BLOCK_N, D_PAD, CAUSAL, IEEE, True, False)
            for j in range(full, hi, BLOCK_N):
                acc, l_i, m_i = _kv_tile(q, acc, l_i, m_i, k_ptr, v_ptr, KD, VD, b32, kh32, sks, svs, offs_d, dmask, j,
                                         hi, last, offs_n, qk_scale, BLOCK_N, D_PAD, CAUSAL, IEEE, True, True)
        else:  # pointer loads, every tile masked
            for j in range(lo, hi, BLOCK_N):
                acc, l_i, m_i = _kv_tile(q, acc, l_i, m_i, k_ptr, v_ptr, KD, VD, b32, kh32, sks, svs, offs_d, dmask, j,
                                         hi, last, offs_n, qk_scale, BLOCK_N, D_PAD, CAUSAL, IEEE, False, True)
        if TRACE:
            g1, c1 = _clocks()
        seen = l_i > 0.0
        lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = (bh * NSPLIT + s).to(tl.int64) * BLOCK_M + rows
        # the query rows only (a dot pads them to 16; the merge never reads the padding)
        tl.store(OP + part[:, None] * D_PAD + offs_d[None, :], acc / tl.where(seen, l_i, 1.0)[:, None],
                 mask=row_ok[:, None])
        tl.store(LP + part, lse2, mask=row_ok)
        # Last block reduces: every thread's stores above come before the
        # counter's release (the barrier, then one thread's acq_rel atomic at
        # gpu scope: CUTLASS's split-K semaphore pattern); the program that
        # arrives last acquires, so its reads of the other splits' partials
        # come after their stores. It puts the counter back to 0 for the next
        # launch (or graph replay): no zero-fill between calls.
        tl.debug_barrier()
        arrived = tl.atomic_add(CNT + bh, 1, sem="acq_rel", scope="gpu")
        if TRACE:
            g2, c2 = _clocks()
        if arrived == NSPLIT - 1:
            tl.store(CNT + bh, 0)
            _merge(OP, LP, O, L, sob, sos, soh, slb, slh, b, kh, (bh * NSPLIT).to(tl.int64), LQ, NSPLIT, G, D, D_PAD,
                   BLOCK_M, ROWS, S_CHUNK)
            if PER_ROW:
                if ADV != 0:
                    # The row's length is written back advanced by the last of its kv heads' merges (a
                    # counter per row after the pairs'): every program of the row has read it by then (each
                    # read comes before its pair's release, each pair's merge before the row's), so no
                    # program of this launch sees the new value and the step needs no launch of its own
                    done = tl.atomic_add(CNT + NPAIR + b, 1, sem="acq_rel", scope="gpu")
                    if done == HKV - 1:
                        tl.store(CNT + NPAIR + b, 0)
                        tl.store(LENS + b * sln, raw.to(LENS.dtype.element_ty))
        if TRACE:
            g3, c3 = _clocks()
            _trace(TR + (bh * NSPLIT + s).to(tl.int64) * _TRACE_FIELDS, g0, g1, g2, g3, c0, c1, c2, c3,
                   (arrived == NSPLIT - 1).to(tl.int64))

    _TRACE_FIELDS = tl.constexpr(TRACE_FIELDS)

    @triton.jit
    def _clocks():
        """(%globaltimer ns, comparable across SMs; %clock64 cycles, this SM's)."""
        zero = tl.full([], 0, tl.int32)  # inline asm takes at least one operand
        g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False,
                                      pack=1)
        c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [zero], dtype=tl.int64, is_pure=False,
                                      pack=1)
        return g, c

    @triton.jit
    def _trace(T, g0, g1, g2, g3, c0, c1, c2, c3, merged):
        zero = tl.full([], 0, tl.int32)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [zero], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(T + 0, g0)
        tl.store(T + 1, g1)
        tl.store(T + 2, g2)
        tl.store(T + 3, g3)
        tl.store(T + 4, c0)
        tl.store(T + 5, c1)
        tl.store(T + 6, c2)
        tl.store(T + 7, c3)
        tl.store(T + 8, sm.to(tl.int64))
        tl.store(T + 9, merged)

    @triton.jit
    def _kv_tile(q, acc, l_i, m_i, k_ptr, v_ptr, KD, VD, b32, kh32, sks, svs, offs_d, dmask, j, hi, last, offs_n,
                 qk_scale, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                 DESC: tl.constexpr, TAIL: tl.constexpr):
        """One key tile [j, j + BLOCK_N) of a split, cut at ``hi``, into the
        online softmax: through pointers (masked loads), or through the (B,
        capacity, Hkv, D) caches' descriptors (tiles past the capacity come
        back zero; ``TAIL``: the split's last tile, which may run past the
        row's length, its V cleared there)."""
        cols = j + offs_n
        kv_ok = cols < hi
        if DESC:
            j32 = tl.cast(j, tl.int32)  # descriptor coordinates are 32-bit (j follows the lengths' dtype)
            k = KD.load([b32, j32, kh32, 0]).reshape(BLOCK_N, D_PAD)
            v = VD.load([b32, j32, kh32, 0]).reshape(BLOCK_N, D_PAD)
            if TAIL:
                v = tl.where(kv_ok[:, None], v, 0.0)
        else:
            c64 = cols.to(tl.int64)
            k = tl.load(k_ptr + c64[:, None] * sks + offs_d[None, :], mask=kv_ok[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_ptr + c64[:, None] * svs + offs_d[None, :], mask=kv_ok[:, None] & dmask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale
        ok = kv_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= last[:, None])
        qk = tl.where(ok, qk, float("-inf"))
        return _online_step(acc, l_i, m_i, qk, v, qk, False, IEEE)

    @triton.jit
    def _merge(OP, LP, O, L, sob, sos, soh, slb, slh, b, kh, base, LQ, NSPLIT, G: tl.constexpr,
               D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
               S_CHUNK: tl.constexpr):
        """The splits of one (batch row, kv head) merged by their lse (base 2),
        online over chunks of S_CHUNK splits: one read of each partial, every
        query row at once. A row no split saw gives 0 and lse -inf (natural
        log). ``.cg`` loads (L2, not this SM's L1): other programs wrote them."""
        rows = tl.arange(0, ROWS)
        offs_d = tl.arange(0, D_PAD)
        sc = tl.arange(0, S_CHUNK)
        row_ok = rows < LQ * G
        top = tl.full([ROWS], float("-inf"), tl.float32)
        tot = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D_PAD], tl.float32)
        for s0 in range(0, NSPLIT, S_CHUNK):
            ss = s0 + sc
            ok = (ss < NSPLIT)[:, None] & row_ok[None, :]
            idx = (base + ss[:, None]) * BLOCK_M + rows[None, :]  # [S_CHUNK, ROWS]
            # the partials' loads issued together, before the lse's reductions (their barriers would
            # otherwise hold the outputs' loads back a second trip to L2)
            l2 = tl.load(LP + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(OP + idx[:, :, None] * D_PAD + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                        cache_modifier=".cg")
            new = tl.maximum(top, tl.max(l2, 0))
            new_safe = tl.where(new == float("-inf"), 0.0, new)
            w = tl.math.exp2(l2 - new_safe[None, :])
            keep = tl.math.exp2(top - new_safe)
            tot = tot * keep + tl.sum(w, 0)
            acc = acc * keep[:, None] + tl.sum(o * w[:, :, None], 0)
            top = new
        seen = tot > 0.0
        out = acc / tl.where(seen, tot, 1.0)[:, None]
        qi = (rows // G).to(tl.int64)
        head = kh * G + rows % G
        tl.store(O + b * sob + qi[:, None] * sos + head[:, None] * soh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d < D)[None, :])
        top = tl.where(top == float("-inf"), 0.0, top)
        lse = tl.where(seen, (top + tl.math.log2(tl.where(seen, tot, 1.0))) / 1.4426950408889634, float("-inf"))
        tl.store(L + b * slb + head * slh + qi, lse, mask=row_ok)


def block_m(q_len: int, group: int) -> int:
    """Query rows one split program holds (a dot needs at least 16)."""
    return max(16, 1 << (q_len * group - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are enough to exercise the splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits(lens_max: int, programs: int, device: torch.device, programs_per_sm: int, block_n: int,
           min_split: int) -> tuple[int, int]:
    """(tokens per split, number of splits): enough programs to fill the
    device ``programs_per_sm`` deep, no split shorter than ``min_split``, a
    split a whole number of ``block_n`` tiles."""
    want = max(1, -(-programs_per_sm * _sm_count(device) // programs))
    split = max(min_split, -(-max(lens_max, 1) // want))
    split = -(-split // block_n) * block_n
    return split, max(1, -(-max(lens_max, 1) // split))


def merge_chunk(rows: int, dp: int, num_warps: int, device: torch.device, floats_per_thread: int = 64) -> int:
    """Splits the merging program reads per step (a power of two): about
    ``floats_per_thread`` float32 of partial outputs per thread
    (``DecodeTuning.merge_floats_per_thread``)."""
    if device.type != "cuda":
        return 2  # the interpreter: chunks of two, so tiny calls merge across chunks too
    return 1 << max(1, floats_per_thread * 32 * num_warps // (rows * dp)).bit_length() - 1


# One arrival-counter workspace per device, grown (never shrunk, never freed)
# to the largest batch * nheads_kv launched. Every launch leaves it all zero
# (the merging program resets its pair's counter), so it needs no fill per
# call. A buffer that was outgrown stays alive: CUDA graphs captured earlier
# hold its address. Calls share it safely only in stream order: this library
# issues its decode calls (eager, captured or replayed) on one stream per
# device; two calls running at once on different streams would mix counts.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def counters(n: int, like: torch.Tensor) -> torch.Tensor:
    """At least ``n`` int32 zeros on ``like``'s device for the split programs' counters."""
    held = _COUNTERS.setdefault(like.device, [])
    if held and held[-1].numel() >= n:
        return held[-1]
    if (type(like) is not torch.Tensor or torch.compiler.is_compiling()
            or (like.is_cuda and torch.cuda.is_current_stream_capturing())):
        # Traced (fake tensors, torch.compile): a fill of the traced graph's
        # own. Under CUDA graph capture with no workspace large enough (a
        # capture before any eager call of that size): a fresh one whose fill is
        # captured before the kernel, so every replay fills it first (memory of
        # the graph's pool, like the partials). Not cached: a captured fill has
        # not run when the capture ends (an eager call could find it unfilled),
        # and a fill issued outside the capture, on another stream, would not
        # be ordered before the captured launch.
        return torch.zeros(n, dtype=torch.int32, device=like.device)
    with torch.inference_mode(False):
        held.append(torch.zeros(max(n, 2 * held[-1].numel() if held else 64), dtype=torch.int32,
                                device=like.device))
    return held[-1]


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: Optional[Sequence[int]],
           causal: bool, scale: float, *, block_n: int, num_warps: int, num_stages: int, programs_per_sm: int,
           min_split: int, lens_tensor: Optional[torch.Tensor] = None, ragged: Optional[bool] = None,
           heads_fastest: bool = False, descriptors: bool = False, merge_floats: int = 64,
           advance: int = 0, trace: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, Lq, H, D)`` over the first ``lens[b]`` slots of each row of the
    cache ``(B, capacity, Hkv, D)`` (any strides, unit stride in D). Returns
    out like q and lse ``(B, H, Lq)`` float32; a row with no key gives 0 and
    -inf. ``lens_tensor``: the lengths as int32 on q's device, when the caller
    has them there (read by the kernel; else built here for rows of different
    lengths). Lengths read on the device cut each row into the launch's
    splits by its own length. ``lens`` None: the lengths are known on the
    device only (CUDA graph capture): the launch is sized for the whole
    capacity, the same whatever the lengths. ``ragged``: whether ``lens``
    differ, when the caller knows (else found here). ``descriptors``: the
    kernel reads K and V through tensor descriptors (TMA on sm_90+) where
    the caches allow it (:func:`descriptor_refusals`), else through pointers.
    ``merge_floats``: float32 of the partials each thread of the merging
    program reads per step (:func:`merge_chunk`;
    ``DecodeTuning.merge_floats_per_thread`` sets it for the GPU's tiles).
    ``advance``: tokens appended since ``lens_tensor`` was written (a CUDA
    graph's step): the launch attends over ``lens_tensor + advance`` keys per
    row and leaves ``lens_tensor`` advanced by that many (written once every
    program has read it), with no launch of its own.
    ``trace``: an int64 tensor on q's GPU of at least :func:`trace_size`
    elements that the launch fills with each program's timeline (a
    diagnostic, ``benchmarks/decode_kernel_timeline.py``; ``TRACE_FIELDS``
    per program)."""
    b, lq, h, d = q.shape
    hkv = k_cache.shape[2]
    if advance and (lens_tensor is None or lens_tensor.dim() != 1 or lens_tensor.shape[0] != b
                    or (b > 1 and lens_tensor.stride(0) == 0)):
        raise ValueError(f"advance={advance} needs lens_tensor, the lengths on the device that the launch "
                         f"advances: one element of its own per batch row ({b}), got "
                         f"{None if lens_tensor is None else (tuple(lens_tensor.shape), lens_tensor.stride())}; pass "
                         f"them so, or advance=0 with the lengths already counting the tokens")
    g = h // hkv
    bm = block_m(lq, g)
    dp = d_pad(d)
    # lengths on the device: read there, the same launch as under capture
    per_row = lens is None or lens_tensor is not None or (len(set(lens)) > 1 if ragged is None else ragged)
    if per_row and lens_tensor is None:
        lens_tensor = torch.tensor(list(lens), dtype=torch.int32, device=q.device)
    longest = k_cache.shape[1] if lens is None else max(lens)
    split, nsplit = splits(longest, b * hkv, q.device, programs_per_sm, block_n, min_split)
    if per_row:  # the split per row is found on the device, from this floor
        split = -(-min_split // block_n) * block_n
    op = torch.empty(b * hkv * nsplit * bm, dp, dtype=torch.float32, device=q.device)
    lp = torch.empty(b * hkv * nsplit * bm, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    rows = 1 << (lq * g - 1).bit_length()
    desc = descriptors and not descriptor_refusals(k_cache, v_cache)
    kd, vd = (TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_n, 1, dp]) if desc else x
              for x in (k_cache, v_cache))
    if trace is not None and (trace.device != q.device or not trace.is_cuda or trace.dtype != torch.int64
                              or trace.numel() < b * hkv * nsplit * TRACE_FIELDS):
        raise ValueError(f"trace must be an int64 CUDA tensor on q's device ({q.device}) of at least "
                         f"trace_size(...) = {b * hkv * nsplit * TRACE_FIELDS} elements (the timers are read by "
                         f"PTX), got {trace.dtype} on {trace.device} with {trace.numel()}")
    launchable(_split_kernel, q)[(b * hkv, nsplit) if heads_fastest else (nsplit, b * hkv)](
        # counters: one per (batch row, kv head) pair, then one per row where the lengths advance
        q, k_cache, v_cache, kd, vd, op, lp, out, lse, counters(b * hkv + (b if advance else 0), q),
        lens_tensor if per_row else q, q if trace is None else trace, lens_tensor.stride(0) if per_row else 0,
        0 if per_row else lens[0], k_cache.shape[1], advance, b * hkv,
        *_strides(q, k_cache, v_cache, out), lse.stride(0), lse.stride(1), hkv, lq, split, nsplit, scale * LOG2E,
        G=g, D=d, D_PAD=dp, BLOCK_M=bm, ROWS=rows,
        S_CHUNK=merge_chunk(rows, dp, num_warps, q.device, merge_floats),
        BLOCK_N=block_n, CAUSAL=causal and lq > 1, PER_ROW=per_row, IEEE=ieee(q), HEADS_FAST=heads_fastest,
        DESC=desc, TRACE=trace is not None, num_warps=num_warps, num_stages=num_stages)
    return out, lse


def trace_size(lens_max: int, batch: int, nheads_kv: int, device: torch.device, programs_per_sm: int,
               block_n: int, min_split: int) -> int:
    """Elements of the ``trace`` tensor a launch with these sizes fills (per
    program, ``TRACE_FIELDS``, in launch-grid order ``(batch * nheads_kv) x
    splits``)."""
    return batch * nheads_kv * splits(lens_max, batch * nheads_kv, device, programs_per_sm, block_n, min_split)[1] \
        * TRACE_FIELDS


def descriptor_refusals(k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[str]:
    """Why the split kernel cannot read these caches through tensor
    descriptors: TMA's rules (16-byte aligned base and strides) and a tile of
    the whole head dim (a power of two)."""
    why = []
    if not HAS_TRITON or TensorDescriptor is None:
        why.append("this Triton has no host tensor descriptors (triton.tools.tensor_descriptor, Triton 3.4 on)")
    if 0 in k_cache.shape:
        why.append("an empty cache (a descriptor needs every dim positive)")
    d = k_cache.shape[-1]
    if d != d_pad(d):
        why.append(f"head dim {d} is not a power of two")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.data_ptr() % 16 or any(st * x.element_size() % 16 for st in x.stride()[:-1]):
            why.append(f"{name}'s base or strides are not 16-byte aligned")
    return why


def refusals(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_rows: int) -> list[str]:
    """Why the split-KV kernel cannot take this call beyond what keeps any of
    our Triton kernels from ``q`` (``BACKENDS["triton"].kernel_refusals``:
    dtype, availability, head dim); empty: it can."""
    r = []
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    if rows > max_rows:
        r.append(f"q_len * (nheads // nheads_kv) = {rows} query rows per kv head exceed {max_rows} "
                 f"(a prefill-sized call: the dense kernels take it)")
    if any(x.stride(-1) != 1 for x in (q, k_cache, v_cache)):
        r.append("the head dim must have unit stride")
    return r
