"""The planner's value types, as the partitioner and the reports use them, against their meaning:
``Storage`` (HBM, DDR, SSD bytes) adds and subtracts component by component and ``fits_in`` another
when every component does; ``Perf`` adds component by component; equal values hash alike. A
component dropped from the arithmetic (SSD, which only key-value tables use) would leave a device's
capacity wrong after the first shard is placed on it."""

from __future__ import annotations

import itertools
from typing import Any

from paritykit.errors import expect

STORAGES = ((7, 11, 13), (2, 3, 5), (7, 2, 20), (0, 0, 0))
PERF_FIELDS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms", "prefetch_compute")
PERFS = ((1.5, 2.0, 3.25, 0.5, 0.75, 0.125), (0.25, 4.0, 1.0, 2.5, 0.5, 1.0))


def value_type_case() -> dict[str, Any]:
    from torchrec.distributed.planner.types import Perf, Storage

    checked = 0
    for a, b in itertools.product(STORAGES, repeat=2):
        left, right = Storage(*a), Storage(*b)
        for name, got, want in (("+", left + right, tuple(x + y for x, y in zip(a, b))),
                                ("-", left - right, tuple(x - y for x, y in zip(a, b)))):
            expect((got.hbm, got.ddr, got.ssd) == want, f"Storage{a} {name} Storage{b} = {got}, expected (hbm, ddr, ssd) {want}")
        fits = all(x <= y for x, y in zip(a, b))
        expect(left.fits_in(right) == fits, f"Storage{a}.fits_in(Storage{b}) = {left.fits_in(right)}, expected {fits}")
        expect((left == right) == (a == b) and (a != b or hash(left) == hash(right)), f"Storage{a} == Storage{b} or its hash")
        checked += 3
    left, right = (Perf(**dict(zip(PERF_FIELDS, p))) for p in PERFS)
    total = left + right
    for field, x, y in zip(PERF_FIELDS, *PERFS):
        expect(getattr(total, field) == x + y, f"(Perf + Perf).{field} = {getattr(total, field)}, expected {x + y}")
    expect(hash(Perf(**dict(zip(PERF_FIELDS, PERFS[0])))) == hash(left), "equal Perfs hash alike")
    return {"storage_pairs": len(STORAGES) ** 2, "checks": checked + len(PERF_FIELDS) + 1}
