"""Our Triton flash-attention kernel as a backend (longattn.kernels)."""
from __future__ import annotations

import torch

from ..kernels import _common
from .base import Backend


class TritonBackend(Backend):
    """Our Triton flash-attention kernel: any mask offset, sliding windows,
    native GQA, packed documents and dilated branches
    (:meth:`kernel_refusals`). On CPU it runs only
    under ``TRITON_INTERPRET=1`` (tests), and only where named: ``auto``
    takes the math backend there (:meth:`auto_refusals`)."""

    name = "triton"
    devices = ("cuda", "cpu")
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    max_headdim = 256
    supports_window = True
    supports_gqa_native = True

    def _extra_refusals(self, spec, q, k):
        r = []
        if not _common.available(q.device):
            r.append(_common.unavailable_reason(q.device))
        d = q.shape[-1]
        if d not in _common.SUPPORTED_HEADDIMS:
            r.append(f"head dim {d} not in {_common.SUPPORTED_HEADDIMS}")
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            r.append("the Triton interpreter has no bf16")
        return r

    def auto_refusals(self, q: torch.Tensor) -> list[str]:
        # On CPU the kernels run only under the Triton interpreter, a debugging
        # mode: one forward of 64 / 1024 tokens (4 heads, window) took 290 / 5105 ms
        # against math's 0.3 / 31 on 2 cores (benchmarks/cpu_interpreter_cost.py ->
        # benchmarks/results/cpu_interpreter_cost_cpu_ebf6a03.json). The varlen,
        # dilated and decode engines take the kernels only on CUDA too.
        if q.device.type == "cpu":
            return ["on CPU it runs only under the Triton interpreter (slower than math): backend='triton' runs it"]
        return []

    def kernel_refusals(self, q: torch.Tensor) -> list[str]:
        """Why our Triton kernels cannot take ``q`` in any kind of call (dense,
        packed documents ``(T, H, D)``, dilated branches)."""
        r = [] if q.dtype in self.dtypes else [f"dtype {q.dtype} unsupported (fp16, bf16, fp32)"]
        return r + self._extra_refusals(None, q, None)

    def forward(self, q, k, v, spec):
        from ..kernels import launch

        return launch.forward(q, k, v, spec)

    def backward(self, dout, q, k, v, out, lse, spec, dlse=None):
        from ..kernels import launch

        return launch.backward(dout, q, k, v, out, lse, spec, dlse)
