"""What one Ulysses call does besides its local attention: collectives, copies,
fills, reductions and host syncs, forward and backward, counted on CPU (gloo,
spawned ranks; no GPU needed).

    PYTHONPATH=. python benchmarks/ulysses_accounting.py [--world 2] [--json FILE]

Every aten op dispatched outside the local attention kernels is recorded by
a ``TorchDispatchMode`` (the attention custom ops appear as one op each; what
they do inside is the single-device kernel's business and is not counted).
Bytes are each op's output bytes in units of this rank's local q, so the
table reads the same at 8K or 1M tokens: "copy 3.0" is three q-sized tensors
written. ``host syncs`` counts ``tolist`` / ``item`` / ``int()`` of tensors
during the call: each is a device synchronisation where the tensor lives on a
GPU (on CPU every tensor is a host one, so the count is an upper bound: which
of them read a device tensor follows from the code). A ``torch.profiler`` pass
over the same call lists the collectives as gloo records them.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import longattn  # noqa: E402

# what an op is, for the table
KIND = {
    "copy_": "copy", "clone": "copy", "_to_copy": "copy", "contiguous": "copy", "cat": "copy", "stack": "copy",
    "index_select": "copy", "index_copy": "copy", "index_put_": "copy", "_unsafe_view": "view",
    "_reshape_alias": "view", "_wrap_tensor_autograd": "view", "new_empty": "alloc", "empty": "alloc",
    "empty_like": "alloc", "empty_strided": "alloc", "new_empty_strided": "alloc",
    "zeros": "fill", "zeros_like": "fill", "new_zeros": "fill", "fill_": "fill", "full": "fill", "new_full": "fill",
    "zero_": "fill", "add": "reduce", "add_": "reduce", "index_add_": "reduce", "index_add": "reduce",
    "sum": "reduce",
    "all_to_all_single": "collective", "wait_tensor": "wait", "allgather_": "collective",
    "alltoall_base_": "collective", "all_gather_into_tensor": "collective",
}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


class Counter(TorchDispatchMode):
    def __init__(self, unit: int):
        super().__init__()
        self.unit = unit
        self.ops = collections.Counter()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _name(func)
        kind = KIND.get(name)
        if kind is None:
            if func._schema.name.startswith("longattn::"):
                kind = "local attention"
            elif torch.Tag.view_copy in func.tags or func.is_view or name in ("view", "as_strided", "slice",
                                                                                "select", "permute", "transpose",
                                                                                "t", "unsqueeze", "squeeze",
                                                                                "expand", "alias", "split",
                                                                                "split_with_sizes", "unbind",
                                                                                "narrow", "detach", "unflatten",
                                                                                "_unsafe_view", "reshape"):
                kind = "view"
            else:
                kind = "other"
        key = f"{kind}: {name}"
        self.ops[key] += 1
        if kind in ("copy", "fill", "reduce", "collective", "other", "local attention"):
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.bytes[key] += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out


class Syncs:
    """Count tolist / item / int() of tensors and torch.tensor(..., device=...) while active."""

    def __init__(self):
        self.n = collections.Counter()

    def __enter__(self):
        self.saved = {}
        for attr in ("tolist", "item", "__int__"):
            orig = getattr(torch.Tensor, attr)
            self.saved[attr] = orig

            def wrap(t, *a, _orig=orig, _attr=attr, **k):
                self.n[_attr] += 1
                return _orig(t, *a, **k)
            setattr(torch.Tensor, attr, wrap)
        return self

    def __exit__(self, *exc):
        for attr, orig in self.saved.items():
            setattr(torch.Tensor, attr, orig)


CASES = {
    # name: (kind, layout, causal, nheads, nheads_kv, docs)
    "dense MHA contiguous": ("dense", "contiguous", False, 16, 16, None),
    "dense MHA zigzag causal": ("dense", "zigzag", True, 16, 16, None),
    "dense GQA 32q/8kv contiguous": ("dense", "contiguous", True, 32, 8, None),
    "varlen MHA contiguous (mix docs)": ("varlen", "contiguous", True, 16, 16, [40, 4, 10, 1, 20, 5, 2, 46]),
    "varlen GQA 32q/8kv contiguous": ("varlen", "contiguous", True, 32, 8, [7, 23, 11, 31, 9, 47]),
    "varlen MHA zigzag": ("varlen", "zigzag", True, 16, 16, [40, 4, 10, 1, 20, 5, 2, 46]),
}


def _inputs(kind, layout, h, hkv, docs, world, d=16, seqlen=256):
    torch.manual_seed(0)
    if kind == "dense":
        full = [torch.randn(1, seqlen, n, d) for n in (h, hkv, hkv)]
        return [longattn.shard(x, layout=layout) for x in full], None
    cu = torch.tensor([0] + docs).cumsum(0).to(torch.int32)
    full = [torch.randn(int(cu[-1]), n, d) for n in (h, hkv, hkv)]
    return [longattn.shard_varlen(x, cu, layout=layout)[0] for x in full], cu


def _call(kind, layout, causal, q, k, v, cu, **kw):
    if kind == "dense":
        return longattn.ulysses_attention(q, k, v, causal=causal, layout=layout, backend="math", **kw)
    return longattn.ulysses_attention_varlen(q, k, v, cu, causal=causal, layout=layout, backend="math", **kw)


def _account(rank, world, out_path, extra):
    rows = {}
    for name, (kind, layout, causal, h, hkv, docs) in CASES.items():
        (q, k, v), cu = _inputs(kind, layout, h, hkv, docs, world)
        unit = q.numel() * q.element_size()
        _call(kind, layout, causal, q, k, v, cu, **extra)  # first call: the cached checks happen here
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        res = {}
        with Counter(unit) as c, Syncs() as s:
            out = _call(kind, layout, causal, ql, kl, vl, cu, **extra)
        res["fwd"] = (c, s)
        do = torch.randn_like(out)
        with Counter(unit) as c, Syncs() as s:
            out.backward(do)
        res["bwd"] = (c, s)
        rows[name] = {ph: dict(ops=dict(c.ops), bytes_q={key: round(b / unit, 3) for key, b in c.bytes.items()},
                               syncs=dict(s.n)) for ph, (c, s) in res.items()}
        if rank == 0:
            print(f"\n== {name} (world {world}; bytes in units of the local q) ==")
            for ph, (c, s) in res.items():
                by_kind = collections.defaultdict(lambda: [0, 0.0])
                for key, n in c.ops.items():
                    kd = key.split(":")[0]
                    by_kind[kd][0] += n
                    by_kind[kd][1] += c.bytes.get(key, 0) / unit
                summary = ", ".join(f"{kd} {n} ops / {b:.2f}q" if kd not in ("view", "alloc", "wait") else
                                    f"{kd} {n}" for kd, (n, b) in sorted(by_kind.items()))
                print(f"  {ph}: {summary}; host syncs {dict(s.n) or 0}")
                for key, n in sorted(c.ops.items()):
                    if not key.startswith(("view", "alloc")):
                        print(f"      {key:40s} x{n:3d}  {c.bytes.get(key, 0) / unit:7.3f} q")
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(dict(world=world, extra={k: repr(v) for k, v in extra.items()}, cases=rows), f, indent=1)
    # the profiler's view of the collectives of one forward + backward
    if rank == 0:
        (q, k, v), cu = _inputs("dense", "contiguous", 16, 16, None, world)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    else:
        (q, k, v), cu = _inputs("dense", "contiguous", 16, 16, None, world)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _call("dense", "contiguous", False, ql, kl, vl, None, **extra).sum().backward()
    if rank == 0:
        ev = collections.Counter(e.name for e in prof.events()
                                 if any(w in e.name for w in ("gloo", "all_to_all", "alltoall", "allgather",
                                                              "wait_tensor", "c10d")))
        print("\nprofiler, dense MHA contiguous fwd+bwd, collective records:", dict(ev))


def main():
    from dist_utils import run_world

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--chunks", type=int, default=0, help="pipeline chunks (0: the tuning's choice)")
    a = ap.parse_args()
    extra = {}
    if a.chunks:
        from longattn.tuning import UlyssesTuning
        extra["tuning"] = UlyssesTuning(max_chunks=a.chunks, min_chunk_rows=0)
    run_world(_account, a.world, a.json, extra)


if __name__ == "__main__":
    main()
