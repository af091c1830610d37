"""Context-parallel training of a transformers-style language model.

Every rank of a group holds the same full batch; :func:`shard_batch` gives
each rank its share of the tokens (zigzag by default, balanced causal work)
with everything a model under ``attn_implementation="longattn_ring"`` needs:

* ``position_ids`` stay global, so RoPE rotates each token as in the
  unsharded sequence;
* labels are shifted *before* sharding (a token's target may live on another
  rank): the batch carries them as ``shift_labels`` (transformers' causal-LM
  loss then does not shift again) and ``num_items_in_batch``, the number of
  target tokens of the whole batch, so each rank's loss is its share of the
  token-weighted mean: the sum over ranks is the unsharded loss;
* padding (a 2-D ``attention_mask``), packed documents (``position_ids`` that
  restart, or ``cu_seqlens``) and sequences whose length does not divide
  ``2 * world`` become one packed stream of documents sharded per document
  (:func:`longattn.shard_varlen`); the ring runs it with
  :func:`longattn.ring_attention_varlen` on the global ``cu_seqlens``;
  ``layout="documents"`` shards such a stream by whole documents instead
  (:func:`longattn.shard_documents`: documents held whole where they fit,
  only long ones split), run by :func:`longattn.packed_attention`;
* ``longattn_cp``, a :class:`CPContext` that the model's attention calls
  receive through the model's keyword arguments (the group and layout travel
  with the batch: no global state).

::

    import longattn.integrations.transformers as lt
    from longattn import context_parallel as cp

    lt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="longattn_ring")
    batch = cp.shard_batch(input_ids, labels=labels, attention_mask=mask, group=group)
    loss = model(**batch).loss          # this rank's share of the token-weighted mean
    loss.backward()
    cp.all_reduce_grads(model, group)   # sum over the group: the unsharded gradient
    print(cp.reduce_loss(loss, group))  # the unsharded loss (for logging)

Gradients: rank r's loss is (sum of its tokens' losses) / (all target tokens),
so the gradient of the unsharded loss is the *sum* over the group of the
ranks' gradients (:func:`all_reduce_grads`). With data parallelism on top,
reduce over the context-parallel group first (sum), then over the data-parallel
group as usual (mean); wrapping the model in DDP over the context-parallel
group instead averages, so multiply the loss by the group size there.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist

from . import shard, shard_varlen, unshard, unshard_varlen
from .distributed import VarlenShard
from .distributed import checks as _checks
from .distributed.doc_shard import DocumentShard, plan_documents

__all__ = ["CPContext", "shard_batch", "loss", "reduce_loss", "all_reduce_grads", "resolve_group"]


def resolve_group(group=None, mesh_dim=None) -> dist.ProcessGroup:
    """A ProcessGroup from ``group``: None (the default group), a ProcessGroup, or
    a DeviceMesh (with ``mesh_dim`` naming the context-parallel dimension when
    the mesh has more than one); :func:`longattn.distributed.checks.resolve_group`."""
    return _checks.resolve_group(group, mesh_dim)


@dataclasses.dataclass(frozen=True, eq=False)
class CPContext:
    """How a batch was sharded; passed to the model as ``longattn_cp``.

    ``cu_seqlens`` is None when the batch is sharded as dense rows
    (:func:`longattn.ring_attention`); otherwise the global int32 cumulative
    document lengths of the packed stream (:func:`longattn.ring_attention_varlen`),
    ``varlen`` its :class:`~longattn.distributed.VarlenShard` and
    ``token_index`` the flat ``batch * seqlen`` index of each packed token;
    with ``layout="documents"``, ``documents`` is the stream's
    :class:`~longattn.distributed.doc_shard.DocumentShard` instead of ``varlen``.
    ``from_positions``: the documents were found where ``position_ids``
    restart (not given as ``cu_seqlens`` or padding), which a model means only
    where its mask builder reads position_ids (the integration checks).
    ``first_positions``: of a packed stream without padding, each document's
    first position id (int64, CPU), which chunked attention's chunks follow
    (the integration checks)."""

    group: dist.ProcessGroup
    layout: str
    batch_size: int
    seqlen: int
    cu_seqlens: Optional[torch.Tensor] = None
    varlen: Optional[VarlenShard] = None
    token_index: Optional[torch.Tensor] = None
    documents: Optional[DocumentShard] = None
    from_positions: bool = False
    first_positions: Optional[torch.Tensor] = None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """The full ``(batch, seqlen, ...)`` tensor from every rank's ``(batch_local,
        seqlen_local, ...)`` shard (e.g. logits or hidden states); padding
        positions hold 0. Differentiable; every rank must call it."""
        if self.cu_seqlens is None:
            return unshard(x_local, layout=self.layout, group=self.group, seq_dim=1)
        if self.documents is not None:
            packed = self.documents.unshard(x_local[0], self.group)
        else:
            packed = unshard_varlen(x_local[0], self.cu_seqlens, layout=self.layout, group=self.group)
        full = packed.new_zeros((self.batch_size * self.seqlen, *packed.shape[1:]))
        full = full.index_copy(0, self.token_index.to(packed.device), packed)
        return full.view(self.batch_size, self.seqlen, *packed.shape[1:])

    def attention_varlen(self, q, k, v, **kw):
        """Attention of this rank's packed tokens ``(local_tokens, heads, dim)``:
        :func:`longattn.packed_attention` for ``layout="documents"``, else
        :func:`longattn.ring_attention_varlen`; ``kw`` as those take them."""
        from . import packed_attention, ring_attention_varlen

        if self.documents is not None:
            return packed_attention(q, k, v, self.documents, group=self.group, **kw)
        return ring_attention_varlen(q, k, v, self.cu_seqlens, layout=self.layout, group=self.group, **kw)


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def _digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            h.update(repr(type(t)).encode())
            continue
        c = t.detach().cpu().contiguous()
        h.update(repr((tuple(c.shape), str(c.dtype))).encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def shard_batch(input_ids: torch.Tensor, *, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, group=None, mesh_dim=None, layout: str = "zigzag",
                ignore_index: int = -100, check: bool = True) -> dict:
    """This rank's share of a causal-LM batch, as keyword arguments of the model.

    Args:
        input_ids: ``(batch, seqlen)`` token ids, the same full batch on every rank.
        labels: ``(batch, seqlen)`` targets *before* the shift (as given to a
            transformers causal LM: position t is trained to predict
            ``labels[t + 1]``); ``ignore_index`` marks positions without a target.
            None: the next token wherever both tokens are real (not padding).
            A target predicted from a padding position must be ``ignore_index``
            (left padding: the first real token's label), since padding rows are
            not computed.
        attention_mask: ``(batch, seqlen)`` 1 for real tokens, 0 for padding (left
            or right; zeros between real tokens are refused).
        position_ids: ``(batch or 1, seqlen)``. Without ``attention_mask``, a
            position that does not follow its predecessor by 1 starts a new
            document (packed sequences, the rule transformers uses). Default
            ``arange(seqlen)`` per row, as the model's own default.
        cu_seqlens: ``(ndocs + 1,)`` document boundaries of a packed ``batch == 1``
            stream (instead of position resets); positions restart in each document
            unless ``position_ids`` are given.
        group: ProcessGroup or DeviceMesh (``mesh_dim`` names its context-parallel
            dimension); default the whole world.
        layout: ``"zigzag"`` (default; balanced causal work), ``"contiguous"``, or
            ``"documents"``: every row a packed stream sharded by whole documents
            (:func:`longattn.shard_documents`; only documents too long for one rank
            are split and exchange K/V).
        check: verify (one small all-gather) that every rank passed the same batch.

    Returns:
        A dict for ``model(**batch)``: ``input_ids``, ``position_ids`` (global),
        ``labels`` and ``shift_labels`` (the shifted targets of the local tokens;
        ``labels`` is there so that transformers computes the loss, which uses
        ``shift_labels`` and does not shift again), ``num_items_in_batch`` (target
        tokens of the whole batch), ``use_cache=False`` and ``longattn_cp``
        (:class:`CPContext`). Dense rows keep the batch dimension; a packed
        stream is one row ``(1, local_tokens)`` whose padding slots have id 0,
        position 0 and no target.
    """
    g = resolve_group(group, mesh_dim)
    if check:  # first, so that a rank whose batch is malformed does not raise alone
        _checks.agree(g, "shard_batch", batch=_digest(input_ids, labels, attention_mask, position_ids, cu_seqlens),
                      layout=layout)
    position_ids, cu_list = _check_batch(input_ids, labels, attention_mask, position_ids, cu_seqlens, layout)
    b, s = input_ids.shape
    dev = input_ids.device
    valid = torch.ones(b, s, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.to(dev).bool()
    if position_ids is None:  # the positions the model would use unsharded (its default is arange per row)
        position_ids = _default_positions(b, s, cu_list, dev)
    shift_labels = _shift_labels(input_ids, labels, valid, ignore_index)
    common = dict(use_cache=False, num_items_in_batch=(shift_labels != ignore_index).sum())
    starts, from_positions = _document_starts(valid, position_ids, cu_list, attention_mask is not None,
                                              dist.get_world_size(g), layout)
    if starts is None:
        ctx = CPContext(g, layout, b, s)
        sh = lambda x: shard(x, layout=layout, group=g, seq_dim=1)
        shifted = sh(shift_labels)
        return dict(input_ids=sh(input_ids), position_ids=sh(position_ids.contiguous()), labels=shifted,
                    shift_labels=shifted, longattn_cp=ctx, **common)
    token_index = torch.nonzero(valid.flatten()).flatten()
    doc_starts = torch.nonzero(starts.flatten()[token_index]).flatten()
    cu = torch.cat([doc_starts, torch.tensor([token_index.numel()], device=dev)]).to(torch.int32).cpu()
    flat = lambda x: x.reshape(-1)[token_index]
    first = flat(position_ids)[doc_starts].long().cpu() if attention_mask is None else None
    if layout == "documents":
        plan = plan_documents(tuple(cu.tolist()), dist.get_world_size(g), dist.get_rank(g))
        ids_l, pos_l, lab_l = (plan.shard(flat(x)) for x in (input_ids, position_ids, shift_labels))
        lab_l = lab_l.masked_fill(~plan.valid.to(dev), ignore_index)
        ctx = CPContext(g, layout, b, s, cu, None, token_index, plan, from_positions=from_positions,
                        first_positions=first)
        return dict(input_ids=ids_l[None], position_ids=pos_l[None], labels=lab_l[None], shift_labels=lab_l[None],
                    longattn_cp=ctx, **common)
    ids_l, meta = shard_varlen(flat(input_ids), cu, layout=layout, group=g)
    pos_l, _ = shard_varlen(flat(position_ids), cu, layout=layout, group=g)
    lab_l, _ = shard_varlen(flat(shift_labels), cu, layout=layout, group=g)
    lab_l = lab_l.masked_fill(~meta.valid.to(dev), ignore_index)
    ctx = CPContext(g, layout, b, s, cu, meta, token_index, from_positions=from_positions, first_positions=first)
    return dict(input_ids=ids_l[None], position_ids=pos_l[None], labels=lab_l[None], shift_labels=lab_l[None],
                longattn_cp=ctx, **common)


def _check_batch(input_ids, labels, attention_mask, position_ids, cu_seqlens, layout):
    """Shapes and boundaries of a batch (ValueError naming the argument); returns
    (position_ids expanded to (batch, seqlen) or None, cu_seqlens as a list or None)."""
    if layout not in ("zigzag", "contiguous", "documents"):
        raise ValueError(f"layout={layout!r}: choose 'zigzag', 'contiguous' or 'documents'")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seqlen) tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
    b, s = input_ids.shape
    for name, x in (("labels", labels), ("attention_mask", attention_mask)):
        if x is not None and tuple(x.shape) != (b, s):
            raise ValueError(f"{name} must have the shape of input_ids {(b, s)}, got {tuple(x.shape)}")
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
            raise ValueError(f"position_ids must be (batch or 1, seqlen) = ({b} or 1, {s}), "
                             f"got {tuple(position_ids.shape)}")
        position_ids = position_ids.expand(b, s).to(input_ids.device)
    cu_list = None
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("pass either cu_seqlens (packed documents) or attention_mask (padding), not both")
        if b != 1:
            raise ValueError(f"cu_seqlens describes one packed row: input_ids must be (1, seqlen), got {(b, s)}")
        cu_list = [int(x) for x in cu_seqlens.tolist()]
        if cu_list[0] != 0 or cu_list[-1] != s or any(y < x for x, y in zip(cu_list, cu_list[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to seqlen ({s}), got {cu_list[:8]}...")
    return position_ids, cu_list


def _default_positions(b: int, s: int, cu_list, dev) -> torch.Tensor:
    """arange per row; in a packed stream, positions restarting at each document."""
    if cu_list is None:
        return torch.arange(s, device=dev).expand(b, s)
    starts = torch.tensor(cu_list[:-1], device=dev)
    doc = torch.searchsorted(torch.tensor(cu_list[1:], device=dev), torch.arange(s, device=dev), right=True)
    return (torch.arange(s, device=dev) - starts[doc])[None]


def _shift_labels(input_ids, labels, valid, ignore_index: int) -> torch.Tensor:
    """Each position's target (the next label), ``ignore_index`` where none; a
    target predicted from a padding position raises (padding is not computed)."""
    if labels is None:
        nxt = _shift(input_ids, ignore_index)
        return nxt.masked_fill(~(valid & _shift(valid.long(), 0).bool()), ignore_index)
    shift_labels = _shift(labels.to(input_ids.device), ignore_index)
    bad = (~valid) & (shift_labels != ignore_index)
    if bool(bad.any()):
        r, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"labels: position {t} of row {r} is padding but is trained to predict "
                         f"labels[{r}, {t + 1}] = {int(shift_labels[r, t])}; padding rows are not computed "
                         f"under context parallelism: set that label to {ignore_index} (with left padding, the "
                         f"label of each row's first real token)")
    return shift_labels


def _document_starts(valid, position_ids, cu_list, has_mask: bool, world: int, layout: str):
    """((batch, seqlen) bool marking where packed documents start, or None for
    dense rows that shard as they are; whether they came from restarting positions)."""
    b, s = valid.shape
    dev = valid.device
    starts, from_positions = None, False
    if has_mask and not bool(valid.all()):
        n_valid = valid.sum(1)
        first = valid.float().argmax(1)
        last = s - 1 - valid.flip(1).float().argmax(1)
        if bool(((n_valid > 0) & (last - first + 1 != n_valid)).any()):
            raise ValueError("attention_mask has zeros between real tokens; only left or right padding can be "
                             "sharded (pack such sequences as separate documents)")
        starts = torch.zeros(b, s, dtype=torch.bool, device=dev)
        rows = torch.nonzero(n_valid > 0).flatten()
        starts[rows, first[rows]] = True
    elif cu_list is not None:
        starts = torch.zeros(1, s, dtype=torch.bool, device=dev)
        starts[0, torch.tensor([c for c in cu_list[:-1] if c < s], dtype=torch.long, device=dev)] = True
    elif not has_mask:  # packed when positions restart (transformers' rule)
        brk = torch.ones(b, s, dtype=torch.bool, device=dev)
        brk[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        if bool(brk[:, 1:].any()):
            starts, from_positions = brk, True
    if starts is None and (layout == "documents" or s % (2 * world if layout == "zigzag" else world)):
        starts = torch.zeros(b, s, dtype=torch.bool, device=dev)
        starts[:, 0] = True  # one document per row: the packed layout pads each document itself
    return starts, from_positions


def loss(logits: torch.Tensor, batch: dict, ignore_index: int = -100) -> torch.Tensor:
    """This rank's share of the token-weighted cross-entropy of a sharded batch:
    (sum over local targets) / (target tokens of the whole batch). The sum
    over the group is the unsharded mean loss; use it for models whose own
    loss does not honour ``shift_labels``."""
    lg = logits.float().reshape(-1, logits.shape[-1])
    tgt = batch["shift_labels"].reshape(-1).to(lg.device)
    total = torch.nn.functional.cross_entropy(lg, tgt, ignore_index=ignore_index, reduction="sum")
    return total / batch["num_items_in_batch"].to(lg.device)


def reduce_loss(loss_local: torch.Tensor, group=None, mesh_dim=None) -> torch.Tensor:
    """The unsharded loss from every rank's share (sum over the group; detached)."""
    g = resolve_group(group, mesh_dim)
    t = loss_local.detach().clone()
    dist.all_reduce(t, group=g)
    return t


def all_reduce_grads(model_or_params: Union[torch.nn.Module, Iterable[torch.nn.Parameter]], group=None,
                     mesh_dim=None, bucket_bytes: int = 256 << 20) -> None:
    """Sum parameter gradients over the context-parallel group (in buckets of
    about ``bucket_bytes`` per dtype). After it every rank holds the gradient
    of the unsharded loss. Parameters without a gradient must be the same on
    every rank."""
    g = resolve_group(group, mesh_dim)
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    grads = [p.grad for p in params if p.grad is not None]
    by_kind: dict = {}
    for gr in grads:
        by_kind.setdefault((gr.dtype, gr.device), []).append(gr)
    for group_grads in by_kind.values():
        bucket, size = [], 0
        for gr in group_grads + [None]:
            if gr is not None:
                bucket.append(gr)
                size += gr.numel() * gr.element_size()
            if bucket and (gr is None or size >= bucket_bytes):
                flat = torch.cat([x.reshape(-1) for x in bucket])
                dist.all_reduce(flat, group=g)
                off = 0
                for x in bucket:
                    x.copy_(flat[off:off + x.numel()].view_as(x))
                    off += x.numel()
                bucket, size = [], 0
