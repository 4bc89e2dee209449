"""What every rank runs for a sharded td-kjt case: three-way parity.

The plan is sharded once; for each step every route's batch goes through it from the same seeded
weights (copied in again before each route), one backward and one SGD step follow, and the tables
are gathered from the shards. Compared:
- "vs-unsharded": each route's outputs (key by key) and stepped tables against the unsharded
  module (reference.py), within the bounds of tolerances.py (EC outputs bit-exact);
- "td-vs-kjt": each TensorDict route's outputs and tables against the KJT route's, bit-exact
  (the same sharded computation on the same numbers).

torchrec's own TensorDict route gets a sharded module of its own: once a sharded EBC has been fed
a TensorDict it stops permuting the features of later KJTs (docs/td-kjt.md, known issue), which
would fail every later KJT rather than test the TensorDict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from paritykit.checks.td_kjt.batches import route_input
from paritykit.checks.td_kjt.divergence import first_of, output_divergence, path_of, table_divergence
from paritykit.checks.td_kjt.reference import (
    build_unsharded,
    loss_of,
    outputs_by_key,
    reference_step,
)
from paritykit.checks.td_kjt.sharded_spec import ROUTE_KJT, ROUTE_TORCHREC, ShardedCase
from paritykit.checks.td_kjt.tolerances import output_tolerances, table_tolerances
from paritykit.compare import find_differences, format_differences
from paritykit.errors import Divergence, HarnessError, ParityError
from paritykit.harness.devices import rank_device
from paritykit.harness.plans import local_world_size
from paritykit.harness.sharded import (
    copy_full_weights_into,
    gather_full_weights,
    gradient_division,
    sgd_step_dense_parameters,
    shard_module,
)
from paritykit.harness.tables import seeded_full_weights, table_of_key

LEARNING_RATE = 0.1
VS_UNSHARDED = "vs-unsharded"
TD_VS_KJT = "td-vs-kjt"
_SHOWN_PROBLEMS = 6


@dataclass
class RankReport:
    """What one rank found: problems by kind, and how many elements were compared."""

    rank: int
    problems: list[tuple[str, str]] = field(default_factory=list)  # (kind, text)
    divergences: list[Divergence] = field(default_factory=list)  # the same problems as data, in order
    output_elements: int = 0
    table_elements: int = 0

    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.problems}


@contextlib.contextmanager
def _one_intra_op_thread(device: torch.device) -> Iterator[None]:
    """The check's tensors are tiny: on CPU, more intra-op threads only add OpenMP overhead (fbgemm's
    CPU backward of a VBE batch ran 8x slower with 2 threads than with 1 on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _stage(where: str) -> Iterator[None]:
    """Name the stage in any exception's traceback (torchrec's or ours) without changing its type."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"td-kjt: while {where}")
        raise


def shard_case(case: ShardedCase, device: torch.device) -> torch.nn.Module:
    """The case's module sharded by its plan and kernel (fused kernels step with SGD at LEARNING_RATE)."""
    module = build_unsharded(case, case.seed + 1, device)  # other weights: the copy below must land
    twrw = [t.name for t in case.tables if case.plan[t.name][0] in ("table_row_wise", "grid_shard")]
    if twrw and case.kernel != "dense":
        # torchrec's table_row_wise and grid_shard generators take no kernel and pick dense, unless the
        # table has an optimizer in backward: then the fused kernel with that optimizer (SGD, the same lr).
        from torchrec.optim.apply_optimizer_in_backward import (
            apply_optimizer_in_backward,
        )

        params = [p for name, p in module.named_parameters() if table_of_key(name) in twrw]
        apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": LEARNING_RATE})
    return shard_module(module, case.plan, device=str(device), compute_kernel=case.kernel, learning_rate=LEARNING_RATE)


def _differences(name: str, actual: Any, expected: Any, tolerance: Any) -> tuple[str, Any] | None:
    """(the text of the differences, the first one) or None."""
    if tolerance is None:
        found = find_differences(actual, expected, exact=True, name=name)
    else:
        found = find_differences(actual, expected, rtol=tolerance.rtol, atol=tolerance.atol, name=name)
    if not found:
        return None
    bound = "bit-exact" if tolerance is None else f"bound {tolerance}"
    return f"{name} ({bound}): " + format_differences(found[:2], exact=tolerance is None).replace("\n", " | "), found[0]


def _run_route(case: ShardedCase, module: torch.nn.Module, step: int, rank: int, route: str, device, full) -> tuple:
    where = f"step {step} route {route}"
    copy_full_weights_into(module, full)
    with _stage(f"feeding {where} to the sharded module"):
        outputs = outputs_by_key(case.module, module(route_input(case.steps[step][rank], route, case.form, device)))
        if not case.train:
            return outputs, None
        loss_of(case, step, rank, outputs).backward()
        sgd_step_dense_parameters(module, LEARNING_RATE)
    with _stage(f"gathering the tables after {where}"):
        tables = gather_full_weights(module)
    return outputs, tables


@dataclass(frozen=True)
class _At:
    """Where a comparison happens: the case, step and route, whether against the unsharded module, and
    the weights every route starts the step from."""

    case: ShardedCase
    step: int
    route: str
    full: dict[str, torch.Tensor]
    against_unsharded: bool = True


def _compare(report: RankReport, kind: str, where: str, actual: tuple, expected: tuple, tolerances: tuple, at: _At) -> None:
    outputs, tables = actual
    expected_outputs, expected_tables = expected
    output_tolerance, table_tolerance = tolerances
    path = path_of(at.route, at.against_unsharded)
    if sorted(outputs) != sorted(expected_outputs):
        report.problems.append((kind, f"{where}: output keys {sorted(outputs)} vs {sorted(expected_outputs)}"))
        report.divergences.append(Divergence("forward", "embedding output", path, at.step, report.rank,
                                             detail=f"output keys {sorted(outputs)} vs {sorted(expected_outputs)}"))
    for key in sorted(set(outputs) & set(expected_outputs)):
        found = _differences(f"output[{key!r}]", outputs[key], expected_outputs[key], output_tolerance.get(key))
        if found:
            report.problems.append((kind, f"{where}: {found[0]}"))
            report.divergences.append(output_divergence(at.case, at.step, report.rank, path, key, found[1]))
    for table in sorted(expected_tables) if tables is not None else ():
        found = _differences(f"table[{table!r}]", tables[table], expected_tables[table], table_tolerance.get(table))
        if found:
            report.problems.append((kind, f"{where}: after one SGD step {found[0]}"))
            before = at.full[table]  # every route starts the step from the same weights
            report.divergences.append(table_divergence(at.case, at.step, report.rank, path, table, found[1],
                                                       (before, tables[table], expected_tables[table])))


def _count(report: RankReport, case: ShardedCase, outputs: dict[str, Any], tables: dict[str, torch.Tensor] | None) -> None:
    # An EC output's lengths are compared too: a batch of empty rows still compares B lengths per key.
    report.output_elements += sum(v.values().numel() + v.lengths().numel() if case.module == "ec" else v.numel()
                                  for v in outputs.values())
    report.table_elements += sum(t.numel() for t in tables.values()) if tables is not None else 0


def _run_step(case: ShardedCase, modules: dict[str, Any], step: int, rank: int, device, full, report: RankReport) -> None:
    division = gradient_division()
    with _stage(f"computing the unsharded reference of step {step}"):
        expected = reference_step(case, step, rank, device, LEARNING_RATE)
    exact_outputs = {key: None for key in case.keys}
    exact_tables = {table.name: None for table in case.tables}
    tolerances = (
        output_tolerances(case, case.steps[step][rank], full),
        table_tolerances(case, step, LEARNING_RATE, division),
    )
    results = {}
    for route in case.routes:
        module = modules[ROUTE_TORCHREC if route == ROUTE_TORCHREC else ROUTE_KJT]
        results[route] = _run_route(case, module, step, rank, route, device, full)
        _count(report, case, *results[route])
        _compare(report, VS_UNSHARDED, f"step {step} route {route}", results[route], expected, tolerances,
                 _At(case, step, route, full))
    for route in case.routes:
        if route != ROUTE_KJT:
            _compare(report, TD_VS_KJT, f"step {step} route {route} vs route kjt", results[route], results[ROUTE_KJT],
                     (exact_outputs, exact_tables), _At(case, step, route, full, against_unsharded=False))


def report_case_on_rank(case: ShardedCase) -> RankReport:
    """Run the whole case on this rank; every rank reaches the same collectives whatever it finds."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if dist.get_world_size() != case.world_size:
        raise HarnessError(f"case needs world size {case.world_size}, this group has {dist.get_world_size()}")
    if case.ranks_per_host is not None and local_world_size(case.world_size) != case.ranks_per_host:
        # torchrec would resolve the plan's host indexes for other hosts than the case was written for
        # (a case of no stated hosts takes the launch's: a torchrun launch of several hosts draws for them).
        raise HarnessError(f"case stands for {case.hosts.describe()}, this group for hosts of "
                           f"{local_world_size(case.world_size)} ranks")
    device = rank_device(case.device)
    full = {name: weight.to(device) for name, weight in seeded_full_weights(case.tables, case.seed).items()}
    with _stage("sharding the module"):
        modules = {ROUTE_KJT: shard_case(case, device)}
        if ROUTE_TORCHREC in case.routes:
            modules[ROUTE_TORCHREC] = shard_case(case, device)
    report = RankReport(rank)
    with _one_intra_op_thread(device):
        for step in range(len(case.steps)):
            _run_step(case, modules, step, rank, device, full, report)
    return report


def check_case_on_rank(case: ShardedCase) -> dict[str, int]:
    """``report_case_on_rank``, raising ParityError that names step, rank, route, key/table and element."""
    report = report_case_on_rank(case)
    if report.problems:
        shown = "\n  ".join(f"[{kind}] {text}" for kind, text in report.problems[:_SHOWN_PROBLEMS])
        more = len(report.problems) - _SHOWN_PROBLEMS
        raise ParityError(
            f"td-kjt rank {report.rank} of {case.world_size}: {len(report.problems)} difference(s)\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + f"\n  case: {case.describe()}",
            divergence=first_of(report.divergences, case),
        )
    if report.table_elements == 0 and report.output_elements == 0:
        raise HarnessError(f"td-kjt rank {report.rank}: nothing was compared; case: {case.describe()}")
    return {"output_elements": report.output_elements, "table_elements": report.table_elements}
