"""ManagedCollisionEmbeddingBagCollection and ManagedCollisionEmbeddingCollection sharded row-wise
(the only sharding their sharders offer) by DistributedModelParallel, fed a different batch on every
rank for several training forwards.

torchrec splits the id range [0, input_hash_size) into one block per rank (``RwSparseFeaturesDist``:
ceil(input_hash_size / world_size) ids a block) and sends each id to the rank of its block; that rank's
remapper (``MCHManagedCollisionModule`` rebuilt for the shard: zch_size / world_size slots from
rank x zch_size / world_size on, its last slot the default) remaps every id it receives, from every
rank, and the table's rows of that range live there. So the oracle is one unsharded remapper model
per shard (mc_cases.SlotRules over mc_reference.EvictionTable (LFU), each fed every id routed to it in a forward),
and a lookup by hand: each rank's pooled embeddings are the sums of the gathered table's rows at the
remapped ids it got back (norm-wise: a sum in another order), the table gathered after that forward
(an eviction resets the rows it frees); an EC's embeddings are those rows themselves, bit for bit.
Forward only: the remapper trains in every training-mode forward, which is what the forwards
exercise; so between two forwards only the rows of the slots given to newly admitted ids change
(torchrec re-initializes them), as many as the model admits.

With an ``input_hash_func`` (mc_cases.AffineHash) each rank hashes its ids before they are routed: the
blocks and the shards' models are those of the ids hashed by hand.

Every shard receives the same number of ids in every forward (the remapper's history window is sized
by its first forward and drops what does not fit: mc_reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.checks.modules.mc_cases import AffineHash, MCSpec, SlotRules, hashed_by_hand, ids_hashing_to
from paritykit.checks.modules.mc_lookup_cases import FEATURES, two_feature_batch
from paritykit.engine.tolerances import normwise
from paritykit.errors import HarnessError, ParityError

DIM = 4  # the fused kernel takes widths that are multiples of 4


@dataclass(frozen=True)
class ShardedMCSpec:
    """``steps[step][rank]``: the ids a rank feeds in a forward, f0's first ``cuts[step][rank]`` of them,
    then f1's; each feature's ids are split over two samples."""

    world_size: int
    zch_per_shard: int
    eviction_interval: int
    block: int  # ids of one rank's block: input_hash_size = block x world_size
    steps: tuple[tuple[tuple[int, ...], ...], ...]
    cuts: tuple[tuple[int, ...], ...]
    seed: int = 0
    module: str = "mc-ebc"  # or "mc-ec"
    hashed: bool = False  # AffineHash as the remapper's input_hash_func

    def __post_init__(self) -> None:
        for step, rank_ids in enumerate(self.steps):
            if len(rank_ids) != self.world_size or len(self.cuts[step]) != self.world_size:
                raise HarnessError(f"sharded MC step {step}: ids or cuts for {len(rank_ids)} ranks, the case has {self.world_size}")
            bad = [i for ids in rank_ids for i in ids if not 0 <= i < self.input_hash_size]
            if bad:
                raise HarnessError(f"sharded MC step {step}: ids {bad} outside [0, {self.input_hash_size})")
            counts = self.ids_per_shard(step)
            if counts != self.ids_per_shard(0):
                raise HarnessError(f"sharded MC step {step}: ids per shard {counts}, the first forward's "
                                   f"{self.ids_per_shard(0)} (the remapper's window would drop some)")

    @property
    def pooled(self) -> bool:
        """An MC-EBC (one pooled vector per sample), else an MC-EC (one vector per id)."""
        return self.module == "mc-ebc"

    @property
    def zch_size(self) -> int:
        return self.zch_per_shard * self.world_size

    @property
    def input_hash_size(self) -> int:
        return self.block * self.world_size

    def shard_of(self, id_: int) -> int:
        return self.remapped_ids([id_])[0] // self.block

    def remapped_ids(self, ids: Any) -> list[int]:
        """What the shards route and remap of ``ids`` (hashed by hand when the case has the hash)."""
        return hashed_by_hand(ids, self.input_hash_size if self.hashed else 0)

    def ids_per_shard(self, step: int) -> list[int]:
        return [sum(self.shard_of(i) == shard for ids in self.steps[step] for i in ids) for shard in range(self.world_size)]

    def case_id(self) -> str:
        return (f"sharded {self.module} ws{self.world_size} row_wise zch_size={self.zch_size} eviction_interval={self.eviction_interval} "
                f"input_hash_size={self.input_hash_size}{' input_hash_func=AffineHash' if self.hashed else ''} steps={[list(map(list, s)) for s in self.steps]} "
                f"cuts={[list(c) for c in self.cuts]} seed={self.seed}")


@st.composite
def sharded_mc_specs(draw: st.DrawFn, world_size: int) -> ShardedMCSpec:
    block = draw(st.integers(2, 8))
    # How many ids each rank sends each shard in every forward, and the few ids of each shard's block
    # the forwards draw from (repeats, and more ids than slots, make the remappers evict).
    sends = [[draw(st.integers(1, 3)) for _shard in range(world_size)] for _rank in range(world_size)]
    universe = [draw(st.integers(1, block)) for _shard in range(world_size)]
    # The hash must be a bijection of [0, input_hash_size) to keep the ids per shard drawn below.
    hashed = draw(st.booleans()) and (block * world_size) % 7 != 0
    steps, cuts = [], []
    for _ in range(draw(st.integers(1, 4))):
        ranks, rank_cuts = [], []
        for rank in range(world_size):
            ids = [shard * block + draw(st.integers(0, universe[shard] - 1))
                   for shard in range(world_size) for _ in range(sends[rank][shard])]
            ids = draw(st.permutations(ids))
            ranks.append(tuple(ids_hashing_to(ids, block * world_size) if hashed else ids))
            rank_cuts.append(draw(st.integers(0, len(ids))))
        steps.append(tuple(ranks))
        cuts.append(tuple(rank_cuts))
    return ShardedMCSpec(world_size, draw(st.integers(2, 4)), draw(st.integers(1, 3)), block, tuple(steps), tuple(cuts),
                         draw(st.integers(0, 2**16)), draw(st.sampled_from(("mc-ebc", "mc-ec"))), hashed)


def pinned_specs(world_size: int) -> tuple[ShardedMCSpec, ...]:
    """Both ranks send ids of every block, an id of one block from two ranks in one forward (one slot for
    both), and more ids than a shard has slots (eviction every second forward)."""
    if world_size != 2:
        return ()
    steps = (((1, 6, 2, 9), (6, 1, 8, 3)), ((4, 6, 7, 1), (0, 9, 6, 3)), ((2, 8, 1, 6), (1, 6, 5, 2)))
    ebc = ShardedMCSpec(2, 3, 2, 5, steps, ((2, 1), (3, 0), (4, 2)))
    # The same ids reach the shards through the hash (each rank feeds the ids that hash to them).
    hashed = tuple(tuple(tuple(ids_hashing_to(ids, ebc.input_hash_size)) for ids in step) for step in steps)
    return ebc, replace(ebc, module="mc-ec"), replace(ebc, steps=hashed, hashed=True)


class _Arch(torch.nn.Module):
    """A model holding the MC module under ``mc`` (DistributedModelParallel shards submodules)."""

    def __init__(self, mc: torch.nn.Module) -> None:
        super().__init__()
        self.mc = mc

    def forward(self, features: Any) -> Any:
        return self.mc(features)


def _unsharded(spec: ShardedMCSpec) -> torch.nn.Module:
    from torchrec.modules import embedding_configs, embedding_modules, mc_embedding_modules
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    cpu = torch.device("cpu")
    bag = spec.pooled
    config = (embedding_configs.EmbeddingBagConfig if bag else embedding_configs.EmbeddingConfig)(
        name="t0", embedding_dim=DIM, num_embeddings=spec.zch_size, feature_names=list(FEATURES))
    remapper = MCHManagedCollisionModule(zch_size=spec.zch_size, device=cpu, eviction_policy=LFU_EvictionPolicy(),
                                         eviction_interval=spec.eviction_interval, input_hash_size=spec.input_hash_size,
                                         **({"input_hash_func": AffineHash()} if spec.hashed else {}))
    tables = (embedding_modules.EmbeddingBagCollection if bag else embedding_modules.EmbeddingCollection)(tables=[config], device=cpu)
    wrapper = (mc_embedding_modules.ManagedCollisionEmbeddingBagCollection if bag
               else mc_embedding_modules.ManagedCollisionEmbeddingCollection)
    return _Arch(wrapper(tables, ManagedCollisionCollection({"t0": remapper}, [config]), return_remapped_features=True))


def _sharder(spec: ShardedMCSpec) -> Any:
    if spec.pooled:
        from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

        return ManagedCollisionEmbeddingBagCollectionSharder()
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder

    return ManagedCollisionEmbeddingCollectionSharder()


def sharded_mc_on_rank(spec: ShardedMCSpec) -> dict[str, Any]:
    """Every forward's remapped ids (f0's, then f1's) and embeddings (pooled, or one per id for an EC)
    on this rank, then the table gathered from the shards."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from paritykit.harness.sharded import gather_full_weights

    rank = dist.get_rank()
    model = _unsharded(spec)
    # As users train it: an optimizer in backward, so the table gets a fused kernel (an eviction resets
    # the evicted rows through the fused TBE; the dense one has no such method).
    tables = model.mc._embedding_module
    weight = (tables.embedding_bags if spec.pooled else tables.embeddings)["t0"].weight
    apply_optimizer_in_backward(torch.optim.SGD, [weight], {"lr": 0.1})
    sharder = _sharder(spec)
    plan = construct_module_sharding_plan(model.mc, {"t0": row_wise()}, world_size=spec.world_size,
                                          local_size=spec.world_size, device_type="cpu", sharder=sharder)
    sharded = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"mc": plan}), sharders=[sharder])
    sharded.train()
    initial = gather_full_weights(sharded)["t0"]
    forwards = []
    for step, (rank_ids, cuts) in enumerate(zip(spec.steps, spec.cuts)):
        embeddings, remapped = sharded(two_feature_batch(rank_ids[rank], cuts[rank]))
        features = remapped.to_dict()
        embedded = embeddings.to_dict() if spec.pooled else {key: jt.values() for key, jt in embeddings.items()}
        forwards.append({
            "slots": [i for key in FEATURES for i in features[key].values().tolist()],
            "lengths": {key: features[key].lengths().tolist() for key in FEATURES},
            "embedded": {key: value.detach().clone() for key, value in embedded.items()},
            # The rows this forward looked up (an eviction resets the rows of the slots it frees).
            "table": gather_full_weights(sharded)["t0"],
        })
    return {"initial_table": initial, "forwards": forwards}


def _check_slots(spec: ShardedMCSpec, per_rank: list[dict[str, Any]]) -> list[list[set[int]]]:
    """Each shard's remapper against the unsharded model fed every id routed to it; the ids each shard's
    model admits at each forward (``admitted[step][shard]``)."""
    shards = [SlotRules(MCSpec("remapper", spec.zch_per_shard, spec.eviction_interval, (), (), offset=shard * spec.zch_per_shard,
                               seed=spec.seed, hash_size=spec.input_hash_size if spec.hashed else 0), spec.case_id())
              for shard in range(spec.world_size)]
    admitted: list[list[set[int]]] = []
    for step, rank_ids in enumerate(spec.steps):
        admitted.append([])
        for shard, rules in enumerate(shards):
            before = set(rules.model.counts)
            rules.record(spec.remapped_ids(i for ids in rank_ids for i in ids if spec.shard_of(i) == shard))
            admitted[-1].append(set(rules.model.counts) - before)
        for rank, ids in enumerate(rank_ids):
            slots = per_rank[rank]["forwards"][step]["slots"]
            if len(slots) != len(ids):
                raise ParityError(f"forward {step} rank {rank}: {len(slots)} remapped ids for {len(ids)} ids [{spec.case_id()}]")
            for shard, rules in enumerate(shards):
                mine = [(i, s) for i, s in zip(ids, slots) if spec.shard_of(i) == shard]
                rules.check(spec.remapped_ids(i for i, _ in mine), [s for _, s in mine], f"forward {step} rank {rank} (shard {shard})")
    return admitted


def _check_resets(spec: ShardedMCSpec, per_rank: list[dict[str, Any]], admitted: list[list[set[int]]]) -> None:
    """A forward changes the rows of exactly the slots it gives to newly admitted ids (torchrec
    re-initializes them, so that a new id does not inherit the embedding of the id it replaces), on
    the shard that admits them; every other row stays as it was (no optimizer step runs)."""
    before = per_rank[0]["initial_table"]
    for step, forward in enumerate(per_rank[0]["forwards"]):
        changed = set(torch.nonzero((forward["table"] != before).any(dim=1)).flatten().tolist())
        for shard, ids in enumerate(admitted[step]):
            rows = {r for r in changed if r // spec.zch_per_shard == shard}
            if len(rows) != len(ids):
                raise ParityError(f"forward {step} shard {shard}: rows {sorted(rows)} of the table changed, the model admits "
                                  f"{len(ids)} new id(s) {sorted(ids)} there (each a re-initialized row) [{spec.case_id()}]")
        for rank, result in enumerate(per_rank):
            slots = result["forwards"][step]["slots"]
            for id_, slot in zip(spec.steps[step][rank], slots):
                if spec.remapped_ids([id_])[0] in admitted[step][spec.shard_of(id_)] and slot not in changed:
                    raise ParityError(f"forward {step} rank {rank}: id {id_} was admitted to slot {slot}, whose row kept "
                                      f"the embedding of the id before it [{spec.case_id()}]")
        before = forward["table"]


def _check_lookups(spec: ShardedMCSpec, per_rank: list[dict[str, Any]]) -> int:
    """Each rank's embeddings against the gathered table's rows at its remapped ids: summed per sample
    (EBC, norm-wise), or those rows exactly (EC)."""
    compared = 0
    for rank, result in enumerate(per_rank):
        for step, forward in enumerate(result["forwards"]):
            table = forward["table"]
            if not torch.equal(table, per_rank[0]["forwards"][step]["table"]):
                raise ParityError(f"forward {step}: rank {rank} gathered another table than rank 0 [{spec.case_id()}]")
            slots = iter(forward["slots"])
            for key in FEATURES:
                rows = [table[[next(slots) for _ in range(length)]] for length in forward["lengths"][key]]
                got = forward["embedded"][key]
                if not spec.pooled:
                    wanted = torch.cat(rows)
                    found = [] if torch.equal(got, wanted) else [f"rank {rank} {key}: {got.tolist()} != {wanted.tolist()}"]
                else:
                    wanted = torch.stack([r.sum(dim=0) for r in rows])
                    found = normwise(table.dtype).differences(got, wanted, f"rank {rank} {key}") if got.shape == wanted.shape else []
                if got.shape != wanted.shape or found:
                    raise ParityError(f"forward {step} rank {rank}: {key}'s embeddings are not the table's rows at the remapped "
                                      f"ids{' summed per sample' if spec.pooled else ''} {found[:1]} [{spec.case_id()}]")
                compared += wanted.numel()
    return compared


def run_sharded_mc_case(pool: Any, spec: ShardedMCSpec) -> dict[str, Any]:
    if pool.world_size != spec.world_size:
        raise HarnessError(f"sharded MC case needs world size {spec.world_size}, the pool has {pool.world_size}")
    per_rank = pool.call(sharded_mc_on_rank, (spec,), case=spec.case_id())
    _check_resets(spec, per_rank, _check_slots(spec, per_rank))
    return {"forwards": len(spec.steps), "embedding_elements": _check_lookups(spec, per_rank)}
