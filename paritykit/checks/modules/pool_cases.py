"""torchrec's object pools, ``TensorPool`` and ``KeyedJaggedTensorPool``, against the plain-Python model
of what they keep (pool_reference.py): the module itself in the caller, and the pool sharded row-wise
by its sharder on the ranks (``ShardedTensorPool``, ``ShardedKeyedJaggedTensorPool``), where every
rank updates and looks up ids of every shard.

A case is a sequence of steps, each an update or a lookup on every rank, ending with a lookup of every
slot on every rank. Every lookup is compared with the model, exactly (a pool copies what it is given);
the tensor pool's table too (the sharded pool's local shards at their offsets in its state dict).
Within one rank an update may repeat an id (the last one is kept, as the docstrings say); across ranks
one step's updates write distinct ids, as in the sharded pool's docstring (which rank's write would
win is not specified).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from paritykit.checks.known_issues import rule_kept_out
from paritykit.checks.modules.pool_reference import Entry, KJTPoolModel, TensorPoolModel
from paritykit.errors import HarnessError, ParityError

# Known issues of the KJT pool, kept out of the draws: an unsharded weighted pool cannot look up; an
# update of no ids fails (on any rank of a sharded pool too); a sharded update of ids out of shard
# order stores samples in the wrong slots; a sharded lookup of no ids returns no keys.
KJT_POOL_WEIGHTED = "kjt-pool-weighted-lookup"
KJT_POOL_EMPTY_UPDATE = "kjt-pool-empty-update"
KJT_POOL_SHARD_ORDER = "sharded-kjt-pool-update-out-of-shard-order"
KJT_POOL_EMPTY_LOOKUP = "sharded-kjt-pool-empty-lookup-drops-keys"
OTHER_KEY = "other"  # a key of the update's KJT that the pool does not keep
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}


@dataclass(frozen=True)
class PoolSpec:
    """``steps[step] = (op, ids[rank])`` with op "update" or "lookup". A KJT pool's updates take a KJT with
    keys ``input_keys`` whose sample ``b`` of key ``k`` on rank ``r`` has ``lengths[step][r][b][k]``
    values (a step that is not an update has no lengths)."""

    kind: str  # "tensor" or "kjt"
    world_size: int  # 1: the module in the caller; more: sharded row-wise on the ranks
    pool_size: int
    dtype: str  # the tensor pool's dtype, or the KJT pool's values dtype
    id_dtype: str
    steps: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    dim: int = 0  # tensor pool
    features: tuple[tuple[str, int], ...] = ()  # KJT pool: (feature, max length), in the pool's order
    weighted: bool = False
    input_keys: tuple[str, ...] = ()
    lengths: tuple[tuple[tuple[tuple[int, ...], ...], ...] | None, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("tensor", "kjt"):
            raise HarnessError(f"pool case: kind {self.kind!r} is neither 'tensor' nor 'kjt'")
        for step, (op, rank_ids) in enumerate(self.steps):
            if op not in ("update", "lookup") or len(rank_ids) != self.world_size:
                raise HarnessError(f"pool case step {step}: {op!r} with ids for {len(rank_ids)} ranks, the case has {self.world_size}")
            bad = [i for ids in rank_ids for i in ids if not 0 <= i < self.pool_size]
            if bad:
                raise HarnessError(f"pool case step {step}: ids {bad} outside the pool [0, {self.pool_size})")
            if op == "update":
                owners: dict[int, int] = {}
                for rank, ids in enumerate(rank_ids):
                    for id_ in ids:
                        if owners.setdefault(id_, rank) != rank:
                            raise HarnessError(f"pool case step {step}: ranks {owners[id_]} and {rank} both update id {id_}")
                if self.kind == "kjt":
                    self._check_lengths(step, rank_ids)

    def _check_lengths(self, step: int, rank_ids: tuple[tuple[int, ...], ...]) -> None:
        lengths = self.lengths[step] if step < len(self.lengths) else None
        if lengths is None or [len(r) for r in lengths] != [len(ids) for ids in rank_ids]:
            raise HarnessError(f"pool case step {step}: an update's lengths must give one sample per id on every rank")
        limits = dict(self.features)
        for rank, samples in enumerate(lengths):
            for sample, per_key in enumerate(samples):
                for key, length in zip(self.input_keys, per_key):
                    if length > limits.get(key, length):
                        raise HarnessError(f"pool case step {step} rank {rank} sample {sample}: {length} values of "
                                           f"{key!r}, whose max length is {limits[key]}")

    def case_id(self) -> str:
        layout = (f"dim={self.dim}" if self.kind == "tensor" else
                  f"features={list(self.features)} weighted={self.weighted} input_keys={list(self.input_keys)} "
                  f"lengths={[None if s is None else [list(map(list, r)) for r in s] for s in self.lengths]}")
        where = "unsharded" if self.world_size == 1 else f"sharded ws{self.world_size} row_wise"
        return (f"{self.kind}-pool {where} pool_size={self.pool_size} {self.dtype} ids={self.id_dtype} {layout} "
                f"steps={[(op, [list(ids) for ids in rank_ids]) for op, rank_ids in self.steps]}")


def tensor_rows(step: int, rank: int, count: int, dim: int) -> list[list[int]]:
    """The rows rank ``rank`` writes at ``step``: distinct small integers, exact in every dtype drawn."""
    return [[(step * 8 + rank) * 64 + position * 8 + column + 1 for column in range(dim)] for position in range(count)]


def kjt_samples(spec: PoolSpec, step: int, rank: int) -> list[dict[str, list[Entry]]]:
    """Each sample's entries per input key, the values distinct integers and the weights a quarter of them."""
    samples = []
    for sample, per_key in enumerate(spec.lengths[step][rank]):
        entries = {}
        for k, (key, length) in enumerate(zip(spec.input_keys, per_key)):
            values = [((step * 8 + rank) * 16 + sample) * 64 + k * 8 + j + 1 for j in range(length)]
            entries[key] = [(value, value / 4) for value in values]
        samples.append(entries)
    return samples


def _kjt_of(spec: PoolSpec, samples: list[dict[str, list[Entry]]]) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values, weights = [], [], []
    for key in spec.input_keys:  # feature-major, as a KJT holds them
        for sample in samples:
            lengths.append(len(sample[key]))
            values += [v for v, _ in sample[key]]
            weights += [w for _, w in sample[key]]
    return KeyedJaggedTensor(keys=list(spec.input_keys), values=torch.tensor(values, dtype=DTYPES[spec.dtype]),
                             lengths=torch.tensor(lengths, dtype=torch.int32),
                             weights=torch.tensor(weights, dtype=torch.float32) if spec.weighted else None,
                             stride=len(samples))


def _module(spec: PoolSpec) -> torch.nn.Module:
    cpu = torch.device("cpu")
    if spec.kind == "tensor":
        from torchrec.modules.tensor_pool import TensorPool

        return TensorPool(pool_size=spec.pool_size, dim=spec.dim, dtype=DTYPES[spec.dtype], device=cpu)
    from torchrec.modules.keyed_jagged_tensor_pool import KeyedJaggedTensorPool

    return KeyedJaggedTensorPool(pool_size=spec.pool_size, feature_max_lengths=dict(spec.features),
                                 values_dtype=DTYPES[spec.dtype], is_weighted=spec.weighted, device=cpu)


def _sharded(spec: PoolSpec) -> torch.nn.Module:
    import torch.distributed as dist
    from torchrec.distributed.types import ObjectPoolShardingPlan, ObjectPoolShardingType, ShardingEnv

    if spec.kind == "tensor":
        from torchrec.distributed.tensor_pool import TensorPoolSharder as Sharder
    else:
        from torchrec.distributed.keyed_jagged_tensor_pool import KeyedJaggedTensorPoolSharder as Sharder
    return Sharder().shard(_module(spec), ObjectPoolShardingPlan(ObjectPoolShardingType.ROW_WISE),
                           ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))


def _looked_up(spec: PoolSpec, found: Any) -> Any:
    found = found.wait() if hasattr(found, "wait") else found
    if spec.kind == "tensor":
        return {"dtype": str(found.dtype).removeprefix("torch."), "rows": found.tolist()}
    weights = found.weights().tolist() if spec.weighted else None
    return {"keys": list(found.keys()), "stride": found.stride(), "lengths": found.lengths().tolist(),
            "values": found.values().tolist(), "weights": weights, "values_dtype": str(found.values().dtype).removeprefix("torch.")}


def pool_steps(spec: PoolSpec, rank: int) -> dict[str, Any]:
    """Run the steps on this rank (or in the caller, unsharded): every lookup's result, then the tensor
    pool's table (rows at their offsets)."""
    pool = _module(spec) if spec.world_size == 1 else _sharded(spec)
    lookups = []
    for step, (op, rank_ids) in enumerate(spec.steps):
        ids = torch.tensor(rank_ids[rank], dtype=DTYPES[spec.id_dtype])
        if op == "lookup":
            lookups.append(_looked_up(spec, pool.lookup(ids)))
        elif spec.kind == "tensor":
            pool.update(ids, torch.tensor(tensor_rows(step, rank, len(ids), spec.dim), dtype=DTYPES[spec.dtype]).view(-1, spec.dim))
        else:
            pool.update(ids, _kjt_of(spec, kjt_samples(spec, step, rank)))
    table = None
    if spec.kind == "tensor":
        state = pool.state_dict()["_pool"]
        shards = state.local_shards() if hasattr(state, "local_shards") else None
        table = ([(s.metadata.shard_offsets[0], s.tensor.tolist()) for s in shards] if shards is not None
                 else [(0, state.tolist())])
    return {"lookups": lookups, "table": table}


def sharded_pool_on_rank(spec: PoolSpec) -> dict[str, Any]:
    import torch.distributed as dist

    return pool_steps(spec, dist.get_rank())


def _expected_lookup(spec: PoolSpec, model: Any, ids: Sequence[int]) -> dict[str, Any]:
    if spec.kind == "tensor":
        return {"dtype": spec.dtype, "rows": [list(row) for row in model.lookup(ids)]}
    per_key = model.lookup(ids)
    entries = [e for key in model.features for slot in per_key[key] for e in slot]
    return {"keys": list(model.features), "stride": len(ids),
            "lengths": [len(slot) for key in model.features for slot in per_key[key]],
            "values": [v for v, _ in entries], "weights": [w for _, w in entries] if spec.weighted else None,
            "values_dtype": spec.dtype}


def _first_difference(got: dict[str, Any], wanted: dict[str, Any]) -> str:
    for field, value in wanted.items():
        if got.get(field) != value:
            return f"{field} {got.get(field)}, the model's {value}"
    return ""


def check_pool_results(spec: PoolSpec, per_rank: list[dict[str, Any]]) -> dict[str, int]:
    """Every rank's lookups against the model fed every rank's updates in step order."""
    model: Any = (TensorPoolModel(spec.pool_size, spec.dim) if spec.kind == "tensor"
                  else KJTPoolModel(spec.pool_size, [name for name, _ in spec.features]))
    compared = lookups = 0
    for step, (op, rank_ids) in enumerate(spec.steps):
        if op == "update":
            for rank, ids in enumerate(rank_ids):
                model.update(ids, tensor_rows(step, rank, len(ids), spec.dim) if spec.kind == "tensor"
                             else kjt_samples(spec, step, rank))
            continue
        for rank, ids in enumerate(rank_ids):
            got, wanted = per_rank[rank]["lookups"][lookups], _expected_lookup(spec, model, ids)
            difference = _first_difference(got, wanted)
            if difference:
                raise ParityError(f"step {step} rank {rank}: lookup of ids {list(ids)} returned {difference} [{spec.case_id()}]")
            compared += len(ids)
        lookups += 1
    if spec.kind == "tensor":
        table = model.table()
        for rank, result in enumerate(per_rank):
            for offset, rows in result["table"]:
                wanted = [list(row) for row in table[offset:offset + len(rows)]]
                if rows != wanted:
                    row = next(i for i, (a, b) in enumerate(zip(rows, wanted)) if a != b) + offset
                    raise ParityError(f"rank {rank}: the pool's table row {row} is {rows[row - offset]}, the model's "
                                      f"{list(table[row])} [{spec.case_id()}]")
        held = sorted((offset, len(rows)) for result in per_rank for offset, rows in result["table"])
        if sum(n for _, n in held) != spec.pool_size or any(a + n != b for (a, n), (b, _) in zip(held, held[1:])):
            raise ParityError(f"the ranks' pool shards (offset, rows) {held} do not tile the pool of {spec.pool_size} rows [{spec.case_id()}]")
    return {"ids_looked_up": compared, "lookups": lookups}


def run_pool_case(pool: Any, spec: PoolSpec) -> dict[str, int]:
    if spec.world_size == 1:
        return check_pool_results(spec, [pool_steps(spec, 0)])
    if pool is None or pool.world_size != spec.world_size:
        raise HarnessError(f"sharded pool case needs a pool of {spec.world_size} ranks")
    return check_pool_results(spec, pool.call(sharded_pool_on_rank, (spec,), case=spec.case_id()))


def in_shard_order(rank_ids: tuple[tuple[int, ...], ...], pool_size: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's ids sorted by the shard that holds them (stable: repeats keep their order)."""
    block = -(-pool_size // world_size)  # the rows of one row-wise shard
    return tuple(tuple(sorted(ids, key=lambda id_: id_ // block)) for ids in rank_ids)


@st.composite
def pool_specs(draw: st.DrawFn, kind: str, world_size: int) -> PoolSpec:
    pool_size = draw(st.integers(max(1, world_size), 9))
    id_lists = st.lists(st.integers(0, pool_size - 1), max_size=4)
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            # Distinct ids across ranks (each id given to one rank), repeats within a rank.
            owner = {i: draw(st.integers(0, world_size - 1)) for i in range(pool_size)}
            rank_ids = tuple(tuple(i for i in draw(id_lists) if owner[i] == rank) for rank in range(world_size))
            if kind == "kjt" and not all(rank_ids) and rule_kept_out(KJT_POOL_EMPTY_UPDATE):
                continue
            if kind == "kjt" and world_size > 1 and rule_kept_out(KJT_POOL_SHARD_ORDER):
                rank_ids = in_shard_order(rank_ids, pool_size, world_size)
            steps.append(("update", rank_ids))
        else:
            rank_ids = tuple(tuple(draw(id_lists)) for _ in range(world_size))
            if kind == "kjt" and world_size > 1 and not all(rank_ids) and rule_kept_out(KJT_POOL_EMPTY_LOOKUP):
                continue
            steps.append(("lookup", rank_ids))
    steps.append(("lookup", tuple(tuple(range(pool_size)) for _ in range(world_size))))
    id_dtype = draw(st.sampled_from(["int64", "int32"]))
    if kind == "tensor":
        return PoolSpec("tensor", world_size, pool_size, draw(st.sampled_from(["float32", "float64", "int64", "int32"])),
                        id_dtype, tuple(steps), dim=draw(st.integers(1, 4)))
    features = tuple((name, draw(st.integers(1, 3))) for name in draw(st.permutations(["f0", "f1", "f2"]))[:draw(st.integers(1, 3))])
    input_keys = tuple(draw(st.permutations([name for name, _ in features] + ([OTHER_KEY] if draw(st.booleans()) else []))))
    limits = dict(features)
    lengths = tuple(None if op != "update" else tuple(
        tuple(tuple(draw(st.integers(0, limits.get(key, 2))) for key in input_keys) for _ in ids) for ids in rank_ids)
        for op, rank_ids in steps)
    weighted = draw(st.booleans()) and not (world_size == 1 and rule_kept_out(KJT_POOL_WEIGHTED))
    return PoolSpec("kjt", world_size, pool_size, draw(st.sampled_from(["int64", "int32"])), id_dtype, tuple(steps),
                    features=features, weighted=weighted, input_keys=input_keys, lengths=lengths)


def pinned_pool_specs(kind: str, world_size: int, weighted: bool | None = None) -> tuple[PoolSpec, ...]:
    """Every rank updates ids of both shards of an uneven pool (5 rows: blocks of 3 and 2), out of shard
    order, repeating one id; ids looked up out of shard order; a rank looks up nothing in one step and
    updates nothing in another; the KJT's keys in another order than the pool's, with a key it does not
    keep, and weights. The KJT pool's known issues (above) change the steps they name where they apply."""
    every = tuple(range(5))
    # Rank 0 updates nothing in the second update, but where that is a known issue of the KJT pool.
    idle = (2,) if kind == "kjt" and rule_kept_out(KJT_POOL_EMPTY_UPDATE) else ()
    if world_size == 2:
        first = ((4, 0, 4, 2), (3, 1))  # rank 0's ids out of shard order, but where that is a known issue of the KJT pool
        if kind == "kjt" and rule_kept_out(KJT_POOL_SHARD_ORDER):
            first = in_shard_order(first, 5, 2)
        blind = (3,) if kind == "kjt" and rule_kept_out(KJT_POOL_EMPTY_LOOKUP) else ()  # rank 1 looks up nothing
        steps = (("update", first), ("lookup", ((4, 1), blind)), ("update", (idle, (0, 0))), ("lookup", (every, every)))
    elif world_size == 1:
        steps = (("update", ((4, 0, 4, 2, 3, 1),)), ("lookup", ((1, 4),)), ("update", ((0, 0),)), ("lookup", (every,)))
    else:
        return ()
    if kind == "tensor":
        return (PoolSpec("tensor", world_size, 5, "float32", "int64", steps, dim=3),)
    features, keys = (("f0", 2), ("f1", 3)), ("f1", OTHER_KEY, "f0")
    lengths = tuple(None if op != "update" else tuple(
        tuple((min(3, (n + r) % 4), 1, (n + r) % 3) for n, _ in enumerate(ids)) for r, ids in enumerate(rank_ids))
        for op, rank_ids in steps)
    if weighted is None:
        weighted = not (world_size == 1 and rule_kept_out(KJT_POOL_WEIGHTED))
    return (PoolSpec("kjt", world_size, 5, "int64", "int32", steps, features=features, weighted=weighted, input_keys=keys,
                     lengths=lengths),)


def out_of_shard_order_spec() -> PoolSpec:
    """The known issue's reproduction: rank 0 updates slots [4, 0, 2] of a KJT pool on 2 shards (3 and 2 rows)."""
    steps = (("update", ((4, 0, 2), (3, 1))), ("lookup", (tuple(range(5)), tuple(range(5)))))
    return PoolSpec("kjt", 2, 5, "int64", "int64", steps, features=(("f0", 3),), input_keys=("f0",),
                    lengths=((((1,), (2,), (3,)), ((1,), (2,))), None))


def empty_lookup_spec() -> PoolSpec:
    """The known issue's reproduction: rank 1 of a sharded KJT pool looks up no slot."""
    steps = (("update", ((3,), (2,))), ("lookup", ((3, 0), ())))
    return PoolSpec("kjt", 2, 4, "int64", "int64", steps, features=(("f0", 2), ("f1", 1)), input_keys=("f0", "f1"),
                    lengths=((((2, 1),), ((0, 0),)), None))


def too_long_sample_is_refused(max_length: int, length: int) -> dict[str, int]:
    """A KJT pool must refuse a sample with more values of a feature than its max length (its update
    checks "the max_lengths of input is within the feature_max_lengths"): storing it would overrun the
    slot's row of values."""
    from torchrec.modules.keyed_jagged_tensor_pool import KeyedJaggedTensorPool
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if length <= max_length:
        raise HarnessError(f"a refusal case needs a sample longer than the max length {max_length}, got {length}")
    pool = KeyedJaggedTensorPool(pool_size=2, feature_max_lengths={"f0": max_length, "f1": 1}, device=torch.device("cpu"))
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.arange(length + 1), lengths=torch.tensor([0, length, 1, 0]), stride=2)
    try:
        pool.update(torch.tensor([0, 1]), kjt)
    except (AssertionError, ValueError, RuntimeError):
        return {"refused": 1}
    raise ParityError(f"KeyedJaggedTensorPool(feature_max_lengths={{'f0': {max_length}, 'f1': 1}}).update accepted a sample "
                      f"with {length} values of f0 (its max length is {max_length})")
