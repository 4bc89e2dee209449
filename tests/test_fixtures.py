"""Golden fixtures: verified against the installed stack; tampering, other versions and moved numbers are reported."""

import json
import shutil

import pytest
import torch

from paritykit.checks.golden import store as fixtures
from paritykit.checks.golden.recipes import RECIPES
from paritykit.gate import cli


@pytest.fixture
def fixture_copy(tmp_path):
    target = tmp_path / "fixtures"
    shutil.copytree(fixtures.DEFAULT_DIR, target)
    return target


def test_checked_in_fixtures_verify_with_the_installed_stack():
    results = fixtures.verify()
    assert {r.case_id for r in results} == set(RECIPES)
    assert [r.status for r in results] == ["pass"] * len(results), [r.message for r in results]


def test_recorded_ebc_output_matches_an_independent_computation():
    stored = torch.load(fixtures.DEFAULT_DIR / "ebc-unweighted.pt", weights_only=False)
    weights, batch = stored["inputs"]["weights"], stored["inputs"]["batch"]
    lengths = batch["lengths"].view(3, 4)  # keys f0, f1, f2 x batch 4
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
        assert lengths.shape == (3, 4)
        torch.testing.assert_close(stored["expected"]["pooled"][key], torch.stack(rows))


def test_tampered_fixture_fails_naming_the_file(fixture_copy):
    path = fixture_copy / "ec-sequence.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    results = {r.case_id: r for r in fixtures.verify(fixture_copy)}
    assert results["ec-sequence"].status == "fail"
    assert "ec-sequence.pt was modified after recording" in results["ec-sequence"].message
    assert results["ebc-weighted"].status == "pass"


def test_fixture_from_other_versions_is_reported_with_the_difference(fixture_copy):
    manifest_path = fixture_copy / fixtures.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["versions"]["torchrec"] = "0.9.0"
    manifest_path.write_text(json.dumps(manifest))
    results = fixtures.verify(fixture_copy)
    assert all(r.status == "pass" for r in results)
    assert all("torchrec 0.9.0 -> " in r.message for r in results)


def test_numbers_that_moved_fail_even_when_both_paths_move_together(fixture_copy, monkeypatch):
    # A "release" that scales every pooled embedding: any TD-vs-KJT comparison would still agree.
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    original = EmbeddingBagCollection.forward

    def scaled_forward(self, features):
        output = original(self, features)
        output._values = output.values() * 1.001
        return output

    monkeypatch.setattr(EmbeddingBagCollection, "forward", scaled_forward)
    results = {r.case_id: r for r in fixtures.verify(fixture_copy)}
    assert results["ebc-unweighted"].status == "fail"
    assert "fixture ebc-unweighted.pt" in results["ebc-unweighted"].message
    assert results["ec-sequence"].status == "pass"


def test_missing_manifest_is_a_harness_error(tmp_path, capsys):
    assert cli.main(["fixtures", "verify", "--dir", str(tmp_path)]) == 2
    assert "no fixture manifest" in capsys.readouterr().err


def test_record_then_verify_round_trips(tmp_path):
    fixtures.record(tmp_path, names=["ec-sequence"])
    assert [r.status for r in fixtures.verify(tmp_path)] == ["pass"]
