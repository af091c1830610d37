"""Float64 references written plainly: explicit masks and einsum, no tricks.

Every op in longattn is checked against these. They materialise (S, S)
score matrices, so tests keep shapes small.
"""
from __future__ import annotations

import torch


def expand_kv(x, nheads):
    return x.repeat_interleave(nheads // x.shape[2], dim=2)


def window_mask(sq, sk, *, causal=False, window=(-1, -1), q_offset=None):
    """(Sq, Sk) bool: True where query i (at position i + q_offset) sees key j."""
    if q_offset is None:
        q_offset = sk - sq  # bottom-right, as flash-attn
    pos_q = torch.arange(sq)[:, None] + q_offset
    pos_k = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= pos_k <= pos_q
    if window[0] >= 0:
        ok &= pos_q - pos_k <= window[0]
    if window[1] >= 0:
        ok &= pos_k - pos_q <= window[1]
    return ok


def masked_attention(q, k, v, mask, scale, softcap=0.0, sinks=None):
    """q (B,Sq,H,D), k/v (B,Sk,Hkv,D), mask broadcastable to (B,H,Sq,Sk). float64.
    Returns out (B,Sq,H,D) and lse (B,H,Sq); rows with no key: 0 and -inf.
    ``softcap``: scores become softcap * tanh(scores / softcap) before the mask.
    ``sinks`` (H,): one more score per row whose value vector is zero (as
    GPT-OSS's eager attention: a column concatenated, dropped after the
    softmax); lse includes it, rows with no key give 0 and the sink."""
    q, k, v = q.double(), expand_kv(k.double(), q.shape[2]), expand_kv(v.double(), q.shape[2])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def attention_ref(q, k, v, *, causal=False, window=(-1, -1), scale=None, q_offset=None, softcap=0.0, sinks=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = window_mask(q.shape[1], k.shape[1], causal=causal, window=window, q_offset=q_offset)
    return masked_attention(q, k, v, mask.to(q.device), scale, softcap, sinks)


def varlen_ref(q, k, v, cu, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    """Packed documents (T, H, D) with int32 cu_seqlens: a block-diagonal mask
    over the packed tokens, plain. Returns out (T, H, D) and lse (H, T)."""
    total = q.shape[0]
    doc = torch.zeros(total, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc[a:b] = i
    same = doc[:, None] == doc[None, :]
    m = (same & window_mask(total, total, causal=causal, window=window, q_offset=0)).to(q.device)
    # window_mask works in packed positions; inside one document they equal doc positions
    out, lse = masked_attention(q[None], k[None], v[None], m, q.shape[-1] ** -0.5, softcap, sinks)
    return out[0], lse[0]


def dilated_masks(seqlen, nheads, segment_lengths, dilation_rates, causal, head_offset=0):
    """One (H, S, S) bool mask per branch, straight from the definition:
    head h selects p when (p % w) % r == h % r; selected q and k in the same
    segment p // w see each other (causal: k <= q). ``head_offset``: the
    heads are h = head_offset, ..., head_offset + nheads - 1."""
    pos = torch.arange(seqlen)
    heads = torch.arange(head_offset, head_offset + nheads)
    masks = []
    for w, r in zip(segment_lengths, dilation_rates):
        sel = ((pos % w) % r)[None, :] == (heads % r)[:, None]  # (H, S)
        same_seg = (pos[:, None] // w) == (pos[None, :] // w)
        m = sel[:, :, None] & sel[:, None, :] & same_seg[None]
        if causal:
            m &= pos[None, :] <= pos[:, None]
        masks.append(m)
    return masks


def dilated_ref(q, k, v, segment_lengths, dilation_rates, *, causal=False, scale=None, head_offset=0):
    """Union softmax over the keys every branch gives: concatenating each
    branch's masked scores along the key axis counts a key given twice twice.
    ``head_offset``: q holds heads head_offset, ... of a larger call (MHA k/v
    of the same heads), so large shapes can be checked a few heads at a time."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, s, h, d = q.shape
    qd, kd, vd = q.double(), expand_kv(k.double(), h), expand_kv(v.double(), h)
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    masks = dilated_masks(s, h, segment_lengths, dilation_rates, causal, head_offset)
    cat = torch.cat([scores.masked_fill(~m.to(q.device), float("-inf")) for m in masks], -1)
    lse = torch.logsumexp(cat, -1)
    p = torch.exp(cat - lse[..., None]).nan_to_num(0.0)
    vcat = torch.cat([vd] * len(masks), 1)
    return torch.einsum("bhqk,bkhd->bqhd", p, vcat), lse


def dense_mask(mask_mod, batch, nheads, sq, sk=None):
    """(B, H, Sq, Sk) bool: a FlexAttention-style mask_mod evaluated at every
    (b, h, q, k) (broadcast index tensors; None: every key)."""
    sk = sq if sk is None else sk
    if mask_mod is None:
        return torch.ones(batch, nheads, sq, sk, dtype=torch.bool)
    idx = lambda n, d: torch.arange(n).view([n if i == d else 1 for i in range(4)])
    return mask_mod(idx(batch, 0), idx(nheads, 1), idx(sq, 2), idx(sk, 3)).expand(batch, nheads, sq, sk)


def flex_ref(q, k, v, mask_mod=None, score_mod=None, scale=None):
    """FlexAttention's definition in float64: scores * scale, then score_mod
    (called on the whole (B, H, Sq, Sk) score tensor with broadcast indices),
    then the mask; rows with no key: 0 and -inf."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    qd, kd, vd = q.double(), expand_kv(k.double(), h), expand_kv(v.double(), h)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if score_mod is not None:
        idx = lambda n, d: torch.arange(n).view([n if i == d else 1 for i in range(4)])
        s = score_mod(s, idx(b, 0), idx(h, 1), idx(sq, 2), idx(sk, 3))
    s = s.masked_fill(~dense_mask(mask_mod, b, h, sq, sk), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vd), lse


def flex_ref_grads(q, k, v, do, dl, mask_mod=None, score_mod=None):
    """:func:`flex_ref` in float64 and the gradients of sum(out * do) + sum(lse * dl)
    over the rows that see a key: (out, lse, (dq, dk, dv))."""
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    ro, rl = flex_ref(qr, kr, vr, mask_mod, score_mod)
    ((ro * do.double()).sum() + (torch.where(torch.isfinite(rl), rl, 0) * dl.double()).sum()).backward()
    return ro.detach(), rl.detach(), (qr.grad, kr.grad, vr.grad)


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), fin):
        return float("inf")
    g, r = got[fin], ref[fin]
    den = r.norm()
    return float((g - r).norm() / (den if den > 0 else 1.0))


def grads_of(fn, inputs, dout, dlse=None):
    """Run fn(*inputs) -> out or (out, lse), backprop (dout, dlse); return outputs and grads."""
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    res = fn(*xs)
    out, lse = (res if isinstance(res, tuple) else (res, None))
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse.double()).sum()
    loss.backward()
    return out.detach(), (None if lse is None else lse.detach()), [x.grad for x in xs]


GRAD_NAMES = ("dq", "dk", "dv", "dsinks")  # the fourth: an op with attention sinks


def assert_close(got: dict, ref: dict, tol: float, tag: str = "") -> dict:
    """The one comparison every test uses: each named tensor of ``got`` (out,
    lse, gradients) within ``tol`` relative error (norm, finite entries; -inf
    where the reference has -inf) of ``ref``, and no NaN. Returns the errors."""
    errs = {n: rel_err(got[n], r) for n, r in ref.items() if r is not None}
    bad = {n: e for n, e in errs.items() if not e < tol}
    assert not bad, f"{tag}: relative error above {tol}: {bad}"
    nans = [n for n in ref if got.get(n) is not None and torch.isnan(got[n]).any()]
    assert not nans, f"{tag}: NaN in {nans}"
    return errs


def results(fn, inputs, dout, dlse=None) -> dict:
    """{out, lse, dq, dk, dv} of fn(*inputs) backpropagated with (dout, dlse)."""
    out, lse, grads = grads_of(fn, inputs, dout, dlse)
    return dict(out=out, lse=lse, **dict(zip(GRAD_NAMES, grads)))


def check_op(fn, ref_fn, inputs, dout, dlse=None, tol: float = 1e-4, tag: str = "") -> dict:
    """fn(*inputs) against ref_fn on float64 copies of the inputs: output, lse
    (when fn returns it) and every input gradient (see :func:`assert_close`)."""
    got = results(fn, inputs, dout, dlse)
    want = results(ref_fn, [x.double() for x in inputs], dout, dlse)
    if got["lse"] is None:
        want["lse"] = None
    return assert_close(got, want, tol, tag)
