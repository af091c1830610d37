"""Modules: DilatedAttention, MultiheadDilatedAttention, RingAttention, LongNetLM."""
from .attention import DilatedAttention, MultiheadDilatedAttention, RingAttention
from .longnet import LongNetLM

__all__ = ["DilatedAttention", "MultiheadDilatedAttention", "RingAttention", "LongNetLM"]
