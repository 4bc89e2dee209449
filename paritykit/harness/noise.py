"""Silence output that every call would repeat and that says nothing about a result."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator


def quiet_known_noise() -> None:
    """torchrec's per-module INFO/WARNING logs (the metrics' "NaN: no positive yet" among them), torch's
    fx-tracing notice, deprecation notices, fbgemm's note that its dense TBE lookup has no autograd kernel
    registered (repeated on every backward; the gradients are what the parity checks compare), and
    torch.meshgrid's notice of a future default (XAUC calls it on every update). Failures keep their
    tracebacks."""
    for name in ("torchrec", "torch.fx._symbolic_trace", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered.*")
    warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage.*")
    warnings.filterwarnings("ignore", message=".*torch.meshgrid: in an upcoming release.*")


@contextlib.contextmanager
def quiet_planner() -> Iterator[None]:
    """torchrec's planner logs its search and a table of the plan at INFO/WARNING on every call."""
    logger = logging.getLogger("torchrec.distributed.planner")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """torchrec warns on the root logger on every non-strict export of ``to_dict`` ("extremely slow"), and
    torch on fx tracing: said once per export, about speed, not results."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)
