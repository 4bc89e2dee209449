"""Process groups smaller than the world, as torchrec's host-level groups are (TWRW's and GRID's
intra- and cross-host groups): the ranks split into groups, each rank calling with its own."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

# Four ranks as two hosts of two: each group takes one rank of each host, so a group's ranks are
# neither the world's first ones nor its own positions.
STRIDED_GROUPS = ((0, 2), (1, 3))
STRIDED_WORLD_SIZE = 4


def group_of(groups: tuple[tuple[int, ...], ...], rank: int, world_size: int) -> tuple[int, ...]:
    """The ranks ``rank`` calls with, in rank order: its group, or the world when there are none."""
    return next((g for g in groups if rank in g), tuple(range(world_size)))


@contextlib.contextmanager
def own_group(groups: tuple[tuple[int, ...], ...]) -> Iterator[Any]:
    """On a rank: its process group among ``groups`` (the world when empty), destroyed on leaving. Every
    rank makes every group (a collective of the world), so every rank must enter with the same groups."""
    import torch.distributed as dist

    if not groups:
        yield dist.group.WORLD
        return
    pg = dist.new_subgroups_by_enumeration([list(g) for g in groups])[0]
    try:
        yield pg
    finally:
        dist.destroy_process_group(pg)
