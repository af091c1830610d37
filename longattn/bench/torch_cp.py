"""torch's context parallelism as `dist` rows, at its best, and the flex rows.

``torch-cp``: ``torch.distributed.tensor.experimental.context_parallel``
around SDPA with ``enable_gqa`` (K/V keep their own head count; the ring
rotates the smaller K/V), torch's head-tail load balancer for causal calls
(it refuses non-causal ones), the rotate method ("allgather" or "alltoall")
that measures faster in the run (both timed briefly first), and the SDPA
kernel that measures faster: cuDNN, or the flash backend, switched to
FlashAttention-4 where torch can (``activate_flash_attention_impl("FA4")``,
flash-attn-4 installed) as a user with FA4 would; the one SDPA runs is
recorded. The row records all of it (``torch_cp`` field). ``torch-cp-flex``: its FlexAttention
path (K/V all-gathered, head-tail balanced).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import longattn

from .configs import Config
from .patterns import flex_mask

ROTATE_METHODS = ("allgather", "alltoall")


def torch_cp_reason(cfg: Config, dev) -> Optional[str]:
    """Why torch's context_parallel cannot run ``cfg`` on ``dev`` (None: it can)."""
    if dev.type != "cuda":
        return ("torch's context_parallel shards only SDPA's flash, efficient and cuDNN kernels, which exist on "
                "CUDA alone (CPU SDPA takes another kernel that it does not shard)")
    if cfg.kind == "varlen":
        return "torch's context_parallel has no packed-document (varlen) mode"
    if cfg.window != (-1, -1):
        return "torch's context_parallel has no sliding window"
    return None


def cp_sdpa_inputs(q, k, v):
    """(B, S, H, D) q, k, v -> the (B, H, S, D) buffers torch's CP shards, and
    SDPA's ``enable_gqa``: K/V keep their own head count (never repeated)."""
    qb, kb, vb = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return (qb, kb, vb), kb.shape[1] != qb.shape[1]


def sdpa_backends(first: str = "cudnn"):
    """SDPA's backends in the order torch's CP is tried with: ``first``
    ("cudnn" or "flash"), then the others of the three kernels CP shards."""
    from torch.nn.attention import SDPBackend

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return order if first == "cudnn" else [order[1], order[0], order[2]]


def fa4_flash(dev: torch.device) -> Optional[str]:
    """Switch SDPA's flash backend to FlashAttention-4 where torch, the device
    and the installed packages allow it; returns None when switched, else why not."""
    import importlib.util

    if dev.type != "cuda":
        return f"FA4 runs on CUDA GPUs, not {dev.type}"

    act = getattr(torch.nn.attention, "activate_flash_attention_impl", None)
    if act is None:
        return f"torch {torch.__version__} cannot switch SDPA's flash backend"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "flash-attn-4 is not installed"
    try:
        act("FA4")
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on with cuDNN and FA2
        return f"activate_flash_attention_impl('FA4') failed: {type(e).__name__}: {e}"
    return None


def fa4_flash_off() -> None:
    restore = getattr(torch.nn.attention, "restore_flash_attention_impl", None)
    if restore is not None:
        restore()


def sdpa_choice(q, k, v, causal: bool, gqa: bool) -> str:
    """The SDPA backend a call with these (local) tensors takes under the
    active ``sdpa_kernel`` (torch's own choice function)."""
    from torch.nn.attention import SDPBackend

    try:
        code = torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=None, enable_gqa=gqa)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return f"unknown ({type(e).__name__})"
    names = {int(m.value): n.lower() for n, m in SDPBackend.__members__.items()}
    return names.get(int(code), str(code))


def load_balanced(cfg: Config, seqlen: int, world: int) -> bool:
    """torch's default head-tail balancer applies: causal (it refuses others)
    and the sequence splits in 2 x ranks chunks."""
    return bool(cfg.causal) and seqlen % (2 * world) == 0


def run_torch_cp(cfg: Config, make, dev, time_pair, allmax, *, warmup: int, iters: int, backward: bool,
                 batched: bool, label: str, probe_iters: int = 3):
    """((fwd ms, fwd+bwd ms, peak fwd, peak fwd+bwd, host fwd, host fwd+bwd), info):
    torch's context_parallel timed with ``time_pair`` (dist's timer) after each
    rotate method was timed ``probe_iters`` calls; ``allmax`` agrees a figure
    over the ranks, so every rank keeps the same method."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import sdpa_kernel

    world = dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,))
    q, k, v = make()
    seqlen = q.shape[1]
    (qb, kb, vb), gqa = cp_sdpa_inputs(q, k, v)
    del q, k, v
    info = dict(enable_gqa=gqa, kv_heads=kb.shape[1], load_balance=load_balanced(cfg, seqlen, world))
    old_balance, old_rotate = _cp_options.enable_load_balance, _cp_options.rotate_method
    _cp_options.enable_load_balance = info["load_balance"]  # read by context_parallel on entry
    # Looked up at each call: context_parallel swaps the function in torch.nn.functional while it is active, so a
    # reference taken before the context would call plain SDPA on the local shard.
    sdpa = lambda *a, **kw: torch.nn.functional.scaled_dot_product_attention(*a, **kw)
    why_no_fa4 = fa4_flash(dev)
    info["flash_impl"] = "FA4" if why_no_fa4 is None else f"FA2 ({why_no_fa4})"
    try:
        # One context for every probe and the timed calls: it shards the buffers in place on entry, so the
        # tensors the calls read (the grad-requiring copies too) must be made inside it.
        with context_parallel(mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2]):
            fwd = lambda: sdpa(qb, kb, vb, is_causal=cfg.causal, enable_gqa=gqa)
            step = None
            if backward:
                qg, kg, vg = (x.detach().requires_grad_() for x in (qb, kb, vb))
                dout = torch.randn_like(qb)

                def step():
                    sdpa(qg, kg, vg, is_causal=cfg.causal, enable_gqa=gqa).backward(dout)
                    qg.grad = kg.grad = vg.grad = None

            def probe_ms(first: str, method: str, what: str) -> float:
                """Median ms over every rank; inf where torch's CP fails with this kernel (every rank
                fails alike, and the inf still goes through ``allmax``, so no rank waits alone)."""
                set_rotate_method(method)
                try:
                    with sdpa_kernel(sdpa_backends(first), set_priority=True):
                        t = time_pair(fwd, step, dev, 1, probe_iters, batched, f"{label} {what}")
                    ms = t[1] if step is not None else t[0]
                except Exception as e:  # noqa: BLE001 - recorded in the row, the faster working kernel is kept
                    info.setdefault("probe_errors", {})[what] = f"{type(e).__name__}: {e}"[:200]
                    ms = float("inf")
                return allmax(ms)

            kernels = {first: probe_ms(first, ROTATE_METHODS[0], f"sdpa {first}") for first in ("cudnn", "flash")}
            if why_no_fa4 is None and kernels["flash"] == float("inf"):
                # torch's CP ring unpacks the flash op's outputs itself; where FA4 behind that op breaks it,
                # a user keeps SDPA's own flash kernel
                fa4_flash_off()
                why_no_fa4 = "torch's context_parallel failed with SDPA's flash switched to FA4"
                info["flash_impl"] = f"FA2 ({why_no_fa4})"
                kernels["flash"] = probe_ms("flash", ROTATE_METHODS[0], "sdpa flash (FA2)")
            if min(kernels.values()) == float("inf"):
                raise RuntimeError("torch's context_parallel failed with every SDPA kernel: "
                                   f"{info.get('probe_errors', 'on another rank')}")
            info["sdpa_probe_ms"] = kernels
            first = min(kernels, key=kernels.get)
            probe = {ROTATE_METHODS[0]: kernels[first]}
            probe.update({m: probe_ms(first, m, f"rotate {m}") for m in ROTATE_METHODS[1:]})
            info["rotate_probe_ms"] = probe
            info["rotate_method"] = min(ROTATE_METHODS, key=lambda m: probe[m])
            set_rotate_method(info["rotate_method"])
            with sdpa_kernel(sdpa_backends(first), set_priority=True):
                info["sdpa_backend"] = sdpa_choice(qb, kb, vb, cfg.causal, gqa)
                if info["sdpa_backend"] == "flash_attention" and why_no_fa4 is None:
                    info["sdpa_backend"] = "flash_attention (FA4)"
                return time_pair(fwd, step, dev, warmup, iters, batched, label), info
    finally:
        _cp_options.enable_load_balance, _cp_options.rotate_method = old_balance, old_rotate
        if why_no_fa4 is None:
            fa4_flash_off()


FLEX_DIST_IMPLS = ("flex-ring", "flex-ring-contiguous", "flex-exchange", "torch-cp-flex")
"""`dist` rows of flex configs: ring_flex_attention's ring (zigzag, contiguous), its exchange
engine (zigzag: sparse K/V halos and shipped dense query rows; ``flex-exchange:FIELD=VALUE,...``
under a FlexExchangeTuning of those fields) and torch's
context_parallel with FlexAttention; T_single is the fastest one-device form (FA4 with the
pattern's mask where it runs, else torch's compiled FlexAttention)."""


def exchange_tuning(impl: str):
    """``flex-exchange:FIELD=VALUE,...``: the exchange under
    ``FlexExchangeTuning(FIELD=VALUE, ...)`` (bools as 0/1), the measurement
    behind a field; ``flex-exchange``: ``None`` (the library's tuning).
    Raises ValueError naming a field that is not one or a value that does not parse."""
    import dataclasses

    from .. import tuning

    name, colon, spec = impl.partition(":")
    if name != "flex-exchange" or not colon:
        return None
    if not spec:
        raise ValueError(f"{impl}: name the fields after the colon, flex-exchange:FIELD=VALUE,...")
    types = {f.name: f.type for f in dataclasses.fields(tuning.FlexExchangeTuning)}
    conv = {"bool": lambda x: {"0": False, "1": True}[x], "int": int, "float": float}
    fields = {}
    for item in spec.split(","):
        field, eq, value = item.partition("=")
        if field not in types:
            raise ValueError(f"{impl}: FlexExchangeTuning has no field {field!r}; fields: {', '.join(types)}")
        if field in fields or not eq:
            raise ValueError(f"{impl}: give each field once, as FIELD=VALUE ({field!r})")
        kind = getattr(types[field], "__name__", types[field])
        try:
            fields[field] = conv[kind](value)
        except (KeyError, ValueError):
            raise ValueError(f"{impl}: {field}={value!r} is not a {kind}" + (" (0 or 1)" if kind == "bool" else "")
                             ) from None
    return tuning.FlexExchangeTuning(**fields)


def flex_dist_reason(cfg: Config, impl: str, dev) -> Optional[str]:
    import torch.distributed as dist

    if impl.partition(":")[0] not in FLEX_DIST_IMPLS or (":" in impl and not impl.startswith("flex-exchange:")):
        return f"flex configs run {', '.join(FLEX_DIST_IMPLS)} (flex-exchange:FIELD=VALUE,... a FlexExchangeTuning)"
    try:
        exchange_tuning(impl)
    except (ValueError, TypeError) as e:
        return str(e)
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
    engine = "exchange" if impl.startswith("flex-exchange") else "ring"
    mask = flex_mask(cfg, q.device)
    shards = tuple(longattn.shard(x, layout=layout) for x in (q, k, v))
    tune = exchange_tuning(impl)
    return (lambda q_, k_, v_: longattn.ring_flex_attention(q_, k_, v_, mask_mod=mask, layout=layout,
                                                            engine=engine, tuning=tune)), shards


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
