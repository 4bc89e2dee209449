"""ManagedCollisionEmbeddingCollection / EmbeddingBagCollection: the remap (held to the remapper's
rules, mc_cases.SlotRules) followed by the embedding lookup, against a lookup by hand of the table's
rows at the remapped ids; the table's gradient against a scatter-add by hand of the upstream gradient.

An EC lookup is a gather: bit for bit. An EBC's sums per sample and the table's gradient (upstream
gradients, multiples of 1/8, added per row) may be summed in another order: the norm-wise bound.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.checks.modules.mc_cases import MCSpec, SlotRules, mc_specs, run_remapper_case
from paritykit.engine.tolerances import normwise
from paritykit.errors import ParityError
from paritykit.harness.seeding import generator

FEATURES = ("f0", "f1")
DIM = 3


def _module(spec: MCSpec) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection, ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule

    bagged = spec.module == "mc-ebc"
    config = (EmbeddingBagConfig if bagged else EmbeddingConfig)(name="t0", embedding_dim=DIM, num_embeddings=spec.zch_size,
                                                                 feature_names=list(FEATURES))
    cpu = torch.device("cpu")
    embeddings = EmbeddingBagCollection(tables=[config], device=cpu) if bagged else EmbeddingCollection(tables=[config], device=cpu)
    remapper = MCHManagedCollisionModule(zch_size=spec.zch_size, device=cpu, eviction_policy=spec.eviction_policy(),
                                         eviction_interval=spec.eviction_interval, **spec.hash_options())
    collection = ManagedCollisionCollection({"t0": remapper}, [config])
    wrapper = ManagedCollisionEmbeddingBagCollection if bagged else ManagedCollisionEmbeddingCollection
    return wrapper(embeddings, collection, return_remapped_features=True)


def two_feature_batch(ids: tuple[int, ...], cut: int) -> Any:
    """f0 gets ids[:cut], f1 the rest; each feature's ids are split over two samples."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    f0, f1 = len(ids[:cut]), len(ids[cut:])
    lengths = [f0 // 2, f0 - f0 // 2, f1 - f1 // 2, f1 // 2]
    return KeyedJaggedTensor(keys=list(FEATURES), values=torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor(lengths))


def _by_hand(spec: MCSpec, table: torch.Tensor, remapped: Any, key: str) -> torch.Tensor:
    """EC: the rows at the remapped ids; EBC: their sums per sample."""
    slots, lengths = remapped[key].values(), remapped[key].lengths().tolist()
    rows = table[slots]
    if spec.module == "mc-ec":
        return rows
    sums, start = [], 0
    for length in lengths:
        sums.append(rows[start:start + length].sum(dim=0) if length else torch.zeros(DIM, dtype=table.dtype))
        start += length
    return torch.stack(sums)


def _outputs(spec: MCSpec, embeddings: Any) -> dict[str, torch.Tensor]:
    if spec.module == "mc-ec":
        return {key: embeddings[key].values() for key in FEATURES}
    return embeddings.to_dict()


def _step(spec: MCSpec, module: Any, rules: SlotRules, step: int) -> int:
    ids, cut = spec.steps[step], spec.cuts[step]
    embeddings, remapped = module(two_feature_batch(ids, cut))
    rules.record(spec.hashed(ids))
    if remapped is None or sorted(remapped.keys()) != sorted(FEATURES):
        raise ParityError(f"forward {step}: return_remapped_features=True returned {remapped!r} [{spec.case_id()}]")
    features = remapped.to_dict()
    rules.check(spec.hashed(ids), torch.cat([features[k].values() for k in FEATURES]).tolist(), f"forward {step} remap")
    table = dict(module.named_parameters())[next(n for n, _ in module.named_parameters() if n.endswith("t0.weight"))]
    outputs = _outputs(spec, embeddings)
    upstream = {k: torch.randint(-8, 9, tuple(outputs[k].shape), generator=generator("mc", spec.case_id(), step, k)) / 8 for k in FEATURES}
    expected_grad = torch.zeros_like(table)
    for key in FEATURES:
        wanted = _by_hand(spec, table.detach(), features, key)
        bound = None if spec.module == "mc-ec" else normwise(table.dtype)
        if (bound is None and not torch.equal(outputs[key], wanted)) or (bound is not None and bound.differences(outputs[key].detach(), wanted, key)):
            raise ParityError(f"forward {step}: {key}'s embeddings are not the table's rows at the remapped ids "
                              f"{features[key].values().tolist()} [{spec.case_id()}]")
        rows = upstream[key] if spec.module == "mc-ec" else upstream[key].repeat_interleave(features[key].lengths(), dim=0)
        expected_grad.index_add_(0, features[key].values(), rows)
    grad = torch.autograd.grad([outputs[k] for k in FEATURES], table, [upstream[k] for k in FEATURES], allow_unused=True)[0]
    grad = torch.zeros_like(table) if grad is None else grad
    if normwise(table.dtype).differences(grad.to_dense(), expected_grad, "t0.weight gradient"):
        raise ParityError(f"forward {step}: the table's gradient is not the upstream gradient scattered to the remapped ids [{spec.case_id()}]")
    return len(ids)


def run_lookup_case(spec: MCSpec) -> dict[str, Any]:
    module, rules = _module(spec), SlotRules(spec)
    module.train()
    looked_up = sum(_step(spec, module, rules, step) for step in range(len(spec.steps)))
    return {"forwards": len(spec.steps), "ids_looked_up": looked_up}


PINNED = {
    "remapper": (MCSpec("remapper", 6, 1, ((10, 20, 10, 30), (20, 40, 50, 20), (60, 70, 10, 10), (5, 60, 60, 60)), (2, 1, 4, 0), offset=7),
                 # LRU: the two most recent of three ids seen together stay, by count then id; later, ties by id.
                 MCSpec("remapper", 3, 2, ((1, 1, 2), (3, 4, 1), (5, 5, 5), (2, 6, 5)), (1, 2, 0, 3), policy="lru", decay=2.0),
                 # DistanceLFU: 2 (twice, just now: 2/1) beats 1 (five times, two forwards ago: 5/3); an age
                 # off by one would keep 1 (5/4 against 2/2).
                 MCSpec("remapper", 2, 3, ((1, 1, 1, 1, 1), (10, 11, 12, 13, 14), (2, 2, 20, 21, 22)), (2, 1, 3),
                        policy="distance_lfu"),
                 # A new id's last access is stored when it takes a slot: 1 (forward 1) is older than 2 (forward 2)
                 # when 3 comes, so 1 goes; ids that had kept a stale access would tie, and the tie keeps 1.
                 MCSpec("remapper", 3, 1, ((1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)), (2, 2, 2), policy="lru"),
                 MCSpec("remapper", 3, 1, ((1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)), (2, 2, 2), policy="distance_lfu"),
                 # input_hash_size 5: (7 id + 3) mod 5 sends 1, 6 and 11 to 0; they share one slot.
                 MCSpec("remapper", 3, 1, ((1, 6, 2, 11), (2, 4, 6, 9)), (2, 1), offset=2, hash_size=5),
                 # Threshold filters: the second forward's counts (2, 2) and the window's (2, 1, 3, 2) sit on
                 # their thresholds (the mean 2; 8 / 4 x 1.0), which only a count strictly above passes.
                 MCSpec("remapper", 3, 1, ((1, 1, 1, 2), (2, 2, 3, 3), (5, 5, 5, 1)), (2, 1, 3), threshold="average"),
                 MCSpec("remapper", 3, 2, ((1, 2, 3, 3), (3, 4, 4, 1), (5, 5, 6, 1), (2, 2, 2, 6)), (1, 2, 2, 0), policy="lru",
                        threshold="dynamic", skew=1.0)),
    "mc-ec": (MCSpec("mc-ec", 5, 1, ((7, 8, 9, 7, 100), (7, 3, 3, 8, 1)), (2, 3)),
              MCSpec("mc-ec", 4, 1, ((7, 2, 12, 100), (7, 3, 3, 8)), (2, 3), hash_size=6)),
    "mc-ebc": (MCSpec("mc-ebc", 5, 2, ((7, 8, 9, 7, 100), (7, 3, 3, 8, 1), (2, 2, 4, 4, 7)), (2, 3, 5)),),
}


def mc_properties() -> list[tuple[Any, Any, tuple[MCSpec, ...]]]:
    """(strategy, body, pinned specs) of each managed-collision property, in gate order."""
    return [(mc_specs("remapper"), run_remapper_case, PINNED["remapper"]),
            (mc_specs("mc-ec"), run_lookup_case, PINNED["mc-ec"]),
            (mc_specs("mc-ebc"), run_lookup_case, PINNED["mc-ebc"])]
