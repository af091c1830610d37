"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) as a backend: an optional extra
(``pip install 'longattn[fa4]'``), imported on the first CUDA call that asks."""
from __future__ import annotations

from typing import Optional

import torch

from .. import tuning as _tuning
from . import _fa4_api
from .base import Backend, is_bottom_right


class FA4Backend(Backend):
    """FlashAttention-4 on Hopper (sm_90) and Blackwell (sm_100): native GQA,
    sliding windows, bottom-right aligned masks, logit soft-capping, the lse's
    gradient folded in by the kernel, packed documents in one launch
    (:meth:`varlen_refusals`).
    Faster than cuDNN in both passes on every shape measured on one H200
    (32K/128K, causal and not, GQA, D=64 and 128; 32K causal D=128 fwd / bwd
    673 / 604 TFLOP/s against cuDNN's 610 / 532). Strided views (the dilated
    engine's ``q[:, off::r]``) run without copies where their strides are
    16-byte aligned (FA4 copies others itself). Calls of at most
    ``Fa4Tuning.replay_max_tokens`` tokens replay FA4's compiled kernel calls
    from a layout's third call on (:func:`replays`), without FA4's Python."""

    name = "fa4"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_headdim = 256
    headdim_multiple = 8  # 16 bytes of fp16/bf16: FA4's alignment
    min_headdim = 8
    supports_window = True
    supports_gqa_native = True
    # FA4 soft-caps in its kernels: softcap * tanh(scale * S / softcap) as a
    # score_mod in the sm_90 and sm_100 forwards and, with its derivative, both
    # backwards (flash_attn/cute/interface.py, 4.0.0b36; only sm_100's separate
    # head-dim-256 backward refuses it, and arch_max_headdim keeps that one out).
    # Checked against float64 on sm_90: tests/test_fa4.py::test_softcap.
    # Attention sinks never reach a kernel (longattn._sinks merges them after the
    # blocks), so FA4's learnable_sink is not used.
    supports_softcap = True
    min_capability = (9, 0)
    # compute capability major -> the largest head dim its forward and backward
    # both take (flash_attn.cute.interface._validate_head_dims; sm_100's 256 is a
    # separate kernel without an lse gradient, and 192 needs v's head dim 128)
    arch_max_headdim = {9: 256, 10: 128}
    # sm_90 head dims whose forward and backward were checked against float64
    # (tests/test_fa4.py::test_head_dims on one H200, flash-attn-4 4.0.0b36):
    # 64, 96, 128, 192 and 256 within 2x of SDPA's bf16 error; 8 and 40 give
    # dQ/dK/dV relative errors near 1 (their forward is right). Others are not
    # verified, so they stay on the next backend.
    sm90_headdims = (64, 96, 128, 192, 256)

    # A dense call records FA4's compiled calls on its layout's second call, not its first: a shape seen once
    # (a prompt of a new length, an evaluation batch) never pays a recording (a second set of the call's
    # outputs and one read-back to check the replay); a training step's shapes recur from the second step on.
    REPLAY_SIGHTINGS = 2
    # Keys (layouts and arguments) whose replays or sightings are kept: a Replay holds its compiled functions
    # and argument lists, no tensors.
    MAX_REPLAYS = 256

    def __init__(self, api=_fa4_api, tuning: _tuning.Fa4Tuning = _tuning.FA4):
        self._api, self.tuning = api, tuning
        self._replays: dict = {}

    def _extra_refusals(self, spec, q, k):
        r = self._kernel_refusals(q)
        if not is_bottom_right(spec, q.shape[1], k.shape[1]):
            r.append(f"mask offset {spec.q_offset} is not bottom-right aligned ({k.shape[1] - q.shape[1]})")
        return r + self._install_refusals(q)

    def _kernel_refusals(self, q) -> list[str]:
        """What the base checks do not cover: the head dims of each architecture."""
        d = q.shape[-1]
        if d < self.min_headdim:
            return [f"head dim {d} < {self.min_headdim}"]
        if q.device.type != "cuda":
            return []
        cap = self.capability(q.device)
        top = self.arch_max_headdim.get(cap[0])
        if top is None:  # below min_capability the base class says so
            return [] if cap < self.min_capability else [f"compute capability {cap}: FA4 runs here on sm_90 and "
                                                         "sm_100 only"]
        if d > top:
            return [f"head dim {d} > {top} on sm_{cap[0]}0"]
        if cap[0] == 9 and d not in self.sm90_headdims:
            return [f"head dim {d} on sm_90: verified only {self.sm90_headdims} (8 and 40 give wrong gradients)"]
        return []

    def _install_refusals(self, q) -> list[str]:
        # Only a CUDA call imports FA4 (CuTe DSL's import is slow, and pointless elsewhere).
        why = self._api.problem() if q.device.type == "cuda" else None
        return [why] if why else []

    def varlen_refusals(self, q: torch.Tensor) -> list[str]:
        """Why the varlen kernel (packed documents, cu_seqlens) cannot take ``q``
        (T, H, D); its masks are the dense kernel's, per document."""
        if q.device.type != "cuda":
            return [f"FA4 needs CUDA, not {q.device.type}"]
        r = [] if q.dtype in self.dtypes else [f"FA4 needs fp16/bf16, not {q.dtype}"]
        d = q.shape[-1]
        if d % self.headdim_multiple or d > self.max_headdim:
            r.append(f"head dim {d} not a multiple of {self.headdim_multiple} up to {self.max_headdim}")
        if self.capability(q.device) < self.min_capability:
            r.append(f"compute capability {self.capability(q.device)} < {self.min_capability}")
        return (r + self._kernel_refusals(q)) or self._install_refusals(q)

    def forward(self, q, k, v, spec):
        win, pack = spec.flash_window(), self.pack_gqa(q, k, spec)
        if not self._replaying(q, k):
            return self._api.forward(q, k, v, spec.scale, spec.causal, win, softcap=spec.softcap, pack_gqa=pack)
        t = self._api.forward_inputs(q, k, v)
        return self._replayed("fwd", t, spec, (pack,), lambda: self._api.record_forward(
            *t.values(), spec.scale, spec.causal, win, softcap=spec.softcap, pack_gqa=pack),
            lambda: self._api.forward(*t.values(), spec.scale, spec.causal, win, softcap=spec.softcap, pack_gqa=pack))

    def pack_gqa(self, q, k, spec) -> Optional[bool]:
        """FA4's ``pack_gqa`` for a (B, S, H, D) call: False (each query head its own
        tiles) for causal GQA squares (as many keys as queries: the shapes
        measured) whose length is in ``self.tuning.unpacked_gqa_causal_rows``,
        else None (FA4's choice)."""
        lo, hi = self.tuning.unpacked_gqa_causal_rows
        square = q.shape[1] == k.shape[1]
        return False if spec.causal and square and q.shape[2] != k.shape[2] and lo <= q.shape[1] <= hi else None

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        win = spec.flash_window()
        if not self._replaying(q, k):
            return self._api.backward(dout, q, k, v, out, lse, spec.scale, spec.causal, win, dlse,
                                      softcap=spec.softcap)
        t = self._api.backward_inputs(dout, q, k, v, out, lse, dlse)
        args = lambda: (t["dout"], t["q"], t["k"], t["v"], t["out"], t["lse"], spec.scale, spec.causal, win, t["dlse"])
        return self._replayed("bwd", t, spec, (), lambda: self._api.record_backward(*args(), softcap=spec.softcap),
                              lambda: self._api.backward(*args(), softcap=spec.softcap))

    def _replaying(self, q, k) -> bool:
        return replays(q, k, self.tuning)

    def _replayed(self, which: str, tensors: dict, spec, extra: tuple, record, own):
        """A pass through the replays of its layout and arguments (:func:`longattn.backends._fa4_api.replayed`),
        recorded on the key's second call (:attr:`REPLAY_SIGHTINGS`); at most :attr:`MAX_REPLAYS` keys kept,
        the oldest dropped first."""
        key = (which, *self._api.replay_key(*tensors.values(), scale=spec.scale), spec.causal, spec.flash_window(),
               float(spec.softcap), *extra)
        store = self._replays
        if key not in store and len(store) >= self.MAX_REPLAYS:
            store.pop(next(iter(store), None), None)  # another thread may have dropped it first
        return self._api.replayed(store, key, tensors, True, record, own, sightings=self.REPLAY_SIGHTINGS)


def replays(q, k, tuning: _tuning.Fa4Tuning = _tuning.FA4) -> bool:
    """Whether an FA4 call of ``q`` against ``k`` records and replays its compiled calls
    (``tuning.replay_max_tokens`` over its query and its key tokens, batch x rows each): the one decision,
    for the dense backend's calls and the mask calls of :mod:`longattn.flex.fa4` alike."""
    return max(q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]) <= tuning.replay_max_tokens
