"""Managed collision: MCHManagedCollisionModule (LFU, LRU and DistanceLFU eviction) against the
pure-Python model of what it keeps (mc_reference.py), and ManagedCollisionEmbeddingCollection / EmbeddingBagCollection against
the remap followed by a lookup by hand.

For the remapper, after every training forward: every output id lies in [offset, offset + zch_size);
an id the model says holds a slot gets a slot other than the default, distinct ids distinct slots,
and the same slot as long as it stays; every other id gets the default slot; lengths are unchanged.
Then in eval mode every id maps as the final table says, twice (eval changes nothing).
With an ``input_hash_func`` (a user's hash, applied to the ids before the remap), the model is fed the ids
hashed by hand. For MC-EC/EBC (return_remapped_features=True): the remapped features are held to the same rules, and
the embeddings equal the table's rows at the remapped ids (EC: bit for bit; EBC: summed per sample,
norm-wise), their gradient a scatter-add by hand of the upstream gradient at those ids.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from paritykit.checks.modules.mc_reference import FILTERS, POLICIES, EvictionTable
from paritykit.errors import ParityError


HASH_MULTIPLIER, HASH_INCREMENT = 7, 3


class AffineHash:
    """A user's input_hash_func (picklable): ids -> (7 * id + 3) mod input_hash_size, as a tensor op."""

    def __call__(self, values: torch.Tensor, size: int) -> torch.Tensor:
        return torch.remainder(values * HASH_MULTIPLIER + HASH_INCREMENT, size)


def hashed_by_hand(ids: Any, hash_size: int) -> list[int]:
    """AffineHash's meaning in Python integers; with ``hash_size`` 0 (no hash) the ids themselves."""
    ids = [int(i) for i in ids]
    return [(HASH_MULTIPLIER * i + HASH_INCREMENT) % hash_size for i in ids] if hash_size else ids


def ids_hashing_to(hashed: Any, hash_size: int) -> list[int]:
    """Ids in [0, hash_size) that AffineHash sends to ``hashed`` (its inverse; hash_size prime to 7)."""
    inverse = pow(HASH_MULTIPLIER, -1, hash_size)
    return [inverse * (int(h) - HASH_INCREMENT) % hash_size for h in hashed]


@dataclass(frozen=True)
class MCSpec:
    """``steps``: the ids of each training forward (the same number each time), with ``cuts``: where
    feature f0 ends and f1 starts (MC-EC/EBC) or where the batch's first sample ends (the remapper)."""

    module: str  # "remapper", "mc-ec" or "mc-ebc"
    zch_size: int
    eviction_interval: int
    steps: tuple[tuple[int, ...], ...]
    cuts: tuple[int, ...]
    offset: int = 0
    seed: int = 0
    policy: str = "lfu"  # one of mc_reference.POLICIES
    decay: float = 1.0  # LRU's and DistanceLFU's decay_exponent
    hash_size: int = 0  # input_hash_size with AffineHash as the input_hash_func; 0: no input_hash_func
    threshold: str = ""  # the policy's threshold filter (mc_reference.FILTERS); "": none
    skew: float = 1.0  # the dynamic filter's threshold_skew_multiplier

    def case_id(self) -> str:
        policy = "" if self.policy == "lfu" else f" policy={self.policy} decay_exponent={self.decay:g}"
        if self.threshold:
            policy += f" threshold_filter={self.threshold}" + (f"(skew={self.skew:g})" if self.threshold == "dynamic" else "")
        hashed = f" input_hash_func=AffineHash input_hash_size={self.hash_size}" if self.hash_size else ""
        return (f"{self.module} zch_size={self.zch_size} eviction_interval={self.eviction_interval} offset={self.offset}{policy}{hashed} "
                f"steps={list(map(list, self.steps))} cuts={list(self.cuts)} seed={self.seed}")

    def hashed(self, ids: Any) -> list[int]:
        """The ids the remapper must see."""
        return hashed_by_hand(ids, self.hash_size)

    def hash_options(self) -> dict[str, Any]:
        """The remapper's keyword arguments for the input hash (none without one)."""
        return {"input_hash_size": self.hash_size, "input_hash_func": AffineHash()} if self.hash_size else {}

    def eviction_policy(self) -> Any:
        from torchrec.modules import mc_modules

        kwargs: dict[str, Any] = {"threshold_filtering_func": self.threshold_filter()} if self.threshold else {}
        if self.policy == "lfu":
            return mc_modules.LFU_EvictionPolicy(**kwargs)
        policy = mc_modules.LRU_EvictionPolicy if self.policy == "lru" else mc_modules.DistanceLFU_EvictionPolicy
        return policy(decay_exponent=self.decay, **kwargs)

    def threshold_filter(self) -> Callable[[torch.Tensor], Any]:
        from torchrec.modules import mc_modules

        if self.threshold == "average":
            return mc_modules.average_threshold_filter
        return functools.partial(mc_modules.dynamic_threshold_filter, threshold_skew_multiplier=self.skew)


@st.composite
def mc_specs(draw: st.DrawFn, module: str) -> MCSpec:
    zch = draw(st.integers(2, 8))
    per_step = draw(st.integers(1, 6))
    universe = draw(st.integers(1, 3 * zch))
    steps = draw(st.lists(st.lists(st.integers(0, universe - 1), min_size=per_step, max_size=per_step).map(tuple),
                          min_size=1, max_size=6).map(tuple))
    cuts = tuple(draw(st.integers(0, per_step)) for _ in steps)
    offset = draw(st.integers(0, 20)) if module == "remapper" else 0
    policy = draw(st.sampled_from(POLICIES))
    # Exponents whose powers of small integers float32 holds exactly (the model compares the same scores).
    decay = 1.0 if policy == "lfu" else draw(st.sampled_from((1.0, 2.0)))
    # An input hash onto fewer values than the universe makes raw ids collide before the remap.
    hash_size = draw(st.one_of(st.just(0), st.integers(1, 3 * zch)))
    # A threshold filter in two cases of five; skew multipliers around 1 pass some ids and stop others.
    threshold = draw(st.sampled_from(FILTERS + ("",) * (len(FILTERS) - 1)))
    skew = draw(st.sampled_from((0.5, 1.0, 1.5, 2.0))) if threshold == "dynamic" else 1.0
    return MCSpec(module, zch, draw(st.integers(1, 3)), steps, cuts, offset, draw(st.integers(0, 2**16)), policy, decay, hash_size,
                  threshold, skew)


class SlotRules:
    """The remapper's stated behaviour, checked output after output against the model."""

    def __init__(self, spec: MCSpec, case_id: str | None = None) -> None:
        """``case_id``: the case named in failures (a sharded case's, for the model of one shard)."""
        self.spec, self.slots, self.case_id = spec, {}, case_id or spec.case_id()
        self.model = EvictionTable(spec.zch_size, spec.eviction_interval, spec.policy, spec.decay, spec.threshold, spec.skew)
        self.default = spec.offset + spec.zch_size - 1

    def record(self, ids: list[int]) -> None:
        for gone in self.model.train_forward(ids):
            self.slots.pop(gone, None)

    def check(self, ids: list[int], remapped: list[int], where: str) -> None:
        spec, seen = self.spec, {}
        for id_, slot in zip(ids, remapped):
            what = f"{where}: {'hashed ' if spec.hash_size else ''}id {id_} -> slot {slot} [{self.case_id}]"
            if not spec.offset <= slot < spec.offset + spec.zch_size:
                raise ParityError(f"{what}: outside [{spec.offset}, {spec.offset + spec.zch_size})")
            if not self.model.holds(id_):
                if slot != self.default:
                    raise ParityError(f"{what}: {spec.policy} gives this id no slot, so it must get the default slot {self.default}")
                continue
            if slot == self.default:
                raise ParityError(f"{what}: the id holds a slot under {spec.policy} ({sorted(self.model.counts)}), not the default one")
            if seen.setdefault(slot, id_) != id_:
                raise ParityError(f"{what}: ids {seen[slot]} and {id_} share a slot")
            if self.slots.setdefault(id_, slot) != slot:
                raise ParityError(f"{what}: the id held slot {self.slots[id_]} and was not evicted since")


def _remapper(spec: MCSpec) -> Any:
    from torchrec.modules.mc_modules import MCHManagedCollisionModule

    return MCHManagedCollisionModule(zch_size=spec.zch_size, device=torch.device("cpu"), eviction_policy=spec.eviction_policy(),
                                     eviction_interval=spec.eviction_interval, output_global_offset=spec.offset, **spec.hash_options())


def run_remapper_case(spec: MCSpec) -> dict[str, Any]:
    from torchrec.sparse.jagged_tensor import JaggedTensor

    module, rules = _remapper(spec), SlotRules(spec)
    module.train()
    for step, (ids, cut) in enumerate(zip(spec.steps, spec.cuts)):
        lengths = torch.tensor([cut, len(ids) - cut])
        out = module({"t": JaggedTensor(values=torch.tensor(ids, dtype=torch.int64), lengths=lengths)})["t"]
        rules.record(spec.hashed(ids))
        if not torch.equal(out.lengths(), lengths):
            raise ParityError(f"training forward {step}: lengths {out.lengths().tolist()} != {lengths.tolist()} [{spec.case_id()}]")
        rules.check(spec.hashed(ids), out.values().tolist(), f"training forward {step}")
    module.eval()
    every = sorted({i for ids in spec.steps for i in ids})
    for call in range(2):
        out = module({"t": JaggedTensor(values=torch.tensor(every, dtype=torch.int64), lengths=torch.tensor([len(every)]))})["t"]
        rules.check(spec.hashed(every), out.values().tolist(), f"eval forward {call}")
    return {"forwards": len(spec.steps) + 2, "ids_holding_slots": len(rules.model.counts)}
