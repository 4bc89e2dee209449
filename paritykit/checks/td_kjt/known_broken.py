"""Sharded td-kjt configurations that fail inside torchrec, run on purpose by every gate so that
their failures are matched against the known issues (paritykit/checks/known_issues.toml) and
``paritykit gate --strict`` notices the day torchrec fixes one.

- "kjt after td": a sharded EBC whose plan reorders the features, fed a KJT, then the same batch
  as a TensorDict, then the KJT again. torchrec's TensorDict branch of ``input_dist`` sets
  ``self._has_features_permute = False`` for good, so every later KJT is looked up unpermuted:
  features land in the wrong tables (the TensorDict itself and the first KJT are right).
- "rw-mean-beside-others": sharded_draw.RW_MEAN_BESIDE_OTHERS.
- VBE with a placement, kernel or module of ``sharded_draw.VBE_BROKEN`` on this device (labelled
  as there): forward only, except the training-only ones.

A known issue matches the case id ``known-broken <label>: <case>``.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, Callable

from paritykit.checks.td_kjt.batches import route_input
from paritykit.checks.td_kjt.divergence import first_of, output_divergence
from paritykit.checks.td_kjt.pinned import KEYS, pinned_case, pinned_steps
from paritykit.checks.td_kjt.rank import LEARNING_RATE, shard_case
from paritykit.checks.td_kjt.reference import outputs_by_key, reference_step
from paritykit.checks.td_kjt.sharded_draw import (
    MIXED_POOLING,
    ROW_MEAN_TWO_PLACEMENTS,
    VBE_BROKEN,
    case_names,
    routes_for,
)
from paritykit.checks.td_kjt.sharded_spec import ROUTE_KJT, ROUTE_TORCHREC, ShardedCase
from paritykit.checks.td_kjt.tolerances import output_tolerances
from paritykit.compare import find_differences, format_differences
from paritykit.checks import known_configurations
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.configuration import ShardedConfiguration
from paritykit.harness.plans import ebc_row_wise_mean_beside_others
from paritykit.harness.devices import rank_device
from paritykit.harness.sharded import copy_full_weights_into
from paritykit.harness.tables import TableSpec, seeded_full_weights

KJT_AFTER_TD = "kjt-after-td"
RW_MEAN_BESIDE_OTHERS = "rw-mean-beside-others"


def kjt_after_td_case(world_size: int, device: str) -> ShardedCase:
    """Row-wise t0 and t2 are grouped before table-wise t1: the plan's feature order is f0, f2, f1."""
    from paritykit.checks.td_kjt.sharded_draw import kernels_for

    tables = (TableSpec("t0", 8, 4, ("f0",)), TableSpec("t1", 6, 4, ("f1",)), TableSpec("t2", 7, 4, ("f2", "f3")))
    plan = {"t0": ("row_wise",), "t1": ("table_wise", world_size - 1), "t2": ("row_wise",)}
    kernel = next(k for k in kernels_for("ebc", device) if k != "dense")
    form = "from_jagged_offsets"
    return ShardedCase("ebc", world_size, tables, plan, kernel, routes_for(False, False, form), form,
                       pinned_steps(world_size, False, False)[:1], device, seed=31)


def vbe_broken_cases(world_size: int, device: str) -> tuple[tuple[str, ShardedCase], ...]:
    """(label, case): one VBE case per entry of VBE_BROKEN that applies on ``device`` at this world size."""
    from paritykit.checks.td_kjt.sharded_draw import kernels_for

    last = world_size - 1
    ebc = (TableSpec("t0", 8, 4, ("f0", "f1")), TableSpec("t1", 6, 8, ("f2",)), TableSpec("t2", 7, 4, ("f3",)))
    ec = (TableSpec("t0", 8, 8, ("f0", "f1")), TableSpec("t1", 6, 8, ("f2",)), TableSpec("t2", 7, 8, ("f3",)))
    fused = next(k for k in kernels_for("ebc", device) if k != "dense")
    # The forward failures get plans and batch shapes that are the same on every rank, so that they
    # happen on every rank at once (one rank failing while the others wait in a collective costs a
    # restart of the ranks).
    plans = {
        "dense": ("ebc", {"t0": ("table_wise", last), "t1": ("column_wise", (last, 0)), "t2": ("table_wise", 0)}, "dense"),
        "data_parallel": ("ebc", {"t0": ("data_parallel",), "t1": ("data_parallel",), "t2": ("data_parallel",)}, fused),
        "ec": ("ec", {"t0": ("table_wise", last), "t1": ("column_wise", (last, 0)), "t2": ("table_wise", 0)}, fused),
        "row_wise": ("ebc", {"t0": ("row_wise",), "t1": ("table_wise", 0), "t2": ("row_wise",)}, fused),
        "table_row_wise": ("ebc", {"t0": ("table_row_wise", 0), "t1": ("table_wise", last), "t2": ("table_wise", 0)}, fused),
        MIXED_POOLING: ("ebc", {"t0": ("row_wise",), "t1": ("row_wise",), "t2": ("row_wise",)}, fused),
        # Row-wise t0 and t2 are grouped before table-row-wise t1: the plan's feature order is f0, f1, f3, f2.
        ROW_MEAN_TWO_PLACEMENTS: ("ebc", {"t0": ("row_wise",), "t1": ("table_row_wise", 0), "t2": ("row_wise",)}, fused),
    }
    special = {
        MIXED_POOLING: (TableSpec("t0", 8, 4, ("f0", "f1")), TableSpec("t1", 6, 4, ("f2",), "MEAN"), TableSpec("t2", 7, 4, ("f3",))),
        ROW_MEAN_TWO_PLACEMENTS: tuple(replace(t, pooling="MEAN") for t in ebc),
    }
    cases = []
    for broken in VBE_BROKEN:
        if not broken.applies(device, {broken.name}, world_size):
            continue
        module, plan, kernel = plans[broken.name]
        tables = ec if module == "ec" else special.get(broken.name, ebc)
        cases.append((broken.label, pinned_case(module, world_size, device, tables, plan, kernel,
                                                variable_batch=True, form="nested_tensor", seed=32,
                                                # A forward failure is shown by the forward alone, with
                                                # one shape on every rank; backward ones need uneven ranks.
                                                train=broken.training_only,
                                                same_shape_on_ranks=not broken.training_only)))
    return tuple(cases)


def rw_mean_beside_others_case(world_size: int, device: str) -> ShardedCase:
    """A row-wise MEAN table beside a table-wise SUM and a column-wise MEAN table (RW_MEAN_BESIDE_OTHERS)."""
    from paritykit.checks.td_kjt.sharded_draw import kernels_for

    tables = (TableSpec("t0", 8, 4, ("f0", "f1"), "MEAN"), TableSpec("t1", 6, 4, ("f2",)), TableSpec("t2", 7, 8, ("f3",), "MEAN"))
    plan = {"t0": ("row_wise",), "t1": ("table_wise", world_size - 1), "t2": ("column_wise", (world_size - 1, 0))}
    kernel = next(k for k in kernels_for("ebc", device) if k != "dense")
    return pinned_case("ebc", world_size, device, tables, plan, kernel, seed=33)


def kjt_after_td_on_rank(case: ShardedCase) -> dict[str, Any]:
    """Feed one sharded EBC the KJT, the TensorDict, then the KJT of one batch; compare each with
    the unsharded module. Raises ParityError naming the feeding that differs."""
    import torch.distributed as dist

    rank = dist.get_rank()
    device = rank_device(case.device)
    full = {name: w.to(device) for name, w in seeded_full_weights(case.tables, case.seed).items()}
    module = shard_case(case, device)
    copy_full_weights_into(module, full)
    expected, _ = reference_step(case, 0, rank, device, LEARNING_RATE)
    tolerances = output_tolerances(case, case.steps[0][rank], full)
    problems, divergences = [], []
    for order, route in enumerate((ROUTE_KJT, ROUTE_TORCHREC, ROUTE_KJT)):
        outputs = outputs_by_key(case.module, module(route_input(case.steps[0][rank], route, case.form, device)))
        for key in sorted(expected):
            tol = tolerances[key]
            found = find_differences(outputs[key], expected[key], rtol=tol.rtol, atol=tol.atol, name=f"output[{key!r}]")
            if found:
                problems.append(f"feeding {order + 1} ({route}): {format_differences(found[:1])}".replace("\n", " | "))
                divergences.append(output_divergence(case, 0, rank, "sharded vs unsharded", key, found[0]))
    if problems:
        raise ParityError(f"td-kjt {KJT_AFTER_TD}, rank {rank}: vs the unsharded module\n  " + "\n  ".join(problems[:4])
                          + f"\n  case: {case.describe()}", divergence=first_of(divergences, case))
    return {"feedings": 3, "keys": len(KEYS)}


# ---------------------------------------------------------------- the entries' configurations (known_configurations.py)

# Entry id -> the labels of the cases above that show it.
ISSUE_LABELS = {KJT_AFTER_TD: (KJT_AFTER_TD,), RW_MEAN_BESIDE_OTHERS: (RW_MEAN_BESIDE_OTHERS,),
                **{b.label: (b.label,) for b in VBE_BROKEN if "row-wise" not in b.label},
                "vbe-training-row-wise": ("vbe-training-row-wise", "vbe-training-table-row-wise")}


def _names(config: ShardedConfiguration) -> set[str]:
    """What a configuration is made of, in the names VBE_BROKEN uses (module, kernels, placements)."""
    kernels = {config.kernel_of(t.name) for t in config.tables if config.plan[t.name][0] != "data_parallel"} or {"fused"}
    return set().union(*(case_names(config.module, kernel, config.tables, config.plan) for kernel in kernels))


def _vbe_broken(labels: tuple[str, ...]) -> Callable[[ShardedConfiguration], bool]:
    broken = [b for b in VBE_BROKEN if b.label in labels]

    def applies(config: ShardedConfiguration) -> bool:
        # A backward that needs several ranks fails where their batches differ in shape (uneven gathers).
        return config.variable_batch and any(
            b.applies(config.device, _names(config), config.world_size) and (config.train or not b.training_only)
            and (b.min_world_size == 1 or config.uneven_batches) for b in broken)

    return applies


def _kjt_after_td(config: ShardedConfiguration) -> bool:
    return config.module == "ebc" and "td" in config.feedings[:-1] and config.feedings[-1] == "kjt"


def _reproduction(labels: tuple[str, ...]) -> ShardedConfiguration:
    """The first of the gate's known-broken cases with one of ``labels``, at the smallest world size."""
    from paritykit.checks.td_kjt.divergence import configuration_of

    for world_size in (1, 2):
        for label, case in _labelled_cases(world_size):
            if label in labels:
                config = configuration_of(case)
                return replace(config, feedings=("kjt", "td", "kjt"), train=False) if label == KJT_AFTER_TD else config
    raise HarnessError(f"no known-broken td-kjt case is labelled {labels}")


def _labelled_cases(world_size: int) -> list[tuple[str, ShardedCase]]:
    return [(KJT_AFTER_TD, kjt_after_td_case(world_size, "cpu")), (RW_MEAN_BESIDE_OTHERS, rw_mean_beside_others_case(world_size, "cpu")),
            *vbe_broken_cases(world_size, "cpu")]


for _issue, _labels in ISSUE_LABELS.items():
    _applies = {KJT_AFTER_TD: _kjt_after_td, RW_MEAN_BESIDE_OTHERS: ebc_row_wise_mean_beside_others}.get(_issue) or _vbe_broken(_labels)
    known_configurations.register(_issue, "td-kjt", _applies, functools.partial(_reproduction, _labels))
