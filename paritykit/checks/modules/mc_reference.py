"""What MCHManagedCollisionModule keeps under its eviction policies, as a pure-Python model (no torch).

The module owns zch_size slots. The last one, output_global_offset + zch_size - 1, is the default: an
id without a slot is mapped to it, and it is never given to an id, so zch_size - 1 ids hold slots. In
training, forward n (counted from 1) appends the ids it sees to a history window; every
``eviction_interval``-th forward the window is coalesced: each id that holds a slot adds its count in
the window to its count and takes its last forward in the window as its last access; the ids without
one enter with their window count and last access; the zch_size - 1 ids of highest score keep (or get)
a slot. The score, per policy (current: the forward that coalesces; age = current - last access + 1):
- LFU: the count;
- LRU: -(age ** decay_exponent), the most recently seen first;
- DistanceLFU: count / age ** decay_exponent, in float32 as torchrec computes it.
Ties go to the ids already holding a slot, in id order, then to the new ids by window count and id (the
stable sorts over the table in id order and the window's unique ids in count order). An id keeps its
slot for as long as it stays. In eval mode nothing is recorded and the table does not change.

A threshold filter (the policy's ``threshold_filtering_func``) is given the window's counts of its
unique ids (n of them, summing to `total`); only the ids it passes take part in the coalescing (held
ones included: an id that fails is as if unseen in that window). ``average``: a count strictly above
the mean, total / n; ``dynamic``: strictly above total / n x the skew multiplier, the threshold in
float32 as torchrec computes it.

The window is a buffer of int(first batch's ids x interval x 1.25) elements that silently drops what
does not fit: the cases feed the same number of ids every forward, so that it never fills.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field

POLICIES = ("lfu", "lru", "distance_lfu")
FILTERS = ("", "average", "dynamic")  # "": no threshold filter


def float32(x: float) -> float:
    """``x`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class EvictionTable:
    zch_size: int
    eviction_interval: int
    policy: str = "lfu"
    decay: float = 1.0  # LRU and DistanceLFU: exponents whose powers of small integers are exact
    threshold: str = ""  # one of FILTERS
    skew: float = 1.0  # the dynamic filter's threshold_skew_multiplier
    counts: dict[int, int] = field(default_factory=dict)  # id -> count, for the ids holding a slot
    last: dict[int, int] = field(default_factory=dict)  # id -> its last access, for the ids holding a slot
    window: list[tuple[int, int]] = field(default_factory=list)  # (id, forward)
    forwards: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy {self.policy!r} is not one of {POLICIES}")
        if self.threshold not in FILTERS:
            raise ValueError(f"threshold filter {self.threshold!r} is not one of {FILTERS}")

    @property
    def capacity(self) -> int:
        return self.zch_size - 1

    def score(self, count: int, last: int) -> float:
        age = float32(float(self.forwards - last + 1) ** self.decay)
        if self.policy == "lfu":
            return count
        if self.policy == "lru":
            return -age
        return float32(count / age)

    def train_forward(self, ids: list[int]) -> list[int]:
        """Record one training forward's ids (every feature's, in order); the ids evicted by it."""
        self.forwards += 1
        self.window += [(i, self.forwards) for i in ids]
        if self.forwards % self.eviction_interval:
            return []
        counts, seen = self.passing(Counter(i for i, _ in self.window)), {}
        for i, forward in self.window:
            if i in counts:
                seen[i] = max(seen.get(i, 0), forward)
        self.window = []
        for held in self.counts:
            self.counts[held] += counts.get(held, 0)
            self.last[held] = seen.get(held, self.last[held])
        held = [(i, self.counts[i], self.last[i]) for i in sorted(self.counts)]
        new = sorted(((i, c, seen[i]) for i, c in counts.items() if i not in self.counts), key=lambda item: (-item[1], item[0]))
        ranked = sorted(held + new, key=lambda item: -self.score(item[1], item[2]))  # stable: held ids first on ties
        kept = ranked[:self.capacity]
        evicted = [i for i in self.counts if i not in {k[0] for k in kept}]
        self.counts = {i: c for i, c, _ in kept}
        self.last = {i: t for i, _, t in kept}
        return evicted

    def passing(self, counts: Counter) -> dict[int, int]:
        """The window's counts of the ids the threshold filter passes."""
        if not self.threshold:
            return dict(counts)
        n, total = len(counts), sum(counts.values())
        if self.threshold == "average":  # in integers: a mean that is not whole lies >= 1/n from every count, far beyond float32's error
            return {i: c for i, c in counts.items() if c * n > total}
        threshold = float32(float32(1 / n * self.skew) * total)
        return {i: c for i, c in counts.items() if c > threshold}

    def holds(self, id_: int) -> bool:
        return id_ in self.counts
