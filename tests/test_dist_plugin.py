"""The pytest plugin as a downstream suite sees it: profiles reach its @given tests, and under
`pytest -n N` every test that needs a pool runs on one worker, so each pool size starts once.

Each scenario is a small suite of its own in a temporary directory (its own rootdir, none of this
repository's conftests), run by pytest in a child process with the installed plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hypothesis._settings as hypothesis_settings_module
import pytest

from paritykit.gate.profiles import PROFILE_ENV, PROFILE_EXAMPLES

PROPERTY_SUITE = textwrap.dedent(
    """
    import json
    from hypothesis import given, settings, strategies as st

    CALLS = {"follows": 0, "own": 0}

    @given(st.integers())
    def test_follows_the_profile(value):
        CALLS["follows"] += 1

    @settings(max_examples=7)
    @given(st.integers())
    def test_sets_its_own_examples(value):
        CALLS["own"] += 1

    def test_zz_write_counts(paritykit_examples):
        with open("counts.json", "w") as out:
            json.dump(dict(CALLS, fixture=paritykit_examples, profile=settings.get_current_profile_name()), out)
    """
)

POOL_SUITE = textwrap.dedent(
    """
    import json, os, uuid
    import pytest
    import torch
    import torch.distributed as dist
    from hypothesis import given, strategies as st
    from paritykit.dist import RankPool

    def rank_sum(offset):
        value = torch.tensor([dist.get_rank() + offset])
        dist.all_reduce(value)
        return int(value.item())

    def record(kind, pool):
        entry = {"kind": kind, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pids": pool.pids()}
        with open(f"seen-{uuid.uuid4().hex}.json", "w") as out:
            json.dump(entry, out)

    @pytest.fixture(scope="module")
    def own_pool():
        with RankPool(1, preload=("torch",)) as pool:
            yield pool

    @pytest.mark.parametrize("offset", range(3))
    def test_default_pool(rank_pool, offset):
        assert rank_pool.run(rank_sum, offset) == [1 + 2 * offset] * 2
        record("ws2", rank_pool)

    @pytest.mark.world_size(1)
    @given(st.integers(0, 9))
    def test_one_rank_pool_in_a_property(rank_pool, offset):
        assert rank_pool.run(rank_sum, offset) == [offset]
        record("ws1", rank_pool)

    @pytest.mark.parametrize("offset", range(3))
    def test_module_pool(own_pool, offset):
        assert own_pool.run(rank_sum, offset) == [offset]
        record("own", own_pool)

    @pytest.mark.parametrize("index", range(6))
    def test_without_a_pool(index):
        assert index * 2 == index + index
    """
)


def _run_suite(tmp_path: Path, source: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_suite.py").write_text(source)
    # Hypothesis loads its own "ci" profile where it sees a CI variable: the sub-suite must not.
    ci_variables = set(getattr(hypothesis_settings_module, "_CI_VARS", {"CI": None}))
    environment = {key: value for key, value in os.environ.items() if key != PROFILE_ENV and key not in ci_variables}
    environment.update(env or {}, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_suite.py"],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600,
    )


def _counts(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    run = _run_suite(tmp_path, PROPERTY_SUITE, *args, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return json.loads((tmp_path / "counts.json").read_text())


@pytest.mark.parametrize("profile", ["ci", "release"])
def test_a_downstream_property_draws_the_examples_of_the_profile_named_in_the_environment(tmp_path, profile):
    counts = _counts(tmp_path, env={PROFILE_ENV: profile})
    assert counts == {"follows": PROFILE_EXAMPLES[profile], "own": 7, "fixture": PROFILE_EXAMPLES[profile], "profile": profile}


def test_hypothesis_profile_option_wins_over_the_environment(tmp_path):
    counts = _counts(tmp_path, "--hypothesis-profile", "dev", env={PROFILE_ENV: "release"})
    assert (counts["profile"], counts["follows"]) == ("dev", PROFILE_EXAMPLES["dev"])


def test_paritykit_examples_sets_every_property_that_does_not_set_its_own(tmp_path):
    counts = _counts(tmp_path, "--paritykit-examples", "3", env={PROFILE_ENV: "ci"})
    assert (counts["follows"], counts["own"], counts["fixture"]) == (3, 7, 3)


def test_without_a_profile_the_suites_own_hypothesis_settings_stay(tmp_path):
    counts = _counts(tmp_path)
    assert counts["profile"] == "default"
    assert counts["follows"] == 100  # hypothesis' own default, untouched by the plugin


def test_an_unknown_profile_in_the_environment_is_a_usage_error_naming_it(tmp_path):
    run = _run_suite(tmp_path, PROPERTY_SUITE, env={PROFILE_ENV: "nightly"})
    assert run.returncode == 4
    assert "PARITYKIT_PROFILE='nightly' is not a profile" in run.stderr


def test_a_bare_n_runs_no_more_workers_than_cores(tmp_path):
    from paritykit.dist import host_cores

    run = _run_suite(tmp_path, PROPERTY_SUITE, "-v", "-n", str(host_cores() + 2))
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"created: {host_cores()}/{host_cores()} workers" in run.stdout


def _seen(tmp_path: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("seen-*.json"))]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rank processes are counted by pid on Linux")
def test_under_xdist_each_pool_and_each_module_fixture_starts_once_on_one_worker(tmp_path):
    run = _run_suite(tmp_path, POOL_SUITE, "-n", "2", env={PROFILE_ENV: "dev"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "13 passed" in run.stdout
    seen = _seen(tmp_path)
    by_kind = {kind: [entry for entry in seen if entry["kind"] == kind] for kind in ("ws2", "ws1", "own")}
    assert [len(by_kind[kind]) for kind in ("ws2", "ws1", "own")] == [3, PROFILE_EXAMPLES["dev"], 3]
    # The plugin's pools: one worker, one set of rank processes per size.
    assert len({entry["worker"] for entry in by_kind["ws2"] + by_kind["ws1"]}) == 1
    assert len({tuple(entry["pids"]) for entry in by_kind["ws2"]}) == 1
    assert len({tuple(entry["pids"]) for entry in by_kind["ws1"]}) == 1
    # The module's own pool fixture: its tests share one worker, so it started once.
    assert len({entry["worker"] for entry in by_kind["own"]}) == 1
    assert len({tuple(entry["pids"]) for entry in by_kind["own"]}) == 1


GROUPED_SUITE = textwrap.dedent(
    """
    import os, uuid
    import pytest

    @pytest.mark.xdist_group("mine")
    @pytest.mark.parametrize("index", range(6))
    def test_grouped(index):
        with open(f"grouped-{uuid.uuid4().hex}", "w") as out:
            out.write(os.environ["PYTEST_XDIST_WORKER"])

    @pytest.mark.parametrize("index", range(6))
    def test_free(index):
        assert index >= 0
    """
)


def test_a_tests_own_xdist_group_keeps_its_tests_on_one_worker(tmp_path):
    # xdist's own loadgroup marks the group in node ids, which pytest 9.2 ignores; the plugin's
    # scheduler reads the groups the workers wrote, so the marker works on any pytest.
    run = _run_suite(tmp_path, GROUPED_SUITE, "-n", "2")
    assert run.returncode == 0, run.stdout[-3000:]
    workers = [path.read_text() for path in tmp_path.glob("grouped-*")]
    assert len(workers) == 6 and len(set(workers)) == 1
