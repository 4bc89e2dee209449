"""Applies paritykit's planted bugs named in ``PARITYKIT_PLANTS`` (comma-separated) to every Python
process started with this directory on ``PYTHONPATH``: ``paritykit plant NAME -- COMMAND`` sets both.

A plant patches torchrec in memory for the life of the process and stands for a buggy torchrec: a
command run this way (a gate, a standalone reproduction) and every rank it spawns (a spawned process
runs this file at start-up too) see the bug, and nothing installed is edited. The plants are applied
here directly, not through ``paritykit.harness.plants.applied``, so that paritykit's rank pools do not
carry them to their ranks a second time. A ``sitecustomize`` this one shadows is run first.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

PLANTS_ENV = "PARITYKIT_PLANTS"


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def _apply_plants() -> None:
    names = [name for name in os.environ.get(PLANTS_ENV, "").split(",") if name]
    if not names:
        return
    from paritykit.checks import load_plants
    from paritykit.harness import plants

    load_plants()
    unknown = [name for name in names if name not in plants.PLANTS]
    if unknown:
        raise SystemExit(f"{PLANTS_ENV}: unknown planted bug(s) {unknown}; `paritykit selftest --list` shows the catalog")
    for name in names:
        held = plants.PLANTS[name].factory()
        held.__enter__()
        _HELD.append(held)  # a dropped context manager would restore torchrec when collected


_HELD: list = []


_run_shadowed_sitecustomize()
_apply_plants()
