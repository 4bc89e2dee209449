"""Carry a file too large for one transfer in pieces: split it here, join and verify it there.

    python gpu/pieces.py split WHEEL DIR [--mib 60]   # DIR/<wheel>.part-000, ... and DIR/<wheel>.sha256
    python gpu/pieces.py join DIR OUT_DIR             # OUT_DIR/<wheel>, checked against the sha256

The device machines take at most 64 MiB of files per call, so the 465 MB fbgemm-gpu CUDA wheel
travels as eight 60 MiB pieces, one per call (docs/gpu.md); join refuses a missing, extra or
corrupt piece, naming it, before pip ever sees the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

MIB = 1024 * 1024
PART = ".part-"


def split(wheel: Path, directory: Path, piece_bytes: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    data = wheel.read_bytes()
    pieces = []
    for index, start in enumerate(range(0, len(data), piece_bytes)):
        piece = directory / f"{wheel.name}{PART}{index:03d}"
        piece.write_bytes(data[start : start + piece_bytes])
        pieces.append(piece)
    count = len(pieces)
    (directory / f"{wheel.name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {wheel.name}  {count}\n")
    return pieces


def join(directory: Path, out_directory: Path) -> Path:
    manifests = sorted(directory.glob("*.sha256"))
    if len(manifests) != 1:
        raise SystemExit(f"join: expected one .sha256 manifest in {directory}, found {[m.name for m in manifests]}")
    digest, name, count = manifests[0].read_text().split()
    expected = [directory / f"{name}{PART}{index:03d}" for index in range(int(count))]
    missing = [piece.name for piece in expected if not piece.exists()]
    extra = sorted(p.name for p in directory.glob(f"{name}{PART}*") if p not in expected)
    if missing or extra:
        raise SystemExit(f"join: {name} has {count} pieces; missing {missing}, unexpected {extra}")
    data = b"".join(piece.read_bytes() for piece in expected)
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise SystemExit(f"join: {name} joined from {count} pieces has sha256 {actual}, the manifest says {digest}")
    out_directory.mkdir(parents=True, exist_ok=True)
    wheel = out_directory / name
    wheel.write_bytes(data)
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    split_parser = sub.add_parser("split")
    split_parser.add_argument("wheel", type=Path)
    split_parser.add_argument("directory", type=Path)
    split_parser.add_argument("--mib", type=int, default=60, help="piece size in MiB (default 60; a call carries 64 MiB)")
    join_parser = sub.add_parser("join")
    join_parser.add_argument("directory", type=Path)
    join_parser.add_argument("out_directory", type=Path)
    args = parser.parse_args(argv)
    if args.action == "split":
        pieces = split(args.wheel, args.directory, args.mib * MIB)
        print(f"{args.wheel.name}: {len(pieces)} pieces in {args.directory}")
    else:
        print(join(args.directory, args.out_directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
