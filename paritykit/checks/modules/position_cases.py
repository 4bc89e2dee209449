"""torchrec's position-weighted feature processors of ``torchrec.modules.feature_processor``, the ones a
user puts before a weighted EmbeddingBagCollection (and a pipeline runs as a post-processing module):
``PositionWeightedProcessor`` on a KeyedJaggedTensor and ``PositionWeightedModule`` on a dict of
JaggedTensors, against what they document:

- the id at position j of a bag of feature f gets the weight ``position_weights[f][j]``; a KJT that
  carries weights already (a row-wise shard's input, whose weights are the ids' positions in their
  bags) takes its weights as those positions;
- the processor keeps the features it has weights for, in the KJT's key order, with their values,
  lengths and variable batch (``stride_per_key_per_rank``); a KJT of none of them comes back as it
  was; the module weights its features and keeps the others as they were;
- each position weight's gradient is the sum of the upstream gradients of the weights it gave.

The weights are drawn distinct (a processor reading the wrong position gives another value), and the
oracle is the definition, computed here over plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.checks.known_issues import rule_kept_out
from paritykit.errors import ParityError

KEYS = ("f0", "f1", "f2")
# A known issue, kept out of the draws: a variable batch with features the processor does not weight.
VARIABLE_BATCH_MIXED = "position-weighted-processor-variable-batch"


@dataclass(frozen=True)
class PositionSpec:
    """``bags[k]``: the bags of feature ``KEYS[k]`` (ids), ``len(bags[k])`` its batch (varied: a variable
    batch); ``lengths[f]``: the processor's max length of feature f (the features it weights);
    ``positions``: the KJT carries each id's position as its weight, drawn within the max length."""

    bags: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: tuple[tuple[str, int], ...]
    positions: tuple[tuple[int, ...], ...] | None = None
    vbe: bool = False

    def case_id(self) -> str:
        batch = "variable batch" if self.vbe else f"batch {len(self.bags[0])}"
        return (f"position-weighted processor {dict(self.lengths)} over {dict(zip(KEYS, self.bags))} ({batch})"
                + (f" with positions as weights {self.positions}" if self.positions is not None else ""))


@st.composite
def position_specs(draw: Any) -> PositionSpec:
    weighted = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=len(KEYS)))
    mixed = 0 < len(weighted) < len(KEYS)
    vbe = draw(st.booleans()) and not (mixed and rule_kept_out(VARIABLE_BATCH_MIXED) is not None)
    shared = draw(st.integers(1, 3))
    bags = tuple(tuple(tuple(draw(st.lists(st.integers(0, 9), max_size=4))) for _ in range(draw(st.integers(1, 3)) if vbe else shared))
                 for _ in KEYS)
    longest = [max((len(bag) for bag in feature), default=0) for feature in bags]
    lengths = tuple((key, max(1, longest[KEYS.index(key)]) + draw(st.integers(0, 2))) for key in KEYS if key in weighted)
    positions = None
    if draw(st.booleans()):
        # A row-wise shard's positions: within the bag's feature's max length (any where the feature is not weighted).
        most = dict(lengths)
        positions = tuple(tuple(draw(st.integers(0, most.get(key, 4) - 1)) for bag in feature for _ in bag)
                          for key, feature in zip(KEYS, bags))
    return PositionSpec(bags, lengths, positions, vbe)


_BAGS = (((1, 2), (), (3,)), ((4,), (5, 6), ()), ((), (7, 8, 9), (0,)))
PINNED = (
    # Every feature weighted (the KJT kept whole), one of three (the others dropped), none (as it was).
    PositionSpec(_BAGS, (("f0", 2), ("f1", 3), ("f2", 3))),
    PositionSpec(_BAGS, (("f1", 2),)),
    PositionSpec(_BAGS, ()),
    # A variable batch, with positions carried as weights.
    PositionSpec((((1, 2, 3),), ((4,), (5, 6)), ((), (7,), (8, 9))), (("f0", 4), ("f1", 2), ("f2", 2)),
                 positions=((2, 0, 1), (1, 0, 1), (0, 1, 0)), vbe=True),
)


# The known issue's reproduction: f1 weighted, its three empty bags beside one of f0 and of f2.
VARIABLE_BATCH_MIXED_SPEC = PositionSpec((((),), ((), (), ()), ((),)), (("f1", 1),), vbe=True)


def _position_weights(spec: PositionSpec) -> dict[str, list[float]]:
    """Distinct weights: feature i's position j weighs 1 + i / 10 + j / 100."""
    return {key: [1.0 + KEYS.index(key) / 10 + j / 100 for j in range(length)] for key, length in spec.lengths}


def _positions(spec: PositionSpec) -> list[list[int]]:
    """Each id's position: its index in its bag, or the carried one."""
    if spec.positions is not None:
        return [list(p) for p in spec.positions]
    return [[j for bag in feature for j in range(len(bag))] for feature in spec.bags]


def _kjt(spec: PositionSpec) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values = [v for feature in spec.bags for bag in feature for v in bag]
    lengths = [len(bag) for feature in spec.bags for bag in feature]
    weights = None if spec.positions is None else torch.tensor([float(p) for feature in spec.positions for p in feature])
    strides = [len(feature) for feature in spec.bags]
    return KeyedJaggedTensor(keys=list(KEYS), values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int32),
                             weights=weights, **({"stride_per_key_per_rank": [[s] for s in strides]} if spec.vbe else {"stride": strides[0]}))


def _set_weights(module: Any, weights: dict[str, list[float]]) -> None:
    with torch.no_grad():
        for key, values in weights.items():
            module.position_weights[key].copy_(torch.tensor(values))


def _problems_of_processor(spec: PositionSpec, out: Any, weights: dict[str, list[float]]) -> list[str]:
    positions, kept = _positions(spec), [key for key in KEYS if key in weights]
    if not kept:  # none of the processor's features: the KJT as it was
        want_weights = None if spec.positions is None else [float(p) for feature in spec.positions for p in feature]
        got_weights = None if out.weights_or_none() is None else out.weights().tolist()
        return [] if (out.keys() == list(KEYS) and got_weights == want_weights) else [
            f"a KJT of no weighted feature came back as keys {out.keys()} weights {got_weights}, not as it was"]
    problems = []
    if out.keys() != kept:
        return [f"the processor's output keys are {out.keys()}, expected the weighted features {kept} in the KJT's order"]
    for key in kept:
        k = KEYS.index(key)
        feature = out[key]
        bags = [list(bag) for bag in spec.bags[k]]
        got_bags = [row.tolist() for row in feature.to_dense()]
        want = [weights[key][p] for p in positions[k]]
        got = feature.weights().tolist()
        if got_bags != bags:
            problems.append(f"feature {key}: bags {got_bags}, expected {bags}")
        if len(got) != len(want) or any(abs(g - w) > 1e-6 for g, w in zip(got, want)):
            problems.append(f"feature {key}: weights {[round(g, 4) for g in got]}, expected position_weights[{key}] at "
                            f"positions {positions[k]}: {[round(w, 4) for w in want]}")
    if spec.vbe and out.variable_stride_per_key() and out.stride_per_key() != [len(spec.bags[KEYS.index(key)]) for key in kept]:
        problems.append(f"the variable batch per feature became {out.stride_per_key()}")
    if spec.vbe and not out.variable_stride_per_key():
        problems.append("a KJT of a variable batch per feature came back with one batch size")
    return problems


def _gradient_problems(spec: PositionSpec, module: Any, out_weights: dict[str, torch.Tensor]) -> list[str]:
    """Backward of sum(c * weight) over the output weights, c = 1 + the weight's index: each position weight's
    gradient is the sum of c over the ids it weighed."""
    positions = _positions(spec)
    loss = sum((torch.arange(1, w.numel() + 1, dtype=w.dtype) * w).sum() for w in out_weights.values())
    if not isinstance(loss, torch.Tensor):
        return []
    loss.backward()
    problems = []
    for key, weight in out_weights.items():
        want = [0.0] * len(module.position_weights[key])
        for index, p in enumerate(positions[KEYS.index(key)]):
            want[p] += index + 1.0
        grad = module.position_weights[key].grad
        got = [0.0] * len(want) if grad is None else grad.tolist()
        if got != want:
            problems.append(f"position_weights[{key}] gradient {got}, expected {want} (the sum of the upstream gradients of the "
                            "weights each position gave)")
    return problems


def run_position_case(spec: PositionSpec) -> dict[str, Any]:
    from torchrec.modules.feature_processor import PositionWeightedModule, PositionWeightedProcessor

    weights = _position_weights(spec)
    problems = []
    processor = PositionWeightedProcessor(max_feature_lengths=dict(spec.lengths))
    _set_weights(processor, weights)
    out = processor(_kjt(spec))
    problems += [f"PositionWeightedProcessor: {p}" for p in _problems_of_processor(spec, out, weights)]
    if not problems and weights:
        problems += [f"PositionWeightedProcessor: {p}" for p in _gradient_problems(spec, processor, {k: out[k].weights() for k in weights})]
    state = processor.state_dict()
    if sorted(state) != sorted(f"position_weights.{key}" for key in weights) or list(processor.named_buffers()):
        problems.append(f"PositionWeightedProcessor's state_dict keys {sorted(state)} (expected its position weights), buffers "
                        f"{[n for n, _ in processor.named_buffers()]} (expected none)")
    if spec.positions is None and not spec.vbe:
        # The module on a dict of JaggedTensors (its own positions: a bag's index).
        module = PositionWeightedModule(max_feature_lengths=dict(spec.lengths))
        module_weights = weights
        _set_weights(module, module_weights)
        features = _kjt(spec).to_dict()
        before = {key: features[key].values().tolist() for key in KEYS}
        result = module(features)
        if sorted(result) != list(KEYS):
            problems.append(f"PositionWeightedModule returned features {sorted(result)}, expected {list(KEYS)}")
        else:
            for key in KEYS:
                k = KEYS.index(key)
                got_weights = result[key].weights_or_none()
                if result[key].values().tolist() != before[key]:
                    problems.append(f"PositionWeightedModule changed the values of {key}")
                if key in module_weights:
                    want = [module_weights[key][j] for j in _positions(spec)[k]]
                    if got_weights is None or [round(w, 5) for w in got_weights.tolist()] != [round(w, 5) for w in want]:
                        problems.append(f"PositionWeightedModule: feature {key} weights "
                                        f"{None if got_weights is None else got_weights.tolist()}, expected {want}")
                elif got_weights is not None:
                    problems.append(f"PositionWeightedModule gave feature {key}, which it has no weights for, weights")
    if problems:
        raise ParityError(f"{spec.case_id()}\n  " + "\n  ".join(problems))
    return {"features": len(weights), "ids": sum(len(bag) for feature in spec.bags for bag in feature)}
