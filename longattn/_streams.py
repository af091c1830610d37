"""Side CUDA streams, made once per (device, purpose) and kept: a stream made
during a CUDA graph capture could not be joined back into it, and making one
per call costs host time. Purposes keep unrelated work apart (the ring's
transfers never queue behind the dilated views' branch calls)."""
from __future__ import annotations

from typing import Hashable, Union

import torch

_streams: dict = {}


def _key(device: Union[int, torch.device], purpose: Hashable) -> tuple:
    return torch.device("cuda", device) if isinstance(device, int) else device, purpose


def side_stream(device: Union[int, torch.device], purpose: Hashable) -> torch.cuda.Stream:
    """The side stream of ``purpose`` on ``device`` (made on first use)."""
    key = _key(device, purpose)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=key[0])
    return _streams[key]


def has_side_stream(device: Union[int, torch.device], purpose: Hashable) -> bool:
    """Whether :func:`side_stream` has made that stream already."""
    return _key(device, purpose) in _streams
