"""paritykit td_to_kjt vs torchrec maybe_td_to_kjt: time per call, ratio, and downstream device reads.

Run: python bench/bench_convert.py [--repeats N]. Prints one table; every ratio is measured in this run.
Downstream reads are what a model then asks of the KJT (length_per_key, offset_per_key, to_dict,
split, permute), counted with paritykit.sync's CPU proxy (a GPU would synchronize on each).
"""

from __future__ import annotations

import argparse
import timeit

import torch
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from paritykit.convert import td_to_kjt
from paritykit.strategies import SparseBatch
from paritykit.sync import count_syncs

BATCH_SIZE = 512
KEY_COUNTS = (8, 100, 500)


def make_batch(num_keys: int) -> SparseBatch:
    generator = torch.Generator().manual_seed(num_keys)
    lengths = torch.randint(0, 6, (num_keys, BATCH_SIZE), generator=generator).tolist()
    return SparseBatch(
        keys=tuple(f"f{i}" for i in range(num_keys)),
        lengths=tuple(tuple(rows) for rows in lengths),
        id_bounds=(1000,) * num_keys,
        seed=num_keys,
    )


def use_like_a_model(kjt) -> None:
    kjt.length_per_key()
    kjt.offset_per_key()
    kjt.to_dict()
    kjt.split([1, len(kjt.keys()) - 1])
    order = list(reversed(range(len(kjt.keys()))))
    # With its indices tensor prepared ahead, as sharded modules do; building it here would be a copy.
    kjt.permute(order, torch.tensor(order, dtype=torch.int))


def time_per_call(fn, repeats: int) -> float:
    number = max(1, repeats)
    return min(timeit.repeat(fn, number=number, repeat=5)) / number


def downstream_reads(convert, td) -> int:
    kjt = convert(td)
    with count_syncs(backend="cpu") as record:
        use_like_a_model(kjt)
    return record.total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a shared machine a parallel op measures contention)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), CPU")
    print(f"{'keys':>5} {'batch':>6} {'torchrec us':>12} {'paritykit us':>13} {'ratio pk/tr':>12} "
          f"{'reads tr':>9} {'reads pk':>9}")
    for num_keys in KEY_COUNTS:
        td = make_batch(num_keys).to_td("from_jagged_offsets")
        theirs = time_per_call(lambda: maybe_td_to_kjt(td), args.repeats)
        ours = time_per_call(lambda: td_to_kjt(td), args.repeats)
        reads_theirs = downstream_reads(maybe_td_to_kjt, td)
        reads_ours = downstream_reads(td_to_kjt, td)
        print(f"{num_keys:>5} {BATCH_SIZE:>6} {theirs * 1e6:>12.1f} {ours * 1e6:>13.1f} {ours / theirs:>12.2f} "
              f"{reads_theirs:>9} {reads_ours:>9}")


if __name__ == "__main__":
    main()
