"""`paritykit selftest`: each planted bug is caught by the check aimed at it; the clean stack raises no alarm."""

from pathlib import Path

import pytest

from paritykit.checks import CHECK_PACKAGES
from paritykit.gate import cli
from paritykit.gate.selftest import catalog as plant_catalog
from paritykit.gate.profiles import profile_from_env

ROOT = Path(__file__).resolve().parent.parent

# Cheap plants, through `paritykit selftest`: what this suite runs on every change (every plant also
# has a test of its own, tests/test_*_plants.py; the sharding and pipeline checks' runs are the
# slowest, about two minutes each here, so their plants run in CI's next-stack phase only). CI runs
# one plant per check on the next release's stack (.ci/run); the release profile runs the catalog.
FAST_SUBSET = (
    "offsets-off-by-one",
    "permute-drops-weights",
    "tolist-in-ebc-forward",
    "fp16-pooling-accumulation",
)
NEXT_STACK_SUBSET = (
    "offsets-off-by-one",
    "cw-permute-rank-order",
    "skipped-zero-grad",
    "tolist-in-ebc-forward",
    "fp16-pooling-accumulation",
    "permute-drops-weights",
    "warmup-multiplier-one-step-late",
    "sharded-load-ignores-shard-offsets",
    "cross-layer-uses-x-l-for-x0",
    "planner-drops-min-partition",
    "infer-cw-shards-not-permuted",
    "ne-norm-in-natural-log",
)


def test_catalog_has_at_least_twelve_plants_over_every_check():
    catalog = plant_catalog()
    checks = {plant.check for plant in catalog.values()}
    assert len(catalog) >= 12
    assert {"td-kjt", "sharding", "pipeline", "checkpoint", "sync", "sparse-ops", "optim", "planner", "modules", "fixtures"} <= checks
    assert set(FAST_SUBSET) <= set(catalog)
    # One plant per check of the registry (this suite's stand-in check registers plants of its own).
    assert {catalog[name].check for name in NEXT_STACK_SUBSET} == set(CHECK_PACKAGES)
    assert " ".join(f"--plant {name}" for name in NEXT_STACK_SUBSET) in (ROOT / ".ci" / "run").read_text()


def test_fast_subset_is_caught_with_no_false_alarm(capsys):
    args = ["selftest", "--examples", "2", "--clean-seeds", "1"]
    for name in FAST_SUBSET:
        args += ["--plant", name]
    code = cli.main(args)
    out = capsys.readouterr().out
    assert f"kill rate: {len(FAST_SUBSET)}/{len(FAST_SUBSET)} (100%)" in out
    assert "false alarms: 0 in" in out
    assert code == 0


def test_unknown_plant_is_a_harness_error(capsys):
    assert cli.main(["selftest", "--plant", "no-such-bug"]) == 2
    assert "unknown planted bug(s) ['no-such-bug']" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(profile_from_env() != "release", reason="the full planted-bug catalog runs in the release profile (PARITYKIT_PROFILE=release)")
def test_whole_catalog_is_caught_with_no_false_alarm(capsys):
    code = cli.main(["selftest", "--examples", "3", "--clean-seeds", "3"])
    out = capsys.readouterr().out
    assert "false alarms: 0 in" in out
    assert code == 0, out
