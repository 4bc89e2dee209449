"""Golden fixtures: small recorded cases that pin the numbers themselves, not only their agreement.

Every parity check compares two torchrec paths with each other. A release that changes the
numbers the same way on both sides passes every such comparison; a golden fixture catches it. Each
recipe builds its inputs and weights from a seed, computes the reference output with the plain,
unsharded module, and stores inputs, weights and outputs. ``verify`` re-runs the computation from the
stored inputs with the installed stack and compares with the stored outputs.

The manifest (``manifest.json``) records the versions that recorded the fixtures and a sha256 per
file: a tampered file fails verification naming it; a fixture recorded with other versions is
reported with the version difference (and still verified: numbers should not move across versions
unless a release says so).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from paritykit.checks.golden.recipes import RECIPES
from paritykit.checks.results import CaseResult
from paritykit.compare import assert_close
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.versions import installed_versions

MANIFEST = "manifest.json"
# The repository's fixtures/ (next to the paritykit package in a source checkout).
DEFAULT_DIR = Path(__file__).resolve().parents[3] / "fixtures"
CHECK = "fixtures"

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(directory: Path = DEFAULT_DIR, names: list[str] | None = None) -> Path:
    """Compute every recipe with the installed stack and write it with a manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"versions": installed_versions(), "recorded": time.strftime("%Y-%m-%d"), "files": {}}
    for name in names or sorted(RECIPES):
        inputs, compute = RECIPES[name]()
        path = directory / f"{name}.pt"
        torch.save({"inputs": inputs, "expected": compute(inputs)}, path)
        manifest["files"][path.name] = _sha256(path)
    manifest_path = directory / MANIFEST
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest_path


def verify(directory: Path = DEFAULT_DIR) -> list[CaseResult]:
    """One CaseResult per fixture file: hash, version and numbers checked against the stored ones."""
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise HarnessError(f"no fixture manifest at {manifest_path}; run `paritykit fixtures record`")
    manifest = json.loads(manifest_path.read_text())
    version_note = _version_difference(manifest.get("versions", {}), installed_versions())
    results = []
    for file_name, digest in sorted(manifest["files"].items()):
        started = time.perf_counter()
        name = file_name.removesuffix(".pt")
        replay = f"paritykit fixtures verify --dir {directory}"
        path = directory / file_name
        status, message = "pass", version_note
        try:
            if not path.exists():
                raise HarnessError(f"fixture {path} is listed in {MANIFEST} but missing")
            if _sha256(path) != digest:
                raise ParityError(f"fixture {path} was modified after recording: sha256 {_sha256(path)} vs manifest {digest}")
            if name not in RECIPES:
                raise HarnessError(f"fixture {path} has no recipe {name!r} in this paritykit")
            stored = torch.load(path, weights_only=False)
            _, compute = RECIPES[name]()
            assert_close(compute(stored["inputs"]), stored["expected"], msg=f"fixture {file_name} (numbers recorded with {manifest.get('versions')})")
        except ParityError as exc:
            status, message = "fail", "\n".join(filter(None, [str(exc), version_note]))
        except HarnessError as exc:
            status, message = "error", str(exc)
        results.append(CaseResult(CHECK, name, status, replay=replay, message=message, duration_s=time.perf_counter() - started))
    return results


def _version_difference(recorded: dict[str, str], installed: dict[str, str]) -> str:
    changed = [f"{k} {recorded.get(k, '-')} -> {installed.get(k, '-')}" for k in sorted(set(recorded) | set(installed)) if recorded.get(k) != installed.get(k)]
    return f"recorded with other versions: {', '.join(changed)}" if changed else ""
