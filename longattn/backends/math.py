"""The plain-PyTorch backend: any device, any dtype, any mask."""
from __future__ import annotations

from typing import Optional

import torch

from .base import Backend, BlockSpec, dead_rows_to_pos_inf, expand_kv, reduce_kv_grad


class MathBackend(Backend):
    """Plain PyTorch: any device, any dtype, any mask, logit soft-capping.
    Chunked over query rows so memory stays bounded; computes in float32
    (float64 for float64 input)."""

    name = "math"
    devices = ("cpu", "cuda")
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    supports_window = True
    supports_gqa_native = True
    supports_softcap = True
    # Scores held at once: 64 MiB of float32, so a long call's memory stays
    # bounded whatever its length (a memory bound, not a speed choice).
    chunk_elems = 1 << 24

    @staticmethod
    def _mask(spec: BlockSpec, rows: torch.Tensor, sk: int, device) -> Optional[torch.Tensor]:
        if not spec.masked:
            return None
        pos_q = (rows + spec.q_offset)[:, None]
        pos_k = torch.arange(sk, device=device)[None, :]
        ok = torch.ones(rows.numel(), sk, dtype=torch.bool, device=device)
        if spec.causal:
            ok &= pos_k <= pos_q
        left, right = spec.window
        if left >= 0:
            ok &= pos_q - pos_k <= left
        if right >= 0:
            ok &= pos_k - pos_q <= right
        return ok

    @staticmethod
    def _acc(t):
        return torch.float64 if t.dtype == torch.float64 else torch.float32

    @staticmethod
    def _scores(qf, kf, spec):
        """Scaled scores (B, H, q, k) and, with soft-capping, tanh of the capped
        argument (its derivative 1 - t^2 enters the backward); else None."""
        s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * spec.scale
        if not spec.softcap:
            return s, None
        t = torch.tanh(s / spec.softcap)
        return t * spec.softcap, t

    def _chunks(self, q, k):
        b, sq, h, _ = q.shape
        step = max(1, self.chunk_elems // max(1, b * h * k.shape[1]))
        for s0 in range(0, sq, step):
            yield s0, min(sq, s0 + step)

    def forward(self, q, k, v, spec):
        acc = self._acc(q)
        h = q.shape[2]
        kf = expand_kv(k, h).to(acc)
        vf = expand_kv(v, h).to(acc)
        out = torch.empty(q.shape, dtype=acc, device=q.device)
        lse = torch.empty(q.shape[0], h, q.shape[1], dtype=torch.float32, device=q.device)
        for s0, s1 in self._chunks(q, k):
            qf = q[:, s0:s1].to(acc)
            s, _ = self._scores(qf, kf, spec)
            mask = self._mask(spec, torch.arange(s0, s1, device=q.device), k.shape[1], q.device)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            l = torch.logsumexp(s, dim=-1)  # (B, H, q)
            p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l)[..., None])
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            out[:, s0:s1] = torch.einsum("bhqk,bkhd->bqhd", p, vf)
            lse[:, :, s0:s1] = l.float()
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        acc = self._acc(q)
        h, hkv = q.shape[2], k.shape[2]
        kf = expand_kv(k, h).to(acc)
        vf = expand_kv(v, h).to(acc)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(kf.shape, dtype=acc, device=q.device)
        dv = torch.zeros(vf.shape, dtype=acc, device=q.device)
        for s0, s1 in self._chunks(q, k):
            qf = q[:, s0:s1].to(acc)
            do = dout[:, s0:s1].to(acc)
            l = lse[:, :, s0:s1].to(acc)
            s, t = self._scores(qf, kf, spec)
            mask = self._mask(spec, torch.arange(s0, s1, device=q.device), k.shape[1], q.device)
            p = torch.exp(s - dead_rows_to_pos_inf(l)[..., None])
            if mask is not None:
                p = p.masked_fill(~mask, 0.0)
            dv += torch.einsum("bhqk,bqhd->bkhd", p, do)
            dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
            delta = (do * out[:, s0:s1].to(acc)).sum(-1).transpose(1, 2)  # (B, H, q)
            if dlse is not None:
                delta = delta - dlse[:, :, s0:s1].to(acc)
            ds = p * (dp - delta[..., None]) * spec.scale
            if t is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
                ds = ds * (1 - t * t)
            dq[:, s0:s1] = torch.einsum("bhqk,bkhd->bqhd", ds, kf)
            dk += torch.einsum("bhqk,bqhd->bkhd", ds, qf)
        return dq.to(q.dtype), reduce_kv_grad(dk, hkv).to(k.dtype), reduce_kv_grad(dv, hkv).to(v.dtype)
