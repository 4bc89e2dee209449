"""A checkpoint round trip from start to verdict: the unsharded references (in the caller, first), the
run that saves and carries on, the resumed run (possibly on another pool: another world size), then
every comparison of checkpoint_comparison.py, one ParityError listing what differs.

    setup = build_checkpoint_setup(model_fn, plan, batches, save_after=2, reload_plan=other)
    metrics = run_roundtrip(setup, pool_for, tolerance, header)      # pool_for(world_size) -> a pool

Where the comparisons cannot hold, they are left out and the metrics say so (``compared``): with a
warm-up schedule the unsharded reference (constant learning rates) is not an oracle, so the reload
is held to the saved state and the resumed run to the run that carried on; row-wise state converted
to other column blocks is held to its stated conversion, and the training after it is not compared
(neither the reference nor the carried-on run trained with the new blocks).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from paritykit.dist import launched_by_torchrun
from paritykit.engine.checkpoint import PhaseRun, run_phase
from paritykit.engine.checkpoint_comparison import (
    PhaseRecord,
    against_reference,
    as_record,
    assemble_phase,
    labelled,
    raise_if,
    restored_problems,
)
from paritykit.engine.checkpoint_reference import (
    column_blocks,
    expected_after_reload,
    record_slice,
    resumed_reference,
    table_rows,
)
from paritykit.engine.checkpoint_setup import CheckpointSetup
from paritykit.engine.comparison import Tolerance, final_problems
from paritykit.engine.reference import train_reference
from paritykit.engine.training import TrainingRecord
from paritykit.errors import HarnessError
from paritykit.harness.hosts import host_layout
from paritykit.harness.plans import local_world_size
from paritykit.harness.seeding import stable_seed
from paritykit.harness.sharded import gradient_division

CHECKPOINT_DIR_VARIABLE = "PARITYKIT_CHECKPOINT_DIR"


@dataclass
class References:
    """The unsharded model: at the save, trained on every batch of the first run, and resumed."""

    saved: TrainingRecord
    carried: TrainingRecord
    resumed: TrainingRecord


def references(setup: CheckpointSetup, division: bool) -> References:
    before, steps = setup.before, setup.save_after
    saved = train_reference(dataclasses.replace(before, batches=before.batches[:steps]), division=division)
    carried = train_reference(before, division=division) if len(before.batches) > steps else saved
    if setup.carried_on:
        resumed = record_slice(carried, steps, len(carried.outputs), 1)
    else:
        resumed = resumed_reference(before, setup.after, steps, division)
    return References(saved, carried, resumed)


def checkpoint_directory(setup: CheckpointSetup, header: str) -> str:
    """Where the round trip's checkpoint goes: under ``$PARITYKIT_CHECKPOINT_DIR`` (a directory every
    rank reads; a launch over several hosts needs a shared one) or the temporary directory. Under
    torchrun every rank runs this caller code, so the name is one they all derive alike."""
    base = os.environ.get(CHECKPOINT_DIR_VARIABLE) or tempfile.gettempdir()
    run = os.environ.get("TORCHELASTIC_RUN_ID", "launch") if launched_by_torchrun() else str(os.getpid())
    return os.path.join(base, f"paritykit-checkpoint-{stable_seed(run, header, setup.describe()):08x}")


def run_phases(setup: CheckpointSetup, pool_for: Callable[[int], Any], header: str) -> tuple[PhaseRecord, PhaseRecord]:
    """The run that saves (and carries on), then the resumed run, sharing one checkpoint directory."""
    directory = checkpoint_directory(setup, header)
    shutil.rmtree(directory, ignore_errors=True)  # what a crashed earlier run may have left
    os.makedirs(directory, exist_ok=True)
    try:
        saving = PhaseRun(setup.before, directory, setup.recipe, save_after=setup.save_after)
        first = _pool_of_hosts(pool_for, setup.before.world_size, setup.ranks_per_host).call(run_phase, (saving,), case=f"{header}: the run that saves")
        resuming = PhaseRun(setup.after, directory, setup.recipe, restore=True)
        resumed = _pool_of_hosts(pool_for, setup.after.world_size, setup.ranks_per_host).call(run_phase, (resuming,), case=f"{header}: the resumed run")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return assemble_phase(first), assemble_phase(resumed)


def _pool_of_hosts(pool_for: Callable[[int], Any], world_size: int, ranks_per_host: int | None) -> Any:
    """The pool of ``world_size`` ranks, checked to stand for the hosts the plans were resolved for
    (grid and table-row-wise shards follow the pool's LOCAL_WORLD_SIZE, not the plan's)."""
    pool = pool_for(world_size)
    wanted = host_layout(world_size, local_world_size(world_size, ranks_per_host))  # None: as resolve_plan reads it
    have = getattr(pool, "ranks_per_host", None) or world_size
    if have != wanted.ranks_per_host:
        raise HarnessError(f"the plans were resolved for {wanted.describe()}, but the pool of {world_size} ranks stands for "
                           f"{host_layout(world_size, have).describe()}: give ranks_per_host={have} or a pool of that shape")
    return pool


def run_roundtrip(setup: CheckpointSetup, pool_for: Callable[[int], Any], tolerance: Tolerance, header: str) -> dict[str, Any]:
    """ParityError naming the phase, step, rank, state key and element of every difference; else metrics."""
    warm = bool(setup.recipe.warmup)
    refs = None if warm else references(setup, gradient_division())
    first, resumed = run_phases(setup, pool_for, header)
    steps, compared, problems = setup.save_after, [], []
    if refs is not None:
        problems += against_reference(first.steps, refs.carried, tolerance, "the run that saved and carried on")
        problems += labelled(final_problems(as_record(first.saved, refs.saved), refs.saved, tolerance),
                             f"the state saved after step {steps - 1}")
        compared.append("saving run vs unsharded")
    expected_fused, converted = expected_after_reload(first.saved.fused_state, column_blocks(setup.before),
                                                      column_blocks(setup.after), table_rows(setup.before))
    problems += labelled(restored_problems(first.saved, resumed.restored, expected_fused, converted,
                                           tolerance.optimizer_state, setup.same_plan), f"after the reload, before step {steps}")
    compared.append("reloaded vs saved state")
    if refs is not None and not converted:
        problems += against_reference(resumed.steps, refs.resumed, tolerance, "the resumed run", first_step=steps)
        compared.append("resumed run vs unsharded")
    if setup.carried_on and not converted:
        carried = record_slice(first.steps, steps, len(first.steps.outputs), 1)
        bound = Tolerance() if setup.same_plan else tolerance  # Tolerance(): every kind bit-exact
        problems += against_reference(resumed.steps, carried, bound, "the resumed run vs the run that carried on", first_step=steps)
        compared.append("resumed vs carried-on run" + (" (bit-exact)" if setup.same_plan else ""))
    raise_if(problems, f"{header}: the checkpoint round trip differs ({setup.describe()})")
    return {
        "steps": f"{steps}+{len(setup.after.batches)}",
        "world_sizes": f"{setup.before.world_size}->{setup.after.world_size}",
        "restored_tensors": len(resumed.restored.state) + len(resumed.restored.fused_state) + len(resumed.restored.dense_state),
        "compared": "; ".join(compared),
    }
