"""Golden fixtures: per-stack goldens verified against the installed stack; tampering, other stacks,
moved numbers (and by how much) and missing fixtures are reported."""

import fnmatch
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

import paritykit
from paritykit.checks.golden import store as fixtures
from paritykit.checks.golden.recipes import RECIPES
from paritykit.gate import cli
from paritykit.harness.versions import installed_versions

REPOSITORY = Path(__file__).resolve().parent.parent


def shipped_stack_dir() -> Path:
    manifest = json.loads((fixtures.DEFAULT_DIR / fixtures.MANIFEST).read_text())
    (key,) = [k for k, stack in manifest["stacks"].items() if stack["versions"]["torchrec"] == "1.8.0"]
    return fixtures.DEFAULT_DIR / key


@pytest.fixture
def fixture_copy(tmp_path):
    target = tmp_path / "fixtures"
    shutil.copytree(fixtures.DEFAULT_DIR, target)
    return target


def test_shipped_fixtures_verify_with_the_installed_stack():
    results = fixtures.verify()
    assert {r.case_id for r in results} == set(RECIPES)
    assert [r.status for r in results] == ["pass"] * len(results), [r.message for r in results]


def test_fixtures_are_package_data_that_the_wheel_carries():
    assert fixtures.DEFAULT_DIR.is_relative_to(Path(paritykit.__file__).parent)
    patterns = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["paritykit"]
    package = Path(paritykit.__file__).parent
    shipped = [p.relative_to(package).as_posix() for p in fixtures.DEFAULT_DIR.rglob("*") if p.is_file()]
    assert shipped and all(any(fnmatch.fnmatch(path, pattern) for pattern in patterns) for path in shipped), shipped


def test_recorded_ebc_output_matches_an_independent_computation():
    stored = torch.load(shipped_stack_dir() / "ebc-unweighted.pt", weights_only=False)
    weights, batch = stored["inputs"]["weights"], stored["inputs"]["batch"]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), batch["lengths"].cumsum(0)])
    for key_index, (key, table, mode) in enumerate([("f0", "t0", "sum"), ("f1", "t0", "sum"), ("f2", "t1", "mean")]):
        table_weight = weights[f"embedding_bags.{table}.weight"]
        rows = []
        for sample in range(4):
            flat = key_index * 4 + sample
            ids = batch["values"][offsets[flat] : offsets[flat + 1]]
            pooled = table_weight[ids].sum(0)
            if mode == "mean" and ids.numel():
                pooled = pooled / ids.numel()
            rows.append(pooled)
        torch.testing.assert_close(stored["expected"]["pooled"][key], torch.stack(rows))


def test_tampered_fixture_fails_naming_the_file(fixture_copy):
    path = fixture_copy / shipped_stack_dir().name / "ec-sequence.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    results = {r.case_id: r for r in fixtures.verify(fixture_copy)}
    assert results["ec-sequence"].status == "fail"
    assert "ec-sequence.pt was modified after recording" in results["ec-sequence"].message
    assert results["ebc-weighted"].status == "pass"


def _as_other_stack(directory: Path, torchrec: str) -> str:
    """Relabel the shipped goldens as recorded on torchrec ``torchrec``; returns their new stack key."""
    manifest = json.loads((directory / fixtures.MANIFEST).read_text())
    (old_key,) = manifest["stacks"]
    stack = manifest["stacks"].pop(old_key)
    stack["versions"]["torchrec"] = torchrec
    new_key = fixtures.stack_key(stack["versions"])
    (directory / old_key).rename(directory / new_key)
    manifest["stacks"][new_key] = stack
    (directory / fixtures.MANIFEST).write_text(json.dumps(manifest))
    return new_key


def test_a_stack_without_goldens_is_verified_against_the_last_trusted_stack_before_it(fixture_copy):
    older = _as_other_stack(fixture_copy, "0.9.0")
    results = fixtures.verify(fixture_copy)
    assert all(r.status == "pass" and r.metrics["goldens"] == older for r in results)
    own = fixtures.stack_key(installed_versions())
    assert all(f"no goldens recorded for this stack ({own}); verified against the goldens of {older}" in r.message for r in results)


def test_recording_adds_this_stacks_goldens_beside_the_others_and_verify_then_uses_its_own(fixture_copy):
    older = _as_other_stack(fixture_copy, "0.9.0")
    fixtures.record(fixture_copy, names=["ec-sequence"])
    stacks = json.loads((fixture_copy / fixtures.MANIFEST).read_text())["stacks"]
    own = fixtures.stack_key(installed_versions())
    assert set(stacks) == {older, own} and list(stacks[own]["files"]) == ["ec-sequence.pt"]
    assert [(r.case_id, r.status, r.metrics["goldens"], r.message) for r in fixtures.verify(fixture_copy)] == [("ec-sequence", "pass", own, "")]


def test_numbers_that_moved_fail_and_say_by_how_much_even_when_both_paths_move_together(fixture_copy, monkeypatch):
    # A "release" that scales every pooled embedding: any TD-vs-KJT comparison would still agree.
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    original = EmbeddingBagCollection.forward

    def scaled_forward(self, features):
        output = original(self, features)
        output._values = output.values() * 1.001
        return output

    monkeypatch.setattr(EmbeddingBagCollection, "forward", scaled_forward)
    results = {r.case_id: r for r in fixtures.verify(fixture_copy)}
    moved = results["ebc-unweighted"]
    assert moved.status == "fail" and "fixture ebc-unweighted.pt: numbers moved by up to" in moved.message
    # Independently: the output and (through the summed loss) every gradient are scaled by 1.001.
    expected = torch.load(shipped_stack_dir() / "ebc-unweighted.pt", weights_only=False)["expected"]
    largest = max(t.abs().max().item() for t in [*expected["pooled"].values(), *expected["grads"].values()])
    assert moved.metrics["max_abs_diff"] == pytest.approx(0.001 * largest, rel=1e-3)
    assert results["ec-sequence"].status == "pass" and results["ec-sequence"].metrics["max_abs_diff"] == 0.0


def test_missing_manifest_is_a_harness_error_pointing_at_a_trusted_stack(tmp_path, capsys):
    assert cli.main(["fixtures", "verify", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no golden fixtures at" in err and "Record them on a trusted stack, not on the stack under test" in err


def test_missing_fixtures_are_a_loud_skip_in_the_gate_and_an_error_under_strict(tmp_path, capsys):
    assert cli.main(["gate", "--check", "fixtures", "--fixtures-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fixtures   ok    1 skip" in out
    assert "note: golden fixtures missing (a skip, an error under --strict): no golden fixtures at" in out
    assert cli.main(["gate", "--check", "fixtures", "--fixtures-dir", str(tmp_path), "--strict"]) == 2
    assert "[error] fixtures :: <fixtures>" in capsys.readouterr().out


def test_gate_verifies_a_fixtures_dir_given_on_the_command_line(fixture_copy, capsys):
    path = fixture_copy / shipped_stack_dir().name / "ebc-weighted.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert cli.main(["gate", "--check", "fixtures", "--fixtures-dir", str(fixture_copy)]) == 1
    assert "ebc-weighted.pt was modified after recording" in capsys.readouterr().out


def test_record_then_verify_round_trips(tmp_path):
    fixtures.record(tmp_path, names=["ec-sequence"])
    assert [r.status for r in fixtures.verify(tmp_path)] == ["pass"]
