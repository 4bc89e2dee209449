"""A user's failing assertion names the known torchrec issue its configuration matches (with its
versions and what to do instead), says where the numbers first went apart, and shrinks the
configuration to the smallest one that still fails; the known issues' configurations are
registered by their checks and agree with known_issues.toml."""

import functools
import sys
from pathlib import Path

import pytest
import torch
from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

import paritykit
from paritykit.checks import known_configurations, known_issues
from paritykit.harness.tables import TableSpec, build_ebc, kjt_from_rows

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "downstream"))
from recsys_model import VOCAB, RankingModel  # noqa: E402 - the downstream example's model

ISSUE = "ebc-row-wise-mean-beside-other-placements"


def ranking_model() -> RankingModel:
    return RankingModel(seed=5)


def kjt_batches(steps: int = 2, world_size: int = 2, batch_size: int = 3):
    source = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world_size):
            lengths = torch.randint(1, 4, (len(VOCAB) * batch_size,), generator=source)
            chunks = torch.split(lengths, batch_size)
            values = torch.cat([torch.randint(0, rows, (int(c.sum()),), generator=source) for rows, c in zip(VOCAB.values(), chunks)])
            step.append(paritykit_kjt(list(VOCAB), values, lengths))
        out.append(step)
    return out


def paritykit_kjt(keys, values, lengths):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


@pytest.mark.world_size(2)
def test_a_row_wise_mean_table_beside_column_and_table_wise_ones_names_the_known_issue_and_what_to_do(rank_pool):
    # The downstream model's MEAN-pooled "history" table row-wise, beside a column-wise and a table-wise table.
    plan = {"history": row_wise(), "tags": column_wise(ranks=[1, 0]), "ads": table_wise(rank=1)}
    with pytest.raises(paritykit.ParityError) as info:
        paritykit.assert_sharded_matches_unsharded(ranking_model, plan, kjt_batches(), pool=rank_pool, shrink=False)
    text, entry = str(info.value), next(i for i in known_issues.load() if i.id == ISSUE)
    assert text.startswith("ranking_model sharded over 2 ranks: sharded training differs from the unsharded reference\n")
    assert f"known torchrec issue {ISSUE!r} (listed for torchrec >=1.8,<1.10; installed torchrec " in text
    assert f"  what to do instead: {entry.workaround}" in text
    assert f"paritykit repro {ISSUE}" in text
    assert info.value.known_issues == [ISSUE]
    divergence = info.value.divergence
    assert (divergence.stage, divergence.what, divergence.step, divergence.module) == ("forward", "embedding output", 0, "sparse")
    assert "first divergence: step 0, forward: embedding output of module 'sparse'" in text


@pytest.mark.world_size(2)
def test_the_workaround_of_making_every_table_row_wise_trains_like_the_unsharded_model(rank_pool):
    plan = {"history": row_wise(), "tags": row_wise(), "ads": row_wise()}
    compared = paritykit.assert_sharded_matches_unsharded(ranking_model, plan, kjt_batches(), pool=rank_pool, shrink=False)
    assert compared["steps"] == 2


@pytest.mark.world_size(2)
def test_a_failure_that_matches_no_known_issue_names_none(rank_pool):
    from paritykit.checks import load_plants
    from paritykit.harness import plants

    load_plants(["sharding"])
    plan = {"history": table_wise(rank=0), "tags": column_wise(ranks=[1, 0]), "ads": table_wise(rank=1)}
    with plants.applied(["pooled-all-to-all-backward-not-divided"]), pytest.raises(paritykit.ParityError) as info:
        paritykit.assert_sharded_matches_unsharded(ranking_model, plan, kjt_batches(), pool=rank_pool, shrink=False)
    assert "known torchrec issue" not in str(info.value) and not getattr(info.value, "known_issues", [])
    assert (info.value.divergence.phase, info.value.divergence.what) == ("training step", "table gradient or update")


TABLES = (TableSpec("mean_rows", 12, 4, ("f0",), "MEAN"), TableSpec("sums", 8, 4, ("f1",), "SUM"))
model_with_two_tables = functools.partial(build_ebc, TABLES, seed=3)


@pytest.mark.world_size(2)
def test_a_failing_plan_is_shrunk_to_the_smallest_configuration_that_fails_the_same_way(rank_pool):
    batches = [[kjt_from_rows(("f0", "f1"), {"f0": [[1, 2], [3]], "f1": [[rank, 4], [5]]}) for rank in range(2)] for _ in range(2)]
    plan = {"mean_rows": row_wise(), "sums": column_wise(ranks=[1, 0])}
    with pytest.raises(paritykit.ParityError) as info:
        paritykit.assert_sharded_matches_unsharded(model_with_two_tables, plan, batches, pool=rank_pool)
    shrunk = info.value.shrunk
    # The MEAN table must stay row-wise beside another placement to fail; the rest goes.
    assert (shrunk.world_size, shrunk.steps, shrunk.samples) == (1, 1, 1)
    assert shrunk.placements == {"": {"mean_rows": ("row_wise",), "sums": ("table_wise", 0)}}
    assert shrunk.dropped == frozenset({("", "mean_rows")})
    assert "smallest failing configuration found by shrinking" in str(info.value)
    assert "1 rank(s), 1 of 2 step(s), plan (model): {'mean_rows': row_wise(), 'sums': table_wise(0)}" in str(info.value)


def test_every_registered_configuration_names_an_entry_and_its_reproduction_matches_it():
    registered = known_configurations.registered()
    # Entries not registered are defects a ShardedConfiguration cannot state (an optimizer's
    # hyper-parameters, a pipeline, a checkpoint, an op): the gate matches them by case name, and
    # their standalone scripts are hand-written (tests/test_repro.py).
    entries = {issue.id: issue for issue in known_issues.load() if issue.id}
    assert set(registered) <= set(entries)
    for issue_id, known in registered.items():
        assert known.check == entries[issue_id].check
        reproduction = known_configurations.reproduction(issue_id)
        assert known.applies(reproduction), issue_id
        assert issue_id in [m.issue.id for m in known_configurations.matching(reproduction, check=known.check)]


def test_a_configuration_torchrec_computes_right_matches_no_known_issue():
    from paritykit.checks.sharding.cases import configuration_of
    from paritykit.checks.sharding.pinned import pinned_cases

    for case in pinned_cases(2):
        assert known_configurations.matching(configuration_of(case)) == [], case.describe()


def test_a_configuration_round_trips_through_json():
    from paritykit.harness.configuration import ShardedConfiguration

    for issue_id in known_configurations.registered():
        config = known_configurations.reproduction(issue_id)
        assert ShardedConfiguration.from_json(config.to_json()) == config
