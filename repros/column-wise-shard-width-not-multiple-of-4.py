"""Known torchrec issue column-wise-shard-width-not-multiple-of-4 (listed for torchrec >=1.8,<1.10).

torchrec's sharding_plan.column_wise(ranks=[r0, ..., rn-1]) on a table whose width divides into n
shards of a width that is not a multiple of 4 (12 columns on ranks [0, 1]: 6 each) silently makes
fewer, wider shards: _find_base_dim looks for a block of at least columns / n columns that divides
the width and is a multiple of 4, finds none below the width and takes the whole width, so the table
is placed on ranks[0] alone. No error, no warning: the ranks the user named are ignored (the
docstring says the table "will be sharded column-wise across specified ranks" and promises a
ValueError only when the width does not divide). The numbers stay right; the placement does not.
Workaround: give column-wise tables a width that cuts into shards of a multiple of 4 columns
(16 columns on two ranks), or pass size_per_rank=[...] explicitly.

The script builds an EmbeddingBagCollection on the meta device with one table t0 (10 x 12), asks
torchrec's construct_module_sharding_plan for column_wise(ranks=[0, 1]) on 2 ranks, and compares
the ParameterSharding's shards with the hand computation of what the call asks for: n = len(ranks)
shards of columns / n columns, shard i at column offset i * (columns / n) on ranks[i]. Exact (these
are integers); no process group, no ranks.

    python this_script.py            12 columns on [0, 1]: exit 1 (REPRODUCED) when the shards differ
    python this_script.py --control  16 columns on [0, 1] (8 per shard): exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
"""

import argparse
import sys
import traceback

import torch


def expected(columns, ranks, rows):
    width = columns // len(ranks)
    return [(rank, [0, i * width], [rows, width]) for i, rank in enumerate(ranks)]


def resolved(columns, ranks, rows):
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=rows, embedding_dim=columns, feature_names=["f0"])],
                                 device=torch.device("meta"))
    plan = construct_module_sharding_plan(ebc, {"t0": column_wise(ranks=list(ranks))}, world_size=2, local_size=2, device_type="cpu")
    return [(s.placement.rank(), list(s.shard_offsets), list(s.shard_sizes)) for s in plan["t0"].sharding_spec.shards]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="a width torchrec cuts right (16 columns)")
    args = parser.parse_args()
    columns, ranks, rows = (16 if args.control else 12), (0, 1), 10
    try:
        found, want = resolved(columns, ranks, rows), expected(columns, ranks, rows)
    except Exception:  # noqa: BLE001 - the script itself failed
        print(f"CANNOT RUN: {traceback.format_exc().strip().splitlines()[-1]}")
        return 2
    if found != want:
        print(f"REPRODUCED: column_wise(ranks={list(ranks)}) on t0 ({rows} x {columns}): torchrec's shards (rank, offsets, sizes) "
              f"{found}, the call asks for {want}")
        return 1
    print(f"OK: column_wise(ranks={list(ranks)}) on t0 ({rows} x {columns}) gives {found}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
