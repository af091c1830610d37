"""FA4 forms of the :mod:`longattn.masks` patterns: pure Python, no FA4 import.

A named pattern carries a :class:`Form` (``mask_mod.fa4``): its kind, its
integer parameters and the tensors it reads (document ids, global-token
flags, a block layout). From a form come

* the mask as one function body written against an ``ops`` object
  (:func:`mask_body`): ``ops.const(c)`` an int32 constant, ``ops.load(t, *idx)``
  an int32 element of an aux tensor. :class:`TorchOps` runs it on broadcast
  index tensors (CPU checks, the same code the GPU runs); :mod:`.fa4` wraps it
  in ``cute.jit`` with CuTe's ops, which is FA4's ``mask_mod(batch, head,
  q_idx, kv_idx, seqlen_info, aux_tensors)``;
* FA4's block sparsity: the exact table of full / partial / empty blocks of
  (query tile x key tile) from :func:`longattn.flex.plan.block_table`, in
  FA4's tensors (:func:`sparse_tensors`): per query block the key blocks
  (forward), per key block the query blocks (backward), ascending.

A user's own mask function has no form: FlexAttention runs it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Callable, Optional

import torch

from . import plan as fp

PAD = 512
"""Positions added to every aux tensor read by position: FA4 calls the mask
on the padded rows and columns of the last tile (up to 256 past the end; the
results there are discarded), so the reads stay in bounds without clamping."""

HEADDIMS = (64, 96, 128)
"""Head dims whose FA4 tiles divide a 128 x 128 sparse block on sm_90 in
forward and backward (flash_attn.cute.interface._tile_size_fwd_sm90 /
_tile_size_bwd_sm90: 192 and 256 take key tiles of 112/96/80, which FA4's
block sparsity refuses)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Form:
    """A pattern in FA4's terms: ``kind``, int parameters ``consts``, the
    tensors it reads (``tensors``) and, for ``and`` / ``or``, its ``parts``."""

    kind: str
    consts: tuple = ()
    tensors: tuple = ()
    parts: tuple = ()

    def code_key(self) -> tuple:
        """What the generated kernel code depends on (not the tensors' contents)."""
        return (self.kind, self.consts, tuple(t.dim() for t in self.tensors), tuple(p.code_key() for p in self.parts))

    def code_hash(self) -> str:
        """The code key and the source that turns it into code (FA4 may keep
        compiled kernels on disk by this hash: an edit of :func:`mask_body` must change it)."""
        return hashlib.sha256(repr((_body_source(), self.code_key())).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _body_source() -> str:
    return inspect.getsource(mask_body)


KINDS = {"causal": 0, "window": 0, "document": 1, "prefix": 0, "prefix_rows": 1, "local_global": 0,
         "local_global_flags": 1, "layout": 1, "dilated_branch": 0, "at_positions": 2, "and": 0, "or": 0}
"""kind -> the number of tensors it reads."""


def form(kind: str, *consts, tensors=(), parts=()) -> Form:
    if kind not in KINDS or len(tensors) != KINDS[kind]:
        raise ValueError(f"no FA4 form {kind!r} with {len(tensors)} tensors")
    return Form(kind, tuple(int(c) for c in consts), tuple(tensors), tuple(parts))


def documents_form(f: Optional[Form]) -> Optional[tuple]:
    """``(doc ids, causal, (left, right))`` where ``f`` is a document pattern
    alone or and-ed with causal and sliding windows (any nesting of ``and``):
    the attention of each document with flash-attn's window, what a varlen
    kernel runs; None for any other form. Whether the documents are
    contiguous runs (a varlen kernel's condition) depends on the ids' values:
    the caller checks."""
    if f is None:
        return None
    parts, todo = [], [f]
    while todo:
        p = todo.pop()
        if p.kind == "and":
            todo.extend(p.parts)
        elif p.kind in ("document", "causal", "window"):
            parts.append(p)
        else:
            return None
    docs = [p for p in parts if p.kind == "document"]
    if len(docs) != 1:
        return None
    tighter = lambda a, b: b if a < 0 else a if b < 0 else min(a, b)  # -1: unbounded
    left = right = -1
    for p in parts:
        if p.kind == "window":
            left, right = tighter(left, p.consts[0]), tighter(right, p.consts[1])
        elif p.kind == "causal":
            right = tighter(right, 0)
    return docs[0].tensors[0], right == 0, (left, right)


def combine(op: str, mods) -> Optional[Form]:
    """The form of ``and_`` / ``or_`` of masks: None unless every part has one."""
    parts = [getattr(m, "fa4", None) for m in mods]
    return None if any(p is None for p in parts) else form(op, parts=parts)


class TorchOps:
    """The ops of :func:`mask_body` on torch tensors (broadcast index tensors)."""

    @staticmethod
    def const(c: int):
        return c

    @staticmethod
    def load(t: torch.Tensor, *idx):
        return t[tuple(i.long() for i in idx)]


def _both(x, y):
    return lambda b, h, q, k, aux: x(b, h, q, k, aux) & y(b, h, q, k, aux)


def _either(x, y):
    return lambda b, h, q, k, aux: x(b, h, q, k, aux) | y(b, h, q, k, aux)


def mask_body(f: Form, ops) -> tuple[Callable, list]:
    """(``body(b, h, q, kv, aux) -> bool``, the (form, tensor) pairs it reads from ``aux``, in order):
    the form's mask at positions q, kv. Python branches only on the form's
    constants (a CuTe trace unrolls them); the tensors are read from ``aux``
    at the indices listed here."""
    tensors: list = []

    def build(f: Form) -> Callable:
        base = len(tensors)
        tensors.extend((f, t) for t in f.tensors)
        c, k = ops.const, f.consts
        if f.kind in ("and", "or"):
            fns = [build(p) for p in f.parts]
            out = fns[0]
            for g in fns[1:]:
                out = _both(out, g) if f.kind == "and" else _either(out, g)
            return out
        if f.kind == "at_positions":  # local rows and keys at global positions (a ring step)
            inner = build(f.parts[0])
            if not k:
                return lambda b, h, q, kv, aux: inner(b, h, ops.load(aux[base], q), ops.load(aux[base + 1], kv), aux)
            # a call on a view: c batch rows per batch row of the pattern; a 2-D (c, n) position table
            # gives view row j's positions (the split side), a 1-D one every view row's
            n, two_q, two_k = k[0], f.tensors[0].dim() == 2, f.tensors[1].dim() == 2

            def at(b, h, q, kv, aux):
                j = b % c(n)
                qp = ops.load(aux[base], j, q) if two_q else ops.load(aux[base], q)
                kp = ops.load(aux[base + 1], j, kv) if two_k else ops.load(aux[base + 1], kv)
                return inner(b // c(n), h, qp, kp, aux)
            return at
        if f.kind == "causal":
            return lambda b, h, q, kv, aux: kv <= q
        if f.kind == "window":
            left, right = k

            def window(b, h, q, kv, aux):
                ok = q >= c(0)
                if left >= 0:
                    ok = ok & (q - kv <= c(left))
                if right >= 0:
                    ok = ok & (kv - q <= c(right))
                return ok
            return window
        if f.kind == "document":
            if f.tensors[0].dim() == 1:
                return lambda b, h, q, kv, aux: ops.load(aux[base], q) == ops.load(aux[base], kv)
            return lambda b, h, q, kv, aux: ops.load(aux[base], b, q) == ops.load(aux[base], b, kv)
        if f.kind == "prefix":
            return lambda b, h, q, kv, aux: (kv < c(k[0])) | (kv <= q)
        if f.kind == "prefix_rows":
            return lambda b, h, q, kv, aux: (kv < ops.load(aux[base], b)) | (kv <= q)
        if f.kind == "local_global":
            w, n = k
            return lambda b, h, q, kv, aux: (((q - kv <= c(w)) & (kv - q <= c(w))) | (q < c(n))) | (kv < c(n))
        if f.kind == "local_global_flags":
            w = k[0]
            return lambda b, h, q, kv, aux: (((q - kv <= c(w)) & (kv - q <= c(w)))
                                             | (ops.load(aux[base], q) == c(1))) | (ops.load(aux[base], kv) == c(1))
        if f.kind == "layout":
            bs = k[0]
            if f.tensors[0].dim() == 2:
                return lambda b, h, q, kv, aux: ops.load(aux[base], q // c(bs), kv // c(bs)) == c(1)
            return lambda b, h, q, kv, aux: ops.load(aux[base], h, q // c(bs), kv // c(bs)) == c(1)
        w, r, causal = k  # dilated_branch

        def branch(b, h, q, kv, aux):
            off = h % c(r)
            ok = ((q // c(w) == kv // c(w)) & ((q % c(w)) % c(r) == off)) & ((kv % c(w)) % c(r) == off)
            return ok & (kv <= q) if causal else ok
        return branch

    return build(f), tensors


def aux_tensors(f: Form, device) -> list[torch.Tensor]:
    """The form's tensors as FA4 reads them: int32 on ``device``, contiguous,
    padded by :data:`PAD` positions along every axis read by position (the
    padding's values are never used)."""
    out = []
    for g, t in mask_body(f, TorchOps)[1]:
        t = t.to(device=device, dtype=torch.int32)
        if g.kind == "layout":
            extra = -(-PAD // g.consts[0])
            t = torch.nn.functional.pad(t, (0, extra, 0, extra))
        elif g.kind != "prefix_rows":  # prefix_rows is read by batch row
            t = torch.nn.functional.pad(t, (0, PAD))
        out.append(t.contiguous())
    return out


def sparse_block(cap_major: int, seqlen_q: int) -> tuple[int, int]:
    """FA4's sparse block (query rows, keys): its forward tile on sm_90 with a
    128 x 128 sparse block is 128 x 128 (head dims :data:`HEADDIMS`); on
    sm_100 the forward runs two 128-row query tiles per block (q_stage 2)
    where seqlen_q > 128, so query blocks are 256 there
    (flash_attn.cute.interface._get_fwd_config; block_sparsity's shape checks)."""
    return (256, 128) if cap_major == 10 and seqlen_q > 128 else (128, 128)


def sparse_tensors(table: fp.BlockTable) -> dict:
    """FA4's block-sparse tensors (int32): ``fwd`` per query block
    (mask_block_cnt (B, H, M), mask_block_idx (B, H, M, N), full_block_cnt,
    full_block_idx) and ``bwd`` the same per key block over query blocks
    (B, H, N) / (B, H, N, M); B and H are 1 where the mask does not depend on them."""
    def lists(partial, full):
        (pc, pi), (fc, fi) = fp.ordered_blocks(partial), fp.ordered_blocks(full)
        return dict(mask_block_cnt=pc, mask_block_idx=pi, full_block_cnt=fc, full_block_idx=fi)
    return dict(fwd=lists(table.partial, table.full),
                bwd=lists(table.partial.transpose(-1, -2), table.full.transpose(-1, -2)))
