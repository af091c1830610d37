"""The engines of decoding with a KV cache, below the public functions
(:func:`longattn.decode_attention`, :func:`longattn.dilated_decode_attention`)
and :class:`longattn.KVCache`, which both call down into them:

* :mod:`.checks` — argument checks, and what a cross-rank check compares;
* :mod:`.engine` — the dense engine of a call (chosen once), the dense part of
  a cache, the call under CUDA graph capture;
* :mod:`.dilated` — the dilated part of a cache, and which keys a query reads;
* :mod:`.bounded` — the dense part where a query sees only its chunk (Llama 4)
  or sliding window;
* :mod:`.graph_steps` — a cache's dense steps replayed from CUDA graphs;
* :mod:`.sharded` — the partial results of the ranks merged by lse.

Inference only: no autograd graph is built.
"""
from .dilated import dilated_read_start

__all__ = ["dilated_read_start"]
