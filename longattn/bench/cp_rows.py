"""`dist` rows of Ulysses, the Ulysses x ring hybrid and document-aware
sharding (``packed-balanced``: :func:`longattn.packed_attention` on the plan
of :func:`longattn.shard_documents`, varlen configs): the mesh option
(``hybrid:UxR``), why a row cannot run a config, the call and its shards."""
from __future__ import annotations

import functools
from typing import Optional

import torch.distributed as dist

import longattn

from .configs import Config
from .impls import varlen_cu_seqlens

CP_IMPLS = ("ulysses", "hybrid", "hybrid-contiguous", "packed-balanced")


def parse_mesh(text: str) -> tuple[int, int]:
    """"UxR" -> (ulysses ranks, ring ranks)."""
    u, _, r = str(text).partition("x")
    if not (u.isdigit() and r.isdigit() and int(u) > 0 and int(r) > 0):
        raise ValueError(f"mesh {text!r}: write UxR, ulysses ranks x ring ranks, e.g. 2x2 or 8x1")
    return int(u), int(r)


def with_mesh(impls, mesh: Optional[str]):
    """Bare ``hybrid`` / ``hybrid-contiguous`` names get the ``--mesh`` shape: ``hybrid:2x2``."""
    if impls is None or mesh is None:
        return impls
    parse_mesh(mesh)
    return [f"{i.partition('+')[0]}:{mesh}{i.partition('+')[1]}{i.partition('+')[2]}"
            if i.partition("+")[0] in ("hybrid", "hybrid-contiguous") else i for i in impls]


def _cp_reason(cfg: Config, impl: str) -> Optional[str]:
    """Why ``ulysses`` / ``hybrid[-contiguous]:UxR`` cannot run ``cfg`` on this world (None: it can)."""
    world = dist.get_world_size()
    name, _, mesh = impl.partition("+")[0].partition(":")
    if name == "packed-balanced":
        return None if cfg.kind == "varlen" else "packed-balanced runs packed documents (varlen configs) only"
    if name == "ulysses":
        u, r = world, 1
    elif not mesh:
        return f"{name} needs a mesh: --mesh UxR (U ulysses x R ring ranks = {world}) or --impl {name}:UxR"
    else:
        try:
            u, r = parse_mesh(mesh)
        except ValueError as e:
            return str(e)
        if u * r != world:
            return f"mesh {mesh} has {u * r} ranks, the run {world}"
    if cfg.heads % u:
        return f"{cfg.heads} heads do not split over {u} ulysses ranks (nheads must be divisible by U)"
    return None


@functools.lru_cache(maxsize=None)  # one mesh (and its process groups) per shape for the whole run
def _mesh(device_type: str, u: int, r: int):
    from torch.distributed.device_mesh import init_device_mesh

    # ulysses ranks consecutive (the GPUs of a node under torchrun), ring across them
    return init_device_mesh(device_type, (r, u), mesh_dim_names=("ring", "ulysses"))


def _cp_call(cfg, impl, q, k, v, dev):
    """(fn, local shards) of ``ulysses`` / ``hybrid[-contiguous]:UxR``."""
    name, _, shape = impl.partition(":")
    kw = dict(causal=cfg.causal, window_size=cfg.window)
    cu = varlen_cu_seqlens(cfg.with_overrides(seqlen=q.shape[1]), dev) if cfg.kind == "varlen" else None
    if name == "packed-balanced":
        plan = longattn.shard_documents(cu)
        fn = lambda q_, k_, v_: longattn.packed_attention(q_, k_, v_, plan, **kw)
        return fn, [plan.shard(x.flatten(0, 1)) for x in (q, k, v)]
    if name == "ulysses":
        if cu is None:
            fn = lambda q_, k_, v_: longattn.ulysses_attention(q_, k_, v_, **kw)
            return fn, [longattn.shard(x) for x in (q, k, v)]
        fn = lambda q_, k_, v_: longattn.ulysses_attention_varlen(q_, k_, v_, cu, **kw)
        return fn, [longattn.shard_varlen(x.flatten(0, 1), cu, layout="contiguous")[0] for x in (q, k, v)]
    mesh, layout = _mesh(dev.type, *parse_mesh(shape)), "contiguous" if name == "hybrid-contiguous" else "zigzag"
    if cu is None:
        fn = lambda q_, k_, v_: longattn.context_parallel_attention(q_, k_, v_, mesh=mesh, layout=layout, **kw)
        return fn, [longattn.shard_for_mesh(x, mesh, layout=layout) for x in (q, k, v)]
    fn = lambda q_, k_, v_: longattn.context_parallel_attention_varlen(q_, k_, v_, cu, mesh=mesh, layout=layout,
                                                                       **kw)
    return fn, [longattn.shard_varlen_for_mesh(x.flatten(0, 1), cu, mesh, layout=layout)[0] for x in (q, k, v)]


def packed_model(cfg: Config, seqlen: int, world: int, elt_bytes: int) -> dict:
    """What ``packed-balanced`` should cost on each rank, from its plan alone
    (the row records it beside the measurement): attention work (query-key
    pairs computed, causal halves included), local tokens, and the bytes a
    rank receives in the forward (the split documents' K/V all-gather) and
    the backward (the same gather, then the K/V gradients' reduce-scatter in
    float32). ``predicted_efficiency`` = mean work / largest work: the
    efficiency when the kernels' time follows their pairs and nothing else
    costs; ``token_balance`` = mean tokens / ``local_tokens`` (every rank's
    padded count): the bound where time follows tokens (short documents,
    whose rows cost about as much as their pairs)."""
    cu = varlen_cu_seqlens(cfg.with_overrides(seqlen=seqlen), "cpu")
    plans = [longattn.shard_documents(cu, world, r) for r in range(world)]
    lens = {d: plans[0].cu[d + 1] - plans[0].cu[d] for d in range(len(plans[0].cu) - 1)}
    half = 0.5 if cfg.causal else 1.0

    def pairs(d, p0, n):  # the keys of a run of rows [p0, p0 + n) of document d (no window)
        return n * p0 + n * (n + 1) // 2 if cfg.causal else n * lens[d]

    work = [sum(pairs(*x) for x in p.runs[p.rank]) for p in plans]
    s = max(plans[0].split_tokens) if plans[0].split else 0
    kv_row = 2 * (cfg.kv_heads or cfg.heads) * cfg.head_dim  # K and V elements of one token
    gather = (world - 1) * s * kv_row * elt_bytes
    return dict(work_pairs=work, tokens=[p.whole_tokens + p.split_tokens[p.rank] for p in plans],
                local_tokens=plans[0].local_tokens, split_documents=len(plans[0].split),
                ideal_pairs=sum(n * n for n in lens.values()) * half / world,
                predicted_efficiency=sum(work) / world / max(work) if max(work) else 1.0,
                token_balance=seqlen / world / plans[0].local_tokens,
                recv_bytes_fwd=gather, recv_bytes_bwd=gather + (world - 1) * s * kv_row * 4)
