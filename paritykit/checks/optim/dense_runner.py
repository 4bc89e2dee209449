"""Every case without ranks, by type: its runner and its id."""

from __future__ import annotations

from typing import Any

from paritykit.checks.optim.contract_cases import (ContractCase, SemiSyncCase, ZeroGradCase, run_contract, run_semi_sync,
                                                   run_zero_grad)
from paritykit.checks.optim.dense_cases import KeyedCase, RowWiseCase, ScheduleCase, run_keyed, run_row_wise, run_schedule
from paritykit.checks.optim.fused_module_cases import FusedModuleCase, run_fused_module_case
from paritykit.harness.seeding import stable_seed

RUNNERS = {RowWiseCase: run_row_wise, ScheduleCase: run_schedule, KeyedCase: run_keyed, SemiSyncCase: run_semi_sync,
           ContractCase: run_contract, ZeroGradCase: run_zero_grad, FusedModuleCase: run_fused_module_case}


def is_dense_case(case: Any) -> bool:
    return type(case) in RUNNERS


def dense_case_id(case: Any) -> str:
    if isinstance(case, FusedModuleCase):
        return case.case_id()  # it carries its hash already
    return f"{case.case_id()} #{stable_seed(repr(case)) % 16**8:08x}"


def run_dense_case(case: Any) -> dict[str, Any]:
    return RUNNERS[type(case)](case)
