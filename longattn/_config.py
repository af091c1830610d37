"""The environment variables longattn reads, read in this one place, once, at import.

=============================  =====================================================================
``TRITON_INTERPRET=1``         Triton kernels run on CPU under Triton's interpreter (tests); Triton
                               itself reads it when the kernels are defined, so it is fixed at import.
``LONGATTN_TRITON_AUTOTUNE``   ``0``: the fused dilated kernels use the built-in tile table; ``1``:
                               tiles are autotuned per shape (also under the CPU interpreter); unset:
                               autotuned on CUDA.
``LONGATTN_CACHE_DIR``         where autotuned tile choices persist (default ``~/.cache/longattn``).
``LONGATTN_RING_TRANSPORT``    the ring's transport when none is forced with
                               :func:`longattn.distributed.use_transport`: ``auto``, ``nccl``, ``copy``.
``LONGATTN_COPY_SYNC``         ``barrier``: the copy-engine transport orders exchanges with a barrier
                               kernel instead of stream memory operations (drivers that refuse them).
=============================  =====================================================================

Code that needs another setting takes it as an argument (a tuning object, a
transport, an autotuner), never from the environment.
"""
from __future__ import annotations

import dataclasses
import os

TRANSPORTS = ("auto", "nccl", "copy")


@dataclasses.dataclass(frozen=True)
class Env:
    triton_interpret: bool
    triton_autotune: str
    cache_dir: str
    ring_transport: str
    copy_sync: str

    @staticmethod
    def read() -> "Env":
        env = Env(
            triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
            triton_autotune=os.environ.get("LONGATTN_TRITON_AUTOTUNE", ""),
            cache_dir=os.environ.get("LONGATTN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                          "longattn"),
            ring_transport=os.environ.get("LONGATTN_RING_TRANSPORT", "auto"),
            copy_sync=os.environ.get("LONGATTN_COPY_SYNC", "memops"),
        )
        if env.triton_autotune not in ("", "0", "1"):
            raise ValueError(f"LONGATTN_TRITON_AUTOTUNE must be 0, 1 or unset, got {env.triton_autotune!r}")
        if env.ring_transport not in TRANSPORTS:
            raise ValueError(f"LONGATTN_RING_TRANSPORT must be one of {TRANSPORTS}, got {env.ring_transport!r}")
        if env.copy_sync not in ("memops", "barrier"):
            raise ValueError(f"LONGATTN_COPY_SYNC must be 'memops' or 'barrier', got {env.copy_sync!r}")
        return env


ENV = Env.read()
