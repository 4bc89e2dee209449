"""Differences and the tolerance policy: what "equal" means for one tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# torch.testing.assert_close's defaults (rtol, atol) per dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}

# Stop collecting after this many differences: the first few locate the problem.
MAX_REPORTED_DIFFERENCES = 10


@dataclass(frozen=True)
class Difference:
    """One place where actual and expected disagree."""

    path: str
    kind: str  # "structure" or "value"
    detail: str
    max_abs_error: float = 0.0

    def __str__(self) -> str:
        return f"[{self.kind}] {self.path}: {self.detail}"


@dataclass(frozen=True)
class Policy:
    rtol: float | None
    atol: float | None
    exact: bool
    # atol grows by this many times the largest |expected| of each compared tensor (norm-wise bound).
    max_relative: float = 0.0
