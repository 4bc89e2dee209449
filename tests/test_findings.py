"""Findings: failures grouped by root cause across checks, each with its first divergence located.

Unit tests of the grouping, the report's findings section and report.json's, and of the first
divergence of two training records; the tests that run ranks under planted bugs are in
test_findings_plants.py.
"""

import json

import pytest
import torch

from paritykit.checks.results import CaseResult
from paritykit.engine.comparison import Where, first_divergence
from paritykit.engine.divergence import Placements, TablePlace, step_detail
from paritykit.engine.tolerances import default_tolerance
from paritykit.engine.training import TrainingRecord
from paritykit.errors import Divergence, ParityError
from paritykit.gate.findings import group
from paritykit.gate.report import JSON_SCHEMA_VERSION, Report, render_json, render_markdown, report_from_json


def failing(check, case_id, divergence=None, configuration=None):
    return CaseResult(check, case_id, "fail", replay=f"paritykit gate --check {check} --case x", message=f"{case_id} differs",
                      divergence=divergence.to_dict() if divergence else None, configuration=configuration)


def table_step(traits, table="t0", path="sharded vs unsharded", stage="backward or update"):
    return Divergence(stage, "table gradient or update", path, 0, table=table, traits=traits)


ROW_WISE_SUM = ("kernel=fused", "module=ebc", "pooling=SUM", "sharding=row_wise")
ROW_WISE_MEAN = ("kernel=fused", "module=ebc", "pooling=MEAN", "sharding=row_wise")
TABLE_WISE_SUM = ("kernel=fused", "module=ebc", "pooling=SUM", "sharding=table_wise")


def test_one_cause_in_three_checks_is_one_finding_with_the_traits_every_case_shares():
    cases = [failing("td-kjt", "a", table_step(ROW_WISE_SUM, "t2")),
             failing("sharding", "b", table_step(ROW_WISE_MEAN, "t0", stage="backward")),
             failing("pipeline", "c", table_step(ROW_WISE_SUM, "user"))]
    findings = group(cases)
    assert len(findings) == 1
    assert findings[0].checks() == {"td-kjt": 1, "sharding": 1, "pipeline": 1}
    assert findings[0].traits == ("kernel=fused", "module=ebc", "sharding=row_wise")
    assert "tables with kernel=fused, module=ebc, sharding=row_wise" in findings[0].what_differs()


def test_cases_split_by_the_trait_most_of_them_share_when_nothing_is_common_to_all():
    cases = [failing("sharding", "a", table_step(("pooling=MEAN", "sharding=row_wise"))),
             failing("sharding", "b", table_step(("pooling=MEAN", "sharding=table_wise"))),
             failing("td-kjt", "c", table_step(("pooling=MEAN", "sharding=column_wise"))),
             failing("td-kjt", "d", table_step(("pooling=SUM", "sharding=data_parallel")))]
    findings = group(cases)
    assert [(len(f.cases), f.traits) for f in findings] == [(3, ("pooling=MEAN",)), (1, ("pooling=SUM", "sharding=data_parallel"))]


def test_other_phases_paths_and_crash_sites_are_other_findings():
    forward = Divergence("forward", "embedding output", "sharded vs unsharded", 0, traits=ROW_WISE_SUM)
    td = Divergence("forward", "embedding output", "TensorDict vs KJT", 0, traits=ROW_WISE_SUM)
    crash_a = Divergence("crash", "IndexError", module="torchrec.distributed.grid_sharding.f")
    crash_b = Divergence("crash", "IndexError", module="torchrec.distributed.rw_sharding.g")
    cases = [failing("sharding", "a", forward), failing("td-kjt", "b", td), failing("sharding", "c", crash_a),
             failing("sharding", "d", crash_b), failing("sharding", "e", table_step(ROW_WISE_SUM))]
    assert len(group(cases)) == 5


def test_a_failure_its_check_did_not_locate_is_a_finding_of_its_own_message():
    findings = group([failing("sync", "x"), failing("sync", "y")])
    assert len(findings) == 2 and findings[0].divergence.stage == "unlocated"


def test_the_smallest_case_is_the_one_with_the_smallest_configuration():
    from paritykit.harness.configuration import RankBatch, ShardedConfiguration
    from paritykit.harness.tables import TableSpec

    def config(world_size, steps):
        batch = RankBatch((("f0", ((1,),)),))
        return ShardedConfiguration("ebc", world_size, (TableSpec("t0", 4, 4, ("f0",)),), {"t0": ("row_wise",)},
                                    steps=tuple((batch,) * world_size for _ in range(steps))).to_json()

    cases = [failing("sharding", "big", table_step(ROW_WISE_SUM), config(2, 3)),
             failing("td-kjt", "none", table_step(ROW_WISE_SUM)),
             failing("pipeline", "small", table_step(ROW_WISE_SUM), config(1, 1))]
    assert group(cases)[0].smallest.case_id == "small"


def report_with_findings():
    cases = [failing("sharding", "rw-1", table_step(ROW_WISE_SUM)), failing("td-kjt", "rw-2", table_step(ROW_WISE_SUM)),
             failing("sharding", "crash", Divergence("crash", "IndexError", module="torchrec.x.f")),
             CaseResult("sharding", "ok", "pass")]
    return Report(cases=cases)


def test_report_md_opens_with_one_line_per_finding_after_the_verdict():
    report = report_with_findings()
    report.scripts["F1"] = "repro/F1.py"
    text = render_markdown(report)
    lines = text.splitlines()
    assert lines[2].startswith("**FAIL**") and lines[4] == "## Findings (2)"
    assert lines[6].startswith("- **F1: training step: table gradient or update of tables with kernel=fused")
    assert "2 case(s) (sharding 1, td-kjt 1)" in lines[6] and "script [repro/F1.py](repro/F1.py)" in lines[6]
    assert "replay `paritykit gate --check sharding --case x`" in lines[6]
    assert lines[7].startswith("- **F2: torchrec raises IndexError in torchrec.x.f")
    assert text.index("## Findings (2)") < text.index("## Summary per check") < text.index("## Failures (3)")


def test_report_json_carries_the_findings_and_each_case_its_divergence_under_schema_2():
    data = json.loads(render_json(report_with_findings()))
    assert data["schema_version"] == JSON_SCHEMA_VERSION == 2
    assert [f["id"] for f in data["findings"]] == ["F1", "F2"]
    assert data["findings"][0]["cases"] == [c["short_id"] for c in data["cases"][:2]]
    assert data["findings"][0]["first_divergence"]["stage"] == "backward or update"
    assert data["cases"][0]["divergence"]["traits"] == list(ROW_WISE_SUM)
    assert all(key in data["cases"][0] for key in ("check", "case_id", "status", "replay", "message", "metrics", "short_id"))


def test_a_schema_1_report_is_still_read():
    data = json.loads(render_json(report_with_findings()))
    data["schema_version"] = 1
    for case in data["cases"]:
        case.pop("divergence"), case.pop("configuration")
    assert [c.case_id for c in report_from_json(json.dumps(data)).cases] == ["rw-1", "rw-2", "crash", "ok"]


def test_parity_error_keeps_its_divergence_and_message_through_pickling():
    import pickle

    error = ParityError("step 0 differs", divergence=table_step(ROW_WISE_SUM), configuration={"module": "ebc"})
    error.known_issues = ["x"]
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.divergence, copy.configuration, copy.known_issues) == (
        "step 0 differs", error.divergence, {"module": "ebc"}, ["x"])


# ---------------------------------------------------------------- locating the first divergence


def record(outputs, tables_per_step, momentum=None):
    steps = len(outputs)
    return TrainingRecord(
        outputs=[[o] for o in outputs], losses=[[o.sum()] for o in outputs],
        embeddings=[[{"ebc": {"by_key": {"f0": o}, "key_order": ["f0"]}}] for o in outputs],
        state=tables_per_step[-1], step_states=[dict(t, **(momentum or [{}] * steps)[i]) for i, t in enumerate(tables_per_step)])


PLACES = Placements({"ebc.embedding_bags.t0.weight": TablePlace("ebc", "t0", "ebc", "row_wise", "fused", "SUM",
                                                                (((0, 0), (2, 2), 0), ((2, 0), (2, 2), 1)))},
                    {("ebc", "f0"): TablePlace("ebc", "t0", "ebc", "row_wise", "fused", "SUM")})
KEY = "ebc.embedding_bags.t0.weight"


def test_a_wrong_lookup_is_a_forward_divergence_at_its_step_module_feature_and_table():
    initial = {KEY: torch.zeros(4, 2)}
    expected = record([torch.ones(2, 2)], [{KEY: torch.ones(4, 2)}])
    actual = record([torch.tensor([[1.0, 1.0], [1.0, 3.0]])], [{KEY: torch.ones(4, 2)}])
    found = first_divergence(actual, expected, default_tolerance(), Where(placements=PLACES, initial_state=initial))
    assert (found.stage, found.what, found.step, found.rank, found.module, found.table, found.feature, found.element) == (
        "forward", "embedding output", 0, 0, "ebc", "t0", "f0", "[1, 1]")
    assert "sharding=row_wise" in found.traits


def test_tables_that_move_twice_as_far_after_equal_outputs_are_a_scaled_step_in_the_shard_that_holds_them():
    initial = {KEY: torch.zeros(4, 2)}
    step = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, -0.25], [0.0, 1.0]])
    expected = record([torch.ones(2, 2)], [{KEY: step}])
    actual = record([torch.ones(2, 2)], [{KEY: 2 * step}])
    found = first_divergence(actual, expected, default_tolerance(), Where(placements=PLACES, initial_state=initial, sgd=True))
    assert (found.stage, found.what, found.step, found.table, found.shard) == (
        "backward or update", "table gradient or update", 0, "t0", "rows 2-3, columns 0-1 on rank 1")
    assert "the sharded step is 2 x the unsharded step" in found.detail


def test_a_differing_gradient_accumulator_names_the_backward():
    initial = {KEY: torch.zeros(4, 2)}
    tables = [{KEY: torch.ones(4, 2)}]
    expected = record([torch.ones(2, 2)], tables, [{f"{KEY}/t0.momentum1": torch.ones(4)}])
    actual = record([torch.ones(2, 2)], tables, [{f"{KEY}/t0.momentum1": 4 * torch.ones(4)}])
    found = first_divergence(actual, expected, default_tolerance(), Where(placements=PLACES, initial_state=initial))
    assert (found.stage, found.table) == ("backward", "t0")


@pytest.mark.parametrize("sharded, stage, says", [
    (torch.tensor([[1.0], [0.0], [3.0]]), "backward", "moves other rows"),
    (torch.tensor([[1.0], [3.0], [0.0]]), "backward", "not a multiple"),
    (torch.tensor([[-2.0], [-4.0], [0.0]]), "backward or update", "-2 x the unsharded step"),
])
def test_step_detail_tells_a_scaled_step_from_other_rows_and_another_direction(sharded, stage, says):
    found_stage, text = step_detail(torch.zeros(3, 1), sharded, torch.tensor([[1.0], [2.0], [0.0]]), sgd=True)
    assert found_stage == stage and says in text


def test_a_sync_budget_exceeded_is_a_divergence_of_its_own_kind_naming_the_call_sites():
    from paritykit.sync import SyncEvent, SyncRecord, check_budget

    record = SyncRecord("cpu", [SyncEvent("item", "torchrec.sparse.jagged_tensor._maybe_compute_length_per_key", None, None)])
    with pytest.raises(ParityError) as info:
        check_budget(record, 0, what="EBC forward")
    divergence = info.value.divergence
    assert (divergence.stage, divergence.path) == ("syncs", "sync budget")
    assert divergence.detail == "EBC forward: 1 syncs, budget 0, at torchrec.sparse.jagged_tensor._maybe_compute_length_per_key"
    assert str(info.value).startswith("sync budget exceeded in EBC forward: 1 synchronization(s), budget 0")


def test_a_plain_embedding_bag_sharded_by_dmp_is_located_with_its_placement():
    # DMP shards a plain nn.EmbeddingBag as one table, "weight": its divergences carry the placement's
    # traits, so they group with the same cause's divergences in EBC/EC cases.
    from types import SimpleNamespace

    from paritykit.engine.divergence import Placements

    model = torch.nn.Module()
    model.bag = torch.nn.EmbeddingBag(6, 4, mode="mean")
    model.lookup = torch.nn.Embedding(6, 4)
    plan = SimpleNamespace(plan={"bag": {"weight": SimpleNamespace(sharding_type="row_wise", compute_kernel="fused")}})
    places = Placements.of(model, plan)
    place = places.for_output("bag", "")
    assert (place.table, place.kind, place.placement()) == ("weight", "embedding_bag", "row_wise MEAN fused")
    assert places.for_state("bag.weight") is place
    assert {"sharding=row_wise", "kernel=fused", "pooling=MEAN"} <= place.traits()
    assert places.for_output("lookup", "") is None  # not in the plan: not sharded, nothing to locate
