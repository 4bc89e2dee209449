"""What one op case is: the op's name, how its inputs are drawn, the pinned inputs that always run,
and the body that runs torchrec's op and compares it with the reference."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from hypothesis import strategies as st

from paritykit.errors import UnsupportedByTorchrec

Metrics = dict[str, Any]


@dataclass(frozen=True)
class OpCase:
    """One op (or a few ops that only make sense together, e.g. dist_splits with dist_labels).

    name: how the op reads in a case id and in docs/sparse_ops.md (``kjt.permute``).
    strategy: draws one input spec; body(spec) runs the op and raises ParityError on a difference.
    pinned: specs that run first on every gate (the self-test's few examples rely on them).
    """

    name: str
    strategy: st.SearchStrategy
    body: Callable[[Any], Metrics | None]
    pinned: tuple[Any, ...] = field(default=())

    def case_id(self, spec: Any) -> str:
        return f"{self.name}: {spec!r}"


# torch/fbgemm's words when a CPU kernel has no version for a dtype ("... not implemented for 'Double'").
_NO_KERNEL = re.compile(r"not implemented for '(\w+)'")


def refused_dtype(call: Callable[[], Any], what: str) -> Any:
    """``call()``; a kernel that has no version for the input's dtype is reported as unsupported
    (neither passed nor failed), with torchrec's words. Everything else propagates."""
    try:
        return call()
    except (RuntimeError, NotImplementedError) as exc:
        found = _NO_KERNEL.search(str(exc))
        if found is None:
            raise
        raise UnsupportedByTorchrec(f"{what}: this stack's CPU kernel has no {found.group(1)} version ({exc})") from None

