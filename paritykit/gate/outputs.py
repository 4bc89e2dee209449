"""Output paths checked before anything runs: a gate that cannot write its report must say so in a
second, not after its whole run (exit 2, naming the path and why)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from paritykit.errors import HarnessError

PROBE_NAME = ".paritykit-write-probe"


def require_writable_directory(directory: Path, option: str, files: Iterable[str] = ()) -> Path:
    """Create ``directory`` if needed and prove it writable (a probe file written and removed), and
    that each of ``files`` in it can be written (an existing one is opened for appending, never
    truncated). HarnessError naming ``option`` and the path otherwise."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / PROBE_NAME
        probe.write_text("")
        probe.unlink()
        for name in files:
            path = directory / name
            if path.exists():
                if path.is_dir():
                    raise IsADirectoryError(f"{path} is a directory")
                with path.open("a"):
                    pass
    except OSError as exc:
        raise HarnessError(f"{option} {directory}: cannot write there ({type(exc).__name__}: {exc}); "
                           "nothing was run") from exc
    return directory


def require_writable_file(path: Path, option: str) -> Path:
    """The file's directory writable and the file itself, if it exists, too; HarnessError otherwise."""
    path = Path(path)
    if path.is_dir():
        raise HarnessError(f"{option} {path}: is a directory; give a file name")
    require_writable_directory(path.parent if str(path.parent) else Path(os.curdir), option, [path.name])
    return path
