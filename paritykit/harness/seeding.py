"""Deterministic seeds derived from names: the same on every rank and in every process.

Python's ``hash`` of a string changes per process, so seeds that must agree between ranks (and
between runs) are derived with crc32 of the parts' text instead.
"""

from __future__ import annotations

import zlib
from typing import Any

_SEED_SPACE = 2**31 - 1


def stable_seed(*parts: Any) -> int:
    """A seed in [0, 2**31 - 1) from the text of ``parts``; equal parts give equal seeds everywhere."""
    text = "\x1f".join(repr(part) if not isinstance(part, str) else part for part in parts)
    return zlib.crc32(text.encode()) % _SEED_SPACE


def generator(*parts: Any):
    """A CPU ``torch.Generator`` seeded with ``stable_seed(*parts)``."""
    import torch

    return torch.Generator().manual_seed(stable_seed(*parts))
