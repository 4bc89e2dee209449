"""What `paritykit coverage` measures: the installed torchrec's training and inference surface, and how it is grouped.

In scope: torchrec's ``sparse/``, ``modules/``, ``optim/`` and ``distributed/`` (what training runs), and
``quant/`` (the quantized modules that inference sharding runs) and ``metrics/`` (the training metrics),
without the test utilities and benchmarks that ship inside the wheel. The summary groups the files
as issue-sized areas (the sharding types, the sharded modules, the kernels, the collectives, the
pipelines); ``FOCUS`` are the areas the gate is expected to hold under an oracle almost entirely.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from paritykit.errors import HarnessError

SCOPE_DIRS = ("sparse", "modules", "optim", "distributed", "quant", "metrics")
OMIT = ("*/test_utils/*", "*/tests/*", "*/benchmark/*", "*/benchmarks/*")


@dataclass(frozen=True)
class Group:
    """A named set of torchrec files (globs relative to the torchrec package)."""

    name: str
    patterns: tuple[str, ...]
    focus: bool = False

    def holds(self, relative: str) -> bool:
        return any(fnmatch.fnmatch(relative, pattern) for pattern in self.patterns)


GROUPS = (
    Group("sparse/", ("sparse/*",), focus=True),
    Group("modules/", ("modules/*",)),
    Group("modules/ (embedding modules, configs)", ("modules/embedding_modules.py", "modules/embedding_configs.py"), focus=True),
    Group("optim/", ("optim/*",)),
    Group("quant/ (quantized modules)", ("quant/*",)),
    Group("metrics/", ("metrics/*",)),
    Group("distributed/ (all)", ("distributed/*",)),
    Group("distributed/sharding/ (sharding types)", ("distributed/sharding/*",), focus=True),
    Group("distributed/embedding.py", ("distributed/embedding.py",), focus=True),
    Group("distributed/embeddingbag.py", ("distributed/embeddingbag.py",), focus=True),
    Group("distributed/batched_embedding_kernel.py", ("distributed/batched_embedding_kernel.py",), focus=True),
    Group("distributed/embedding_lookup.py", ("distributed/embedding_lookup.py",), focus=True),
    Group("distributed/comm_ops.py", ("distributed/comm_ops.py",), focus=True),
    Group("distributed/dist_data.py", ("distributed/dist_data.py",), focus=True),
    Group("distributed/model_parallel.py", ("distributed/model_parallel.py",), focus=True),
    Group("distributed/train_pipeline/", ("distributed/train_pipeline/*",), focus=True),
    Group("distributed/planner/", ("distributed/planner/*",)),
    Group("distributed/quant_* (inference)", ("distributed/quant_*", "distributed/infer_utils.py")),
)


def torchrec_dir() -> Path:
    """The installed torchrec package's directory (found without importing torchrec)."""
    spec = importlib.util.find_spec("torchrec")
    if spec is None or not spec.submodule_search_locations:
        raise HarnessError("torchrec is not installed in this environment: nothing to measure")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def relative_name(path: str | Path, root: Path) -> str | None:
    """``path`` relative to the torchrec package, or None when it is outside the measured scope."""
    try:
        relative = Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    if relative.split("/", 1)[0] not in SCOPE_DIRS or any(fnmatch.fnmatch(f"/{relative}", pattern) for pattern in OMIT):
        return None
    return relative


def scope_files(root: Path) -> list[Path]:
    """Every Python file in scope, in a stable order."""
    return sorted(path for directory in SCOPE_DIRS for path in (root / directory).rglob("*.py")
                  if relative_name(path, root) is not None)


def coverage_config(root: Path) -> str:
    """The coverage.py configuration: torchrec's files in scope, measured in every process."""
    sources = "\n".join(f"    {root / directory}" for directory in SCOPE_DIRS)
    omit = "\n".join(f"    {pattern}" for pattern in OMIT)
    return f"[run]\nsource =\n{sources}\nomit =\n{omit}\nparallel = True\n"
