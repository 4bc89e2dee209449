"""Installed versions of the packages under test (read from package metadata, never imported)."""

from __future__ import annotations

from importlib import metadata

PACKAGES = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "tensordict")


def installed_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found
