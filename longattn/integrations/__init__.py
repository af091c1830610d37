"""Adapters that make longattn the attention of other libraries' models.

* :mod:`longattn.integrations.transformers` — Hugging Face transformers
  (``attn_implementation="longattn" | "longattn_ring" | "longattn_dilated"``).

Each adapter imports its library only when imported itself.
"""
