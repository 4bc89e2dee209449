"""Feature-processed EBCs sharded by DMP against the unsharded FP-EBC: the pinned cases on one and two
ranks, the sharding types they cover, and the case's own checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paritykit.checks.sharding.fp_cases import FpCase, fp_cases, fp_plans, fp_setup, initial_problems, run_fp_case
from paritykit.checks.sharding.fp_models import FORMS, build_wrapped_fp_ebc, max_lengths, position_weight_key
from paritykit.checks.sharding.fp_cases import TABLES
from paritykit.errors import HarnessError


@pytest.mark.slow  # the gate runs these on one rank too; the default suite keeps two ranks
@pytest.mark.world_size(1)
@pytest.mark.parametrize("index", range(len(fp_cases(1))))
def test_every_fp_case_matches_the_unsharded_fp_ebc_on_one_rank(rank_pool, index):
    case = fp_cases(1)[index]
    metrics = run_fp_case(case, rank_pool)
    assert metrics["state_tensors"] == 6 and metrics["plan_shape"].startswith(f"fp/{case.kind}/{case.form}/ws1")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("index", range(len(fp_cases(2))))
def test_every_fp_case_matches_the_unsharded_fp_ebc_on_two_ranks(rank_pool, index):
    case = fp_cases(2)[index]
    metrics = run_fp_case(case, rank_pool)
    if case.kind == "train":
        # Three tables and three position-weight vectors, every step, on both ranks.
        assert (metrics["steps"], metrics["ranks"], metrics["position_weights"]) == (3, 2, 3)
    else:
        assert metrics["ranks"] == 2


@pytest.mark.parametrize("world_size", [1, 2])
def test_both_forms_are_trained_under_every_sharding_type_the_fp_sharder_accepts_on_cpu(world_size):
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    offered = set(FeatureProcessedEmbeddingBagCollectionSharder().sharding_types("cpu"))
    for form in FORMS:
        trained = {entry[0] for case in fp_cases(world_size) if case.kind == "train" and case.form == form
                   for entry in case.plan.values()}
        assert trained == offered, f"{form}: trained {sorted(trained)}, the sharder offers {sorted(offered)}"
    kinds = {(case.kind, case.meta_model) for case in fp_cases(world_size)}
    assert kinds == {("train", False), ("train", True), ("meta-init", False)}


@pytest.mark.parametrize("form", FORMS)
def test_the_seeded_model_has_position_weights_far_from_their_reset_value(form):
    model = build_wrapped_fp_ebc(TABLES, form, seed=3)
    state = model.state_dict()
    for feature, length in max_lengths(TABLES, 3).items():
        weights = state[f"fp.{position_weight_key(form, feature)}"]
        assert weights.shape == (length,) and (weights - 1.0).abs().min() > 0 and weights.unique().numel() == length


def test_position_weights_other_than_one_are_an_initialisation_problem():
    fresh = build_wrapped_fp_ebc(TABLES, "collection", seed=0, seeded=False).state_dict()
    assert initial_problems(dict(fresh), fresh) == []
    moved = dict(fresh)
    key = f"fp.{position_weight_key('collection', 'f1')}"
    moved[key] = torch.full_like(fresh[key], 0.5)
    assert any("position weights after DMP's init" in p for p in initial_problems(moved, fresh))
    table = "fp._embedding_bag_collection.embedding_bags.t0.weight"
    assert any("leaves" in p for p in initial_problems({**fresh, table: fresh[table] + 10.0}, fresh))


def test_a_wrong_kind_or_form_is_a_harness_error():
    with pytest.raises(HarnessError, match="kind 'grad'"):
        fp_setup(dataclasses.replace(fp_cases(2)[0], kind="grad"))
    with pytest.raises(HarnessError, match="form 'list'"):
        fp_setup(FpCase("train", "list", 2, fp_plans(2)[0]))


@pytest.mark.world_size(2)
def test_the_fp_ebc_as_the_whole_model_fails_as_its_known_issue_says(rank_pool):
    from paritykit.checks.known_issues import active_issues
    from paritykit.checks.results import CaseResult
    from paritykit.checks.sharding.fp_known_broken import RULES, known_broken_fp_cases
    from paritykit.errors import ParityError
    from paritykit.harness.versions import installed_versions

    for rule in RULES:
        case_id, body = known_broken_fp_cases(2)[rule]
        with pytest.raises(ParityError, match="position_weights"):
            body(rank_pool)
        listed = [issue for issue in active_issues() if issue.matches(CaseResult("sharding", case_id, "fail"))]
        assert [issue.standing(installed_versions()) for issue in listed] == ["applies"]
