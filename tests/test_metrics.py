"""The metrics check: its formulas against values worked out by hand, its window rules, its planted
bugs (each first shown to change what torchrec computes, then caught by the self-test), and its
known-broken reproduction judged as a known issue."""

from __future__ import annotations

import dataclasses
import math

import pytest

from paritykit.checks import known_issues
from paritykit.checks.metrics import reference, reference_sessions
from paritykit.checks.metrics.cases import TASK_NAMES, _compare, run_metric_case, torchrec_report
from paritykit.checks.metrics.formulas import value
from paritykit.checks.metrics.known_broken import KNOWN_BROKEN, KNOWN_BROKEN_ON_RANKS
from paritykit.checks.metrics.pinned import pinned, pinned_on_ranks
from paritykit.checks.metrics.specs import MetricSpec
from paritykit.checks.runner import GateConfig
from paritykit.errors import ParityError
from paritykit.gate.selftest import run_clean, run_plant
from paritykit.harness import plants
from paritykit.harness.versions import installed_versions

METRICS_PLANTS = sorted(name for name, plant in plants.PLANTS.items() if plant.check == "metrics")
SELFTEST = GateConfig(device="cpu", world_sizes=(1,), examples=1, seed=0, shrink=False)
# Two positives (weights 1 and 3) predicted 0.8 and 0.4, one negative (weight 2) predicted 0.6.
SAMPLES = [(0.8, 1.0, 1.0), (0.4, 1.0, 3.0), (0.6, 0.0, 2.0)]


def test_formulas_by_hand():
    assert reference.ctr(SAMPLES) == pytest.approx(4 / 6)
    assert reference.calibration(SAMPLES) == pytest.approx((0.8 + 1.2 + 1.2) / 4)
    assert reference.mse(SAMPLES) == pytest.approx((0.04 + 3 * 0.36 + 2 * 0.36) / 6)
    assert reference.mae(SAMPLES) == pytest.approx((0.2 + 3 * 0.6 + 2 * 0.6) / 6)
    # Predicted positive: 0.8 (right), 0.6 (wrong); negative: 0.4 (wrong).
    assert reference.accuracy(SAMPLES) == pytest.approx(1 / 6)
    assert reference.precision(SAMPLES) == pytest.approx(1 / 3)
    assert reference.recall(SAMPLES) == pytest.approx(1 / 4)
    # The positive at 0.8 outranks the negative, the one at 0.4 does not: (1*2) / (4*2).
    assert reference.auc(SAMPLES) == pytest.approx(0.25)
    cross_entropy = -(math.log2(0.8) + 3 * math.log2(0.4) + 2 * math.log2(0.4))
    entropy = -(4 * math.log2(4 / 6) + 2 * math.log2(2 / 6))
    assert reference.ne(SAMPLES) == pytest.approx(cross_entropy / entropy)
    assert reference.logloss(SAMPLES) == pytest.approx(cross_entropy / 6)
    assert reference.ne_positive(SAMPLES) == pytest.approx(-(math.log2(0.8) + 3 * math.log2(0.4)) / entropy)
    # The constant prediction 1 errs only on the negative: 2 * 1 / 6.
    assert reference.nmse(SAMPLES) == pytest.approx(reference.mse(SAMPLES) / (2 / 6))
    assert reference.nrmse(SAMPLES) == pytest.approx(math.sqrt(reference.mse(SAMPLES) / (2 / 6)))
    # The weighted mean prediction (0.8 + 1.2 + 1.2) / 6.
    mean = 3.2 / 6
    assert reference.cali_free_ne(SAMPLES) == pytest.approx(cross_entropy / -(4 * math.log2(mean) + 2 * math.log2(1 - mean)))
    assert reference.weighted_avg(SAMPLES) == reference.prediction_average(SAMPLES) == pytest.approx(mean)
    assert reference.label_average(SAMPLES) == pytest.approx(4 / 6)
    # Thresholds 0.8 (precision 1, recall 1/4), 0.6 (recall unchanged), 0.4 (precision 4/6, recall 1).
    assert reference.auprc(SAMPLES) == pytest.approx(1 / 4 * 1 + 3 / 4 * 4 / 6)


def test_the_newer_formulas_by_hand():
    # Recalibrated for k = 0.5: 0.8 -> 0.8 / (0.8 + 0.2 / 0.5) = 2/3.
    assert reference.recalibrated(SAMPLES, 0.5)[0][0] == pytest.approx(2 / 3)
    # Ranked by prediction 0.4 (l 1), 0.6 (l 0), 0.8 (l 1): one pair against its labels (0.4 < 0.6, 1 > 0) of three.
    assert reference.rauc(SAMPLES) == pytest.approx(1 - 1 / 3)
    # One batch of three: pairs (0.8, 0.4) labels tied, predictions not: no; (0.8, 0.6) alike: 1*2; (0.4, 0.6) not:
    # 2 / (1*3 + 1*2 + 3*2). Two batches of the first two samples and the third: the pair (0.8, 0.4) alone, 0.
    assert reference.xauc(SAMPLES, 3) == pytest.approx(2 / 11)
    assert reference.xauc(SAMPLES, 2) == 0.0
    assert reference.num_missing_labels(SAMPLES + [(0.5, float("nan"), 2.5)]) == 2.5
    # One session: by prediction the labels are 1, 0, 1 (DCG 1 + 1/2), ideal 1, 1, 0 (DCG 1 + 1/log2 3); the largest
    # weight 3. Sessions [0.8] (its own ideal: 1 - 1, times 1) and [0.4 (l 1), 0.6 (l 0)] (by prediction 0, 1: DCG
    # 1/log2 3, ideal 1; times 3), over two sessions.
    defaults = {}
    assert reference_sessions.ndcg(SAMPLES, 3, (7, 7, 7), False, defaults) == pytest.approx((1 - 1.5 / (1 + 1 / math.log2(3))) * 3)
    assert reference_sessions.ndcg(SAMPLES, 3, (1, 2, 2), False, defaults) == pytest.approx((1 - 1 / math.log2(3)) * 3 / 2)
    # The session of one dropped on request; a negative task ranks 1 - p against 1 - l: 0.6 (l 0), 0.4 (l 1), 0.2 (l 0).
    assert reference_sessions.ndcg(SAMPLES, 3, (1, 2, 2), False, {"remove_single_length_sessions": True}) == pytest.approx(
        (1 - 1 / math.log2(3)) * 3)
    assert reference_sessions.ndcg(SAMPLES, 3, (7, 7, 7), True, defaults) == pytest.approx((1 - 1 / math.log2(3)) * 3)
    # The tensor 1 - p: (0.2 * 1 + 0.6 * 3 + 0.4 * 2) / 6 by the weights, (0.2 + 0.6 + 0.4) / 3 plain.
    assert reference.tensor_weighted_avg(SAMPLES, True) == pytest.approx(2.8 / 6)
    assert reference.tensor_weighted_avg(SAMPLES, False) == pytest.approx(1.2 / 3)
    # Codes of three labels (bit i: label i): predicted 5 = {0, 2} against 3 = {0, 1} (weight 1), 1 = {0} against 0 (weight
    # 2), 6 = {1, 2} against 6 (weight 1). Label 0 predicted twice, right once (1 of 3), label 1 once, right (1), label 2
    # twice, right once (1 of 2).
    codes = [(5.0, 3.0, 1.0), (1.0, 0.0, 2.0), (6.0, 6.0, 1.0)]
    assert [reference.multi_label_precision(codes, i) for i in range(3)] == pytest.approx([1 / 3, 1.0, 0.5])
    # Three classes: order 0 is (0, 1, 2), order 3 is (1, 2, 0) (lexicographic), order 5 is (2, 1, 0). Labels 2 (weight 1,
    # order 0: third), 1 (weight 2, order 3: first), 0 (weight 1, order 5: third): recall at 1 is 2/4, at 2 still 2/4, at 3 1.
    assert reference.class_ranking(3.0, 3) == (1, 2, 0) and reference.class_scores(3.0, 3) == [0.25, 0.75, 0.5]
    ranked = [(0.0, 2.0, 1.0), (3.0, 1.0, 2.0), (5.0, 0.0, 1.0)]
    assert [reference.multiclass_recall(ranked, k, 3) for k in (1, 2, 3)] == pytest.approx([0.5, 0.5, 1.0])
    # Tied predictions of unequal labels: the order is the sort's, so undefined.
    assert reference_sessions.ndcg([(0.5, 1.0, 1.0), (0.5, 0.0, 1.0)], 2, (0, 0), False, defaults) is None


def test_segmented_ne_compares_each_group_over_its_own_samples():
    # Pinned: keys (2, 0, 2) over three groups, group 1 holds no sample (nothing to compare there).
    spec = pinned("segmented_ne")[0]
    report = _torchrec_report(spec)
    first = [s for batch in spec.batches for s in batch[0]]
    group_2 = [s for i, s in enumerate(first) if i % 3 != 1]
    assert report["segmented_ne-task_a|lifetime_segmented_ne_2"] == pytest.approx(reference.ne(group_2), rel=1e-5)
    assert report["segmented_ne-task_a|lifetime_logloss_2"] == pytest.approx(reference.logloss(group_2), rel=1e-5)
    assert run_metric_case(spec)["compared"] > 0


def test_grouped_metrics_average_each_groups_value_and_a_report_over_all_samples_fails():
    # Groups 0: (0.8 pos, 0.6 neg) ranked right, AUC 1; 1: (0.4 pos) alone, 0.5 (no pair): mean 0.75. RAUC of a group
    # of one sample is undefined (no pair), so the grouped RAUC is.
    keyed = [(*sample, key) for sample, key in zip(SAMPLES, (0, 1, 0))]
    assert reference.grouped(reference.auc, keyed) == pytest.approx(0.75)
    assert reference.grouped(lambda samples: value("rauc", samples), keyed) is None
    spec = pinned("grouped_auc")[0]
    assert run_metric_case(spec)["compared"] > 0
    report = dict(_torchrec_report(spec))
    for task in TASK_NAMES:  # the AUC of every sample reported as the groups' mean
        report[f"auc-{task}|window_grouped_auc"] = report[f"auc-{task}|window_auc"]
    with pytest.raises(ParityError, match="grouped_auc"):
        _compare(spec, report, "rank 0")


def test_an_update_that_writes_to_its_inputs_fails_the_case(monkeypatch):
    from torchrec.metrics.ctr import CTRMetricComputation

    original = CTRMetricComputation.update

    def writes(self, *, predictions, labels, weights, **kwargs):
        labels.mul_(0.5)
        original(self, predictions=predictions, labels=labels, weights=weights, **kwargs)

    monkeypatch.setattr(CTRMetricComputation, "update", writes)
    with pytest.raises(ParityError, match="update\\(\\) changed the labels of task_a"):
        run_metric_case(pinned("ctr")[1])


def test_a_resumed_metric_covers_the_whole_stream_and_a_fresh_one_would_not():
    spec = pinned("calibration")[2]
    assert spec.resume_at == 2 and run_metric_case(spec)["compared"] > 0
    # What a resume that lost the states reports (the last batch alone) fails the comparison.
    lost = torchrec_report(dataclasses.replace(spec, batches=spec.batches[2:], resume_at=None))
    with pytest.raises(ParityError):
        _compare(spec, lost, "rank 0")


def test_gauc_by_hand():
    # Sessions of two and one, twice: (0.8 pos, 0.4 pos) has no negative and (0.6) one sample: neither
    # counts; (0.7 neg, 0.9 pos) ranks right (AUC 1); (0.1 pos) alone does not count.
    samples = SAMPLES + [(0.7, 0.0, 1.0), (0.9, 1.0, 2.0), (0.1, 1.0, 1.0)]
    assert reference.gauc(samples, (2, 1)) == 1.0 and reference.gauc_num_samples(samples, (2, 1)) == 1.0
    # One session a batch: the first is SAMPLES (AUC 0.25), the second ranks 0.9 above 0.7 and 0.1 below
    # it: (2 * 1) / (3 * 1).
    assert reference.gauc(samples, (3,)) == pytest.approx((0.25 + 2 / 3) / 2)
    assert reference.gauc([(0.3, 1.0, 1.0), (0.2, 1.0, 1.0)], (2,)) == 0.5  # no session counts


@pytest.mark.parametrize("name", ["ne", "ne_positive", "cali_free_ne", "nmse", "nrmse", "calibration", "auc", "auprc",
                                  "weighted_avg", "label_average"])
def test_normalized_formulas_do_not_change_when_every_weight_is_scaled(name):
    scaled = [(p, l, 2.5 * w) for p, l, w in SAMPLES]
    assert getattr(reference, name)(scaled) == pytest.approx(getattr(reference, name)(SAMPLES))


def test_windows():
    batches = [[(0.1, 0, 1)] * 3, [(0.2, 0, 1)] * 3, [(0.3, 0, 1)] * 3]
    assert reference.window_of_batches(batches, 7) == batches[1] + batches[2]
    assert reference.window_of_batches(batches, 6) == batches[1] + batches[2]
    assert reference.window_of_batches(batches, 5) == batches[2]
    assert reference.window_of_samples(batches, 4) == batches[1][2:] + batches[2]


def _torchrec_report(spec: MetricSpec) -> dict:
    """The metric's values (RecMetricModule's throughput rates are wall-clock times, left out)."""
    return {k: float(v.reshape(-1)[0]) for k, v in torchrec_report(spec).items() if not k.startswith("throughput-")}


PLANT_METRICS = {"ne-norm-in-natural-log": "ne", "window-drops-a-full-window": "ctr", "auc-ranks-ascending": "auc",
                 "metric-states-not-checkpointed": "calibration", "recalibration-coefficient-inverted": "recalibrated_ne",
                 "grouped-auc-weights-groups-by-size": "grouped_auc", "multiclass-recall-ranks-ascending": "multiclass_recall",
                 "fused-updates-not-flushed-at-compute": "ctr"}
# The pinned case that shows each plant: the unfused one through RecMetricModule, window 6 of batches of 3;
# for the checkpoint plant, the one resumed before its last batch; for the fused updates', the one fusing two.
PLANT_CASE = {"metric-states-not-checkpointed": 2, "fused-updates-not-flushed-at-compute": 3}


def test_every_plant_has_a_metric_to_show_it():
    assert sorted(PLANT_METRICS) == METRICS_PLANTS


@pytest.mark.parametrize("plant", METRICS_PLANTS)
def test_planted_bug_changes_what_torchrec_computes(plant):
    spec = pinned(PLANT_METRICS[plant])[PLANT_CASE.get(plant, 1)]
    clean = _torchrec_report(spec)
    with plants.applied([plant]):
        planted = _torchrec_report(spec)
    assert clean != planted
    assert clean == _torchrec_report(spec)  # and gone once the block ends


@pytest.mark.parametrize("index", [0, 1])
def test_reports_name_each_task(index):
    report = _torchrec_report(pinned("ctr")[index])  # the metric class, then RecMetricModule
    assert {k.split("|")[0].split("-")[-1] for k in report if k.startswith("ctr-")} == set(TASK_NAMES)


@pytest.fixture(scope="module")
def clean_run():
    return run_clean("metrics", SELFTEST, None)


@pytest.mark.parametrize("plant", METRICS_PLANTS)
def test_self_test_catches_the_plant_with_the_metrics_check(plant, clean_run):
    outcome = run_plant(plant, SELFTEST, None, clean_run)
    assert (outcome.verdict, outcome.check) == ("caught", "metrics"), outcome.evidence


def test_clean_run_fails_only_on_the_known_broken_cases_which_are_known_issues(clean_run):
    # The known-broken cases of the issues standing on this stack fail; one fixed here passes.
    standing = {rule for rule in KNOWN_BROKEN if known_issues.rule_kept_out(rule) is not None}
    failing = [r for r in clean_run.results if r.status not in ("pass", "skip")]
    assert {r.case_id for r in failing} == {f"known-broken {rule}: {KNOWN_BROKEN[rule][0]}" for rule in standing}
    judged = known_issues.apply(clean_run.results, known_issues.load(), installed_versions()).cases
    broken = [r for r in judged if r.case_id.startswith("known-broken ") and r.status != "skip"]
    # The ones that need a pool of ranks say so on one rank (the self-test's world size).
    on_ranks = [r for r in judged if r.case_id.startswith("known-broken ") and r.status == "skip"]
    assert len(on_ranks) == len(KNOWN_BROKEN_ON_RANKS) and all("needs a pool of 2 ranks" in r.message for r in on_ranks)
    assert len(broken) == len(KNOWN_BROKEN) and all(r.status == ("known-issue" if r.case_id in {c.case_id for c in failing} else "pass")
                                                    for r in broken)


@pytest.mark.parametrize("metric", ["ne", "auc", "calibration"])
def test_two_ranks_reduce_to_the_formula_over_both_streams(metric, rank_pool):
    spec = pinned_on_ranks(metric, 2)[0]  # through RecMetricModule
    assert run_metric_case(spec, rank_pool)["compared"] > 0
    # What a reduction that left rank 1 out would report (rank 0's stream alone) fails the comparison.
    alone = torchrec_report(dataclasses.replace(spec, rank_batches=()))
    with pytest.raises(ParityError):
        _compare(spec, alone, "rank 0 alone")
