"""Where a sync happened: the call site, the caller's own frame and the innermost torchrec frame.

A sync's call site is the innermost frame outside torch and paritykit's sync machinery, with
torchrec's sync helpers (``_safe_tolist``, ``_cuda_to_cpu_safe``) skipped so that the site names the
torchrec function that needed the data (e.g. ``_maybe_compute_length_per_key``); the record also
keeps the caller's own frame (the innermost frame outside torch, torchrec and fbgemm) and the
innermost torchrec frame.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

# Only the sync machinery itself is hidden: other paritykit code (conversions, planted bugs, the
# checks' regions) is code whose syncs and calls must be named.
_SYNC_MACHINERY = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WARNINGS_FILE = os.path.splitext(warnings.__file__)[0]
_TORCHREC_SYNC_HELPERS = frozenset({"_safe_tolist", "_safe_tolist_2d", "_cuda_to_cpu_safe"})
_roots_cache: dict[str, tuple[str, ...]] = {}


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


def _roots(kind: str) -> tuple[str, ...]:
    roots = _roots_cache.get(kind)
    if roots is None:
        names = {"torch": ("torch",), "torchrec": ("torchrec",), "fbgemm": ("fbgemm_gpu",)}[kind]
        roots = tuple(d for d in (_package_dir(n) for n in names) if d)
        if all(n in sys.modules for n in names):
            _roots_cache[kind] = roots
    return roots


def _is_machinery(filename: str) -> bool:
    return (
        filename.startswith(_roots("torch"))
        or filename.startswith(_SYNC_MACHINERY)
        or filename.startswith(_WARNINGS_FILE)
        or filename.startswith("<frozen")
    )


def format_frame(frame: FrameType) -> str:
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def short_path(filename: str) -> str:
    """A path relative to its import root (torchrec/sparse/jagged_tensor.py) or to the working directory."""
    best = None
    for entry in sys.path:
        if entry and filename.startswith(entry.rstrip(os.sep) + os.sep):
            if best is None or len(entry) > len(best):
                best = entry
    if best is not None:
        return os.path.relpath(filename, best)
    cwd = os.getcwd()
    if filename.startswith(cwd + os.sep):
        return os.path.relpath(filename, cwd)
    return filename


def locate(frame: FrameType | None) -> tuple[str, str | None, str | None, FrameType | None]:
    """(site, user_site, torchrec_site, innermost frame outside the machinery)."""
    torchrec_roots = _roots("torchrec")
    outside_roots = torchrec_roots + _roots("fbgemm")
    site = user_site = torchrec_site = None
    first = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_machinery(filename):
            if first is None:
                first = frame
            in_torchrec = bool(torchrec_roots) and filename.startswith(torchrec_roots)
            helper = in_torchrec and frame.f_code.co_name in _TORCHREC_SYNC_HELPERS
            if site is None and not helper:
                site = format_frame(frame)
            if torchrec_site is None and in_torchrec and not helper:
                torchrec_site = site if site is not None else format_frame(frame)
            if user_site is None and not filename.startswith(outside_roots):
                user_site = format_frame(frame)
                break
        frame = frame.f_back
    return site or user_site or "<unknown>", user_site, torchrec_site, first


def stack_lines(frame: FrameType | None) -> tuple[str, ...]:
    lines = []
    while frame is not None:
        lines.append(format_frame(frame))
        frame = frame.f_back
    return tuple(lines)
