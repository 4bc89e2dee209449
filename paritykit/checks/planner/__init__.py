"""planner: models planned by torchrec's EmbeddingShardingPlanner, as users plan them.

The plan must keep the user's ParameterConstraints and each sharding type's meaning (plan_rules.py,
written out independently of torchrec's planner), and the model sharded by it must train like the
unsharded module (the engine). docs/planner.md.

cases.py, draws.py, pinned.py   the cases: tables with constraints, hosts, batches
planning.py                     the call to torchrec's planner
plan_rules.py                   what a plan must be (the oracle of the plan itself)
report_rules.py                 what the planner reports of its plan (stats table, storage estimates)
report_summary.py               the stats table's critical path and top tables
estimate_rules.py               what every option's perf and storage estimates must mean
estimate_floors.py              a shard's floors and ceilings (bytes moved at the topology's bandwidths)
capacity.py, spread_case.py     near a GPU's memory; equal tables over hosts
report_case.py                  the report on eight column-wise tables and a dense layer
proposer_case.py                the proposers, and the planner's choice among their plans
refusal_case.py                 the planner's refusals and what their messages owe
memory_balance_case.py          the memory-balanced partitioner against its tolerance
case_runner.py, matrix.py       one case, and the gate entry
plants.py                       planted bugs in torchrec's planner
"""

from paritykit.checks.planner.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.planner.plants", run=run_matrix,
                   oracle="the user's constraints and each sharding type's shard arithmetic written out "
                          "(plan_rules.py), and the unsharded module trained alongside")

__all__ = ["CHECK"]
