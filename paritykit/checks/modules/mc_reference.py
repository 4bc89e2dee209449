"""What MCHManagedCollisionModule with LFU eviction keeps, as a pure-Python model (no torch).

The module owns zch_size slots. The last one, output_global_offset + zch_size - 1, is the default: an
id without a slot is mapped to it, and it is never given to an id, so zch_size - 1 ids hold slots. In
training, every forward appends the ids it sees to a history window; every ``eviction_interval``-th
forward the window is coalesced: each id that holds a slot adds its count in the window to its
count; the ids without one enter with their window count; the zch_size - 1 ids of highest count keep
(or get) a slot. Ties go to the ids already holding a slot, then to the smaller id (the stable sorts of
LFU_EvictionPolicy over the table in id order and the window's unique ids in count order). An id
keeps its slot for as long as it stays. In eval mode nothing is recorded and the table does not change.

The window is a buffer of int(first batch's ids x interval x 1.25) elements that silently drops what
does not fit: the cases feed the same number of ids every forward, so that it never fills.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LfuTable:
    zch_size: int
    eviction_interval: int
    counts: dict[int, int] = field(default_factory=dict)  # id -> count, for the ids holding a slot
    window: list[int] = field(default_factory=list)
    forwards: int = 0

    @property
    def capacity(self) -> int:
        return self.zch_size - 1

    def train_forward(self, ids: list[int]) -> list[int]:
        """Record one training forward's ids (every feature's, in order); the ids evicted by it."""
        self.forwards += 1
        self.window += ids
        if self.forwards % self.eviction_interval:
            return []
        window, self.window = Counter(self.window), []
        for held in self.counts:
            self.counts[held] += window.get(held, 0)
        held = sorted(self.counts.items())
        new = sorted(((i, c) for i, c in window.items() if i not in self.counts), key=lambda item: (-item[1], item[0]))
        ranked = sorted(held + new, key=lambda item: -item[1])  # stable: held ids first on ties
        kept = dict(ranked[:self.capacity])
        evicted = [i for i in self.counts if i not in kept]
        self.counts = kept
        return evicted

    def holds(self, id_: int) -> bool:
        return id_ in self.counts
