"""One scatter and one gather of sharded state, with a coverage check.

A sharded module's state (tables, fused optimizer state) is a mapping from names to ShardedTensor
(local shards at global offsets) or plain tensors (replicated: data-parallel tables, dense
parameters). Everything that moves full tensors into shards or puts shards back together goes
through here:

    pieces = local_pieces(sharded.state_dict(), table_of_key)   # this rank's pieces, by table
    scatter(pieces, full)                                        # full tensors -> local pieces
    full = assemble(per_rank_pieces, "tables after step 3")      # pieces of every rank -> full

``assemble`` raises ParityError when the pieces do not tile a tensor exactly once, or when
replicas differ between ranks: both are torchrec's sharding computing something wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paritykit.errors import HarnessError, ParityError


@dataclass
class Piece:
    """One rank's part of a named tensor: a shard at ``offsets`` of a tensor of ``size``, or a replica."""

    name: str
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    replicated: bool = False


def window(full: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The slice of ``full`` that a shard of ``shape`` at ``offsets`` covers."""
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]


def local_pieces(state: Mapping[str, Any], name_of: Callable[[str], str | None] = lambda key: key) -> list[Piece]:
    """This rank's pieces of every entry of ``state`` that ``name_of`` names (None: skipped)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    pieces = []
    for key, value in state.items():
        name = name_of(key)
        if name is None:
            continue
        if isinstance(value, ShardedTensor):
            size = tuple(value.size())
            for shard in value.local_shards():
                pieces.append(Piece(name, size, tuple(shard.metadata.shard_offsets), shard.tensor))
        elif _is_dtensor(value):
            raise HarnessError(f"{name!r}: DTensor state (torchrec's output_dtensor) is not supported by paritykit")
        elif isinstance(value, torch.Tensor):
            pieces.append(Piece(name, tuple(value.shape), (0,) * value.dim(), value, replicated=True))
    return pieces


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def detached(pieces: Sequence[Piece]) -> list[Piece]:
    """CPU copies of the pieces, safe to send to another process and to keep past later steps."""
    return [Piece(p.name, p.size, p.offsets, p.tensor.detach().cpu().clone(), p.replicated) for p in pieces]


def scatter(pieces: Sequence[Piece], full: Mapping[str, torch.Tensor], what: str = "table") -> None:
    """Copy each full tensor into this rank's pieces of it; HarnessError for a missing or misshapen one."""
    missing = sorted({p.name for p in pieces} - set(full))
    if missing:
        raise HarnessError(f"no full weight given for {what}(s) {missing}")
    with torch.no_grad():
        for piece in pieces:
            given = full[piece.name]
            if tuple(given.shape) != piece.size:
                raise HarnessError(
                    f"{what} {piece.name!r}: full weight has shape {tuple(given.shape)}, the module expects {piece.size}"
                )
            piece.tensor.copy_(window(given, piece.offsets, piece.tensor.shape))


def assemble(per_rank: Sequence[Sequence[Piece]], what: str = "sharded state") -> dict[str, torch.Tensor]:
    """Full tensors from every rank's pieces (rank order). ParityError names the tensor, element or
    rank when shards overlap, leave a gap or replicas disagree."""
    full: dict[str, torch.Tensor] = {}
    coverage: dict[str, torch.Tensor] = {}
    replicas: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, pieces in enumerate(per_rank):
        for piece in pieces:
            if piece.replicated:
                replicas.setdefault(piece.name, []).append((rank, piece.tensor))
                continue
            if piece.name not in full:
                full[piece.name] = torch.zeros(piece.size, dtype=piece.tensor.dtype)
                coverage[piece.name] = torch.zeros(piece.size, dtype=torch.int32)
            window(full[piece.name], piece.offsets, piece.tensor.shape).copy_(piece.tensor)
            window(coverage[piece.name], piece.offsets, piece.tensor.shape).add_(1)
    for name, copies in replicas.items():
        holders = [rank for rank, _ in copies]
        if len(holders) != len(per_rank):
            raise ParityError(f"{what}: replicated {name!r} is held by ranks {holders} only, of {len(per_rank)}")
        full[name] = _agreed(name, copies, what)
        coverage.setdefault(name, torch.ones(full[name].shape, dtype=torch.int32))
    for name, count in coverage.items():
        if not bool((count == 1).all()):
            index = [int(i) for i in (count != 1).nonzero()[0]]
            raise ParityError(
                f"{what}: {name!r} element {index} is held by {int(count[tuple(index)])} shard(s) across ranks, expected 1"
            )
    return full


def _agreed(name: str, copies: list[tuple[int, torch.Tensor]], what: str) -> torch.Tensor:
    first_rank, first = copies[0]
    for rank, tensor in copies[1:]:
        if tensor.shape != first.shape or not torch.equal(tensor, first):
            detail = f"shape {tuple(tensor.shape)} vs {tuple(first.shape)}"
            if tensor.shape == first.shape:
                index = tuple(int(i) for i in (tensor != first).nonzero()[0]) if tensor.dim() else ()
                detail = f"at {list(index)}: {tensor[index].item()!r} != {first[index].item()!r}"
            raise ParityError(f"{what}: replicated {name!r} on rank {rank} differs from rank {first_rank} {detail}")
    return first.clone()


def gather_on_ranks(pieces: Sequence[Piece], what: str = "sharded state") -> dict[str, torch.Tensor]:
    """Inside a rank: every rank's pieces gathered and assembled; every rank gets the full tensors."""
    import torch.distributed as dist

    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, detached(pieces))
    return assemble(per_rank, what)
