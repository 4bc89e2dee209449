"""EBC forward with and without a sync guard (CPU proxy), median of many runs, ratios from one run.

    python bench/bench_sync_guard.py [--repeats 200]

Prints, for a small EBC and for 100 tables x batch 512: the median forward time with no guard ever
opened, inside ``sync_guard(0, backend="cpu")``, and with no guard after guards were used (the
hooks are removed on exit, so this must read 1.00x up to noise), as ratios to the first; then the
cost of opening and closing an empty guard.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from paritykit.sync import sync_guard


def build(num_tables: int, batch: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=1000, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables)
    jts = {}
    for i in range(num_tables):
        lengths = torch.randint(0, 4, (batch,), generator=generator)
        values = torch.randint(0, 1000, (int(lengths.sum()),), generator=generator)
        jts[f"f{i}"] = JaggedTensor(values=values, lengths=lengths)
    return ebc, KeyedJaggedTensor.from_jt_dict(jts)


def median_seconds(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for label, num_tables, batch in (("small (4 tables x batch 32)", 4, 32), ("100 tables x batch 512", 100, 512)):
        ebc, kjt = build(num_tables, batch)

        def plain() -> None:
            ebc(kjt)

        def guarded() -> None:
            with sync_guard(0, backend="cpu"):
                ebc(kjt)

        with torch.no_grad():
            never_guarded = median_seconds(plain, args.repeats // 5)  # before any guard was opened
            for fn in (plain, guarded, plain, guarded):  # warm up both paths
                median_seconds(fn, 10)
            # Interleave rounds so that drift of a shared machine hits both sides alike.
            base, on, off = [], [], []
            for _ in range(5):
                base.append(median_seconds(plain, args.repeats // 5))
                on.append(median_seconds(guarded, args.repeats // 5))
                off.append(median_seconds(plain, args.repeats // 5))
        b, g, o = statistics.median(base), statistics.median(on), statistics.median(off)
        print(
            f"{label}: no guard {b * 1e3:.3f} ms | guard on {g / b:.2f}x | "
            f"no guard, after guards were used {o / b:.2f}x | before any guard {never_guarded / b:.2f}x "
            f"(median of {args.repeats} runs each)"
        )

    def empty_guard() -> None:
        with sync_guard(0, backend="cpu"):
            pass

    print(f"opening and closing an empty guard: {median_seconds(empty_guard, args.repeats) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
