"""Golden fixtures: small recorded cases that pin the numbers themselves, not only their agreement.

Every parity check compares two torchrec paths with each other. A release that changes the
numbers the same way on both sides passes every such comparison; a golden fixture catches it. Each
recipe builds its inputs and weights from a seed, computes the reference output with the plain,
unsharded module, and stores inputs, weights and outputs. ``verify`` re-runs the computation from the
stored inputs with the installed stack and compares with the stored outputs.

Goldens are kept per stack (torchrec, torch and fbgemm versions): ``<dir>/<stack>/<recipe>.pt``
and one ``manifest.json`` with each stack's versions and a sha256 per file. A stack is verified
against its own goldens when it has some; a stack with none (a release under test) is verified
against the goldens of the closest trusted stack recorded before it, and each fixture says by how
much its numbers moved. Goldens are recorded on a trusted stack, never on the one under test.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from paritykit.checks.golden.recipes import RECIPES
from paritykit.checks.results import CaseResult
from paritykit.compare import assert_close, max_abs_diff
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.versions import installed_versions

MANIFEST = "manifest.json"
FORMAT = 2
# Shipped with the package (package data), so an installed wheel verifies them too.
DEFAULT_DIR = Path(__file__).resolve().parent / "fixtures"
CHECK = "fixtures"
STACK_PACKAGES = ("torchrec", "torch", "fbgemm-gpu", "fbgemm-gpu-cpu")


def stack_key(versions: dict[str, str]) -> str:
    """The name of a stack's goldens, e.g. ``torchrec-1.8.0_torch-2.13.0_fbgemm-gpu-cpu-1.8.0`` (local tags dropped)."""
    return "_".join(f"{p}-{Version(versions[p]).public}" for p in STACK_PACKAGES if p in versions)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest as {"format": 2, "stacks": {key: {"versions", "recorded", "files"}}} (a
    single-stack manifest of format 1, files beside it, is read as one stack in ``.``)."""
    path = directory / MANIFEST
    if not path.exists():
        raise HarnessError(missing_fixtures_message(directory))
    data = json.loads(path.read_text())
    if "stacks" in data:
        return data
    key = stack_key(data.get("versions", {}))
    return {"format": FORMAT, "stacks": {key: {**data, "dir": "."}}}


def missing_fixtures_message(directory: Path) -> str:
    return (
        f"no golden fixtures at {directory}. Record them on a trusted stack, not on the stack under test: "
        f"there run `paritykit fixtures record --dir DIR`, then give this gate `--fixtures-dir DIR`"
    )


def record(directory: Path = DEFAULT_DIR, names: list[str] | None = None) -> Path:
    """Compute every recipe with the installed stack and store them as this stack's goldens."""
    versions = installed_versions()
    key = stack_key(versions)
    manifest = read_manifest(directory) if (directory / MANIFEST).exists() else {"format": FORMAT, "stacks": {}}
    stack_dir = directory / key
    stack_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in names or sorted(RECIPES):
        inputs, compute = RECIPES[name]()
        path = stack_dir / f"{name}.pt"
        torch.save({"inputs": inputs, "expected": compute(inputs)}, path)
        files[path.name] = _sha256(path)
    manifest["stacks"][key] = {"versions": versions, "recorded": time.strftime("%Y-%m-%d"), "files": files}
    manifest_path = directory / MANIFEST
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest_path


def goldens_for(stacks: dict[str, dict], installed: dict[str, str]) -> tuple[str, str]:
    """(the stack whose goldens this stack is verified against, a note when it is not its own).

    Its own goldens if recorded; otherwise the recorded stack with the highest torchrec version not
    above the installed one (the last trusted release before it), else the lowest recorded.
    """
    own = stack_key(installed)
    if own in stacks:
        return own, ""

    def torchrec_of(key: str) -> Version:
        return Version(stacks[key].get("versions", {}).get("torchrec", "0"))

    current = Version(installed.get("torchrec", "0"))
    older = sorted((k for k in stacks if torchrec_of(k) <= current), key=torchrec_of)
    chosen = older[-1] if older else min(stacks, key=torchrec_of)
    return chosen, (
        f"no goldens recorded for this stack ({own}); verified against the goldens of {chosen}. "
        "Once this stack is trusted, record its own: `paritykit fixtures record`"
    )


def verify(directory: Path = DEFAULT_DIR) -> list[CaseResult]:
    """One CaseResult per fixture: hash, then numbers against the goldens, with how far they moved."""
    stacks = read_manifest(directory)["stacks"]
    if not stacks:
        raise HarnessError(missing_fixtures_message(directory))
    key, note = goldens_for(stacks, installed_versions())
    stack = stacks[key]
    stack_dir = directory / stack.get("dir", key)
    replay = f"paritykit fixtures verify --dir {directory}"
    return [_verify_one(stack_dir / file_name, digest, key, note, replay) for file_name, digest in sorted(stack["files"].items())]


def _verify_one(path: Path, digest: str, key: str, note: str, replay: str) -> CaseResult:
    started = time.perf_counter()
    file_name = path.name
    name = file_name.removesuffix(".pt")
    status, message, metrics = "pass", note, {"goldens": key}
    try:
        if not path.exists():
            raise HarnessError(f"fixture {path} is listed in {MANIFEST} but missing")
        if _sha256(path) != digest:
            raise ParityError(f"fixture {path} was modified after recording: sha256 {_sha256(path)} vs manifest {digest}")
        if name not in RECIPES:
            raise HarnessError(f"fixture {path} has no recipe {name!r} in this paritykit")
        stored = torch.load(path, weights_only=False)
        _, compute = RECIPES[name]()
        actual = compute(stored["inputs"])
        metrics["max_abs_diff"] = max_abs_diff(actual, stored["expected"])
        assert_close(actual, stored["expected"], msg=f"fixture {file_name}: numbers moved by up to {metrics['max_abs_diff']:.3g} (max abs) from the goldens of {key}")
    except ParityError as exc:
        status, message = "fail", "\n".join(filter(None, [str(exc), note]))
    except HarnessError as exc:
        status, message = "error", str(exc)
    return CaseResult(CHECK, name, status, replay=replay, message=message, metrics=metrics, duration_s=time.perf_counter() - started)
