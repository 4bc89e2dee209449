"""Known torchrec issue construct-jagged-tensors-zero-batch (listed for torchrec >=1.8,<1.10).

torchrec.modules.utils.construct_jagged_tensors (the sharded EmbeddingCollection's output builder) of
features with keys and a batch of no samples raises (features.lengths().view(-1, features.stride())
with stride 0: 'cannot reshape tensor of 0 elements into shape [-1, 0]') instead of returning empty
JaggedTensors. Workaround: skip the lookup for a batch of no samples.

The script calls construct_jagged_tensors as the sharded EmbeddingCollection calls it for column-wise
shards: features with key a once per shard (a, a) and key b once, each shard's embeddings (2
columns) one after the other, the shard order {"a": [1, 0]}, need_indices. It compares each output
JaggedTensor with a pure-Python reference of its meaning computed from the batch's rows: the
feature's lengths, per id the shards' columns joined in shard order, the ids as weights. Numbers are
only copied (small integers in float32), so the comparison is exact.

    python this_script.py            a batch of no samples
    python this_script.py --control  the same keys, shards and order with a batch of two samples

    exit 0: torchrec matches the reference (prints OK)
    exit 1: it does not, or torchrec raised (prints REPRODUCED and where)
    exit 2: the script itself could not run (prints CANNOT RUN)
"""

import argparse
import os
import sys
import traceback

import torch

# key -> rows of ids
NO_SAMPLES = {"a": [], "b": []}
TWO_SAMPLES = {"a": [[3, 1], []], "b": [[2], [4, 0]]}
SHARDS = ["a", "a", "b"]  # the features as the CW lookup sees them: a once per column shard
ORDER = {"a": [1, 0]}  # features_to_permute_indices: a's shards joined second shard first
DIM = 2


def pieces(batch: dict) -> list:
    """Each shard's embedding rows (one per id): shard s, id position j -> [100*s + 10*j, 100*s + 10*j + 1]."""
    return [[[100.0 * s + 10 * j + c for c in range(DIM)] for j in range(sum(len(r) for r in batch[key]))]
            for s, key in enumerate(SHARDS)]


def reference(batch: dict) -> dict:
    out = {}
    rows = pieces(batch)
    for key in batch:
        mine = [s for s, k in enumerate(SHARDS) if k == key]
        ordered = [mine[i] for i in ORDER.get(key, range(len(mine)))]
        ids = [i for row in batch[key] for i in row]
        out[key] = {"lengths": [len(r) for r in batch[key]], "values": [[x for s in ordered for x in rows[s][j]] for j in range(len(ids))],
                    "weights": ids}
    return out


def torchrec_answer(batch: dict) -> dict:
    from torchrec.modules.utils import construct_jagged_tensors
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [len(r) for key in SHARDS for r in batch[key]]
    ids = [i for key in SHARDS for r in batch[key] for i in r]
    features = KeyedJaggedTensor(keys=SHARDS, values=torch.tensor(ids, dtype=torch.int64),
                                 lengths=torch.tensor(lengths, dtype=torch.int64), stride=len(batch["a"]))
    embeddings = torch.tensor([row for piece in pieces(batch) for row in piece], dtype=torch.float32).reshape(-1, DIM)
    out = construct_jagged_tensors(embeddings=embeddings, features=features, embedding_names=SHARDS, need_indices=True,
                                   features_to_permute_indices=ORDER)
    return {key: {"lengths": jt.lengths().tolist(), "values": jt.values().tolist(), "weights": jt.weights().tolist()}
            for key, jt in out.items()}


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torchrec{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="a batch of two samples, which torchrec gets right")
    batch = TWO_SAMPLES if parser.parse_args().control else NO_SAMPLES
    call = f"construct_jagged_tensors(features {SHARDS} with {len(batch['a'])} samples, order {ORDER}, need_indices=True)"
    try:
        want = reference(batch)
        got = torchrec_answer(batch)
    except Exception as exc:
        if torchrec_frame(exc):
            print(f"REPRODUCED: {call} raised {type(exc).__name__}: {exc} (in {torchrec_frame(exc)})")
            return 1
        print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        return 2
    wrong = [f"{key}.{part}: torchrec {got.get(key, {}).get(part)}, the reference {want[key][part]}"
             for key in want for part in want[key] if got.get(key, {}).get(part) != want[key][part]]
    if sorted(got) != sorted(want) or wrong:
        print(f"REPRODUCED: {call} differs; first: {wrong[0] if wrong else f'keys {sorted(got)} vs {sorted(want)}'}")
        return 1
    print(f"OK: {call} matches the reference ({len(want)} features compared)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
