"""torchrec's collective validation (checks/sharding/validation_cases.py, and DmpOptions.debug_checks):
ranks calling different EBCs are told of the mismatch on every rank; with validation off the same calls
go through and the case fails (it can fail); the debug switches are put back after a call."""

from __future__ import annotations

import os

import pytest

from paritykit.checks.sharding.validation_cases import ValidationCase, run_validation_case
from paritykit.engine.dmp_options import VALIDATE_COLLECTIVES, DmpOptions, torchrec_debug_checks
from paritykit.errors import HarnessError, ParityError


@pytest.mark.world_size(2)
def test_ranks_calling_different_ebcs_are_told_of_the_mismatch(rank_pool):
    assert run_validation_case(ValidationCase(2), rank_pool) == {"ranks": 2, "mismatches_raised": 2}


@pytest.mark.world_size(2)
def test_without_validation_the_mixed_lookups_go_through_and_the_case_fails(rank_pool):
    with pytest.raises(ParityError, match=r"rank 1: looked its batch up in EBC 'second'.*raised nothing"):
        run_validation_case(ValidationCase(2, validate=False), rank_pool)


def test_the_debug_switches_are_put_back_after_a_call():
    from torchrec.distributed import collective_utils, dist_data

    before = (os.environ.get(VALIDATE_COLLECTIVES), collective_utils._INITIALIZED, collective_utils._USE_COLLECTIVE_VALIDATION,
              dist_data._TORCHREC_OVERFLOW_DEBUG)
    with torchrec_debug_checks():
        assert os.environ[VALIDATE_COLLECTIVES] == "1" and not collective_utils._INITIALIZED and dist_data._TORCHREC_OVERFLOW_DEBUG
    assert (os.environ.get(VALIDATE_COLLECTIVES), collective_utils._INITIALIZED, collective_utils._USE_COLLECTIVE_VALIDATION,
            dist_data._TORCHREC_OVERFLOW_DEBUG) == before


def test_a_torchrec_without_collective_validation_is_a_harness_error(monkeypatch):
    from torchrec.distributed import collective_utils

    monkeypatch.delattr(collective_utils, "validate_collectives_enabled")
    with pytest.raises(HarnessError, match="debug_checks: this torchrec has no collective validation"):
        DmpOptions(debug_checks=True).check(3, "sgd")


@pytest.mark.world_size(2)
def test_the_validation_and_tracker_cases_on_a_torchrec_without_them_are_harness_errors(rank_pool, monkeypatch):
    from torchrec.distributed import collective_utils
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from paritykit.checks.sharding.delta_tracker_cases import run_tracker_case, tracker_cases

    monkeypatch.delattr(collective_utils, "validate_collectives_enabled")
    monkeypatch.delattr(DistributedModelParallel, "init_torchrec_delta_tracker")
    with pytest.raises(HarnessError, match="no TORCHREC_VALIDATE_COLLECTIVES"):
        run_validation_case(ValidationCase(2), rank_pool)
    with pytest.raises(HarnessError, match="no init_torchrec_delta_tracker"):
        run_tracker_case(tracker_cases(2)[0], rank_pool)
