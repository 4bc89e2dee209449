"""The inference check: its reference read against bytes packed by hand, its planted bugs (each first
shown to change what torchrec computes, then caught by the self-test), its known-broken
reproductions judged as known issues, and fbgemm's width rule that its draws follow."""

from __future__ import annotations

import pytest
import torch

from paritykit.checks import known_issues
from paritykit.checks.inference import quant_modules, quant_reference
from paritykit.checks.inference.known_broken import KNOWN_BROKEN
from paritykit.checks.inference.specs import PINNED, QuantSpec, QuantTable
from paritykit.checks.runner import GateConfig
from paritykit.gate.selftest import run_clean, run_plant
from paritykit.harness import plants
from paritykit.harness.versions import installed_versions

INFERENCE_PLANTS = sorted(name for name, plant in plants.PLANTS.items() if plant.check == "inference")
SELFTEST = GateConfig(device="cpu", world_sizes=(1,), examples=1, seed=0, shrink=False)


def test_reference_reads_packed_codes_low_bits_first():
    # int4: byte 0x21 holds codes 1 (low nibble) then 2; int2: 0b11100100 holds 0, 1, 2, 3.
    int4 = torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)
    assert quant_reference.codes(int4, "int4", 4).tolist() == [[1, 2, 0, 15]]
    int2 = torch.tensor([[0b11100100, 0b00000011]], dtype=torch.uint8)
    assert quant_reference.codes(int2, "int2", 8).tolist() == [[0, 1, 2, 3, 3, 0, 0, 0]]
    scale, bias = torch.tensor([[0.5]], dtype=torch.float16), torch.tensor([[-1.0]], dtype=torch.float16)
    assert quant_reference.dequantized(int4, scale, bias, "int4", 4).tolist() == [[-0.5, 0.0, -1.0, 6.5]]


def test_reference_reads_float_rows_from_their_bytes():
    row = torch.tensor([[1.5, -2.25]], dtype=torch.float16)
    assert quant_reference.dequantized(row.view(torch.uint8), None, None, "fp16", 2).tolist() == [[1.5, -2.25]]


def test_reference_pools_by_hand():
    table = torch.tensor([[1.0, 2.0], [10.0, 20.0]], dtype=torch.float64)
    assert quant_reference.pooled(table, [0, 1, 1], [2.0, 1.0, -1.0], mean=False).tolist() == [2.0, 4.0]
    assert quant_reference.pooled(table, [0, 1], None, mean=True).tolist() == [5.5, 11.0]
    assert quant_reference.pooled(table, [], None, mean=True).tolist() == [0.0, 0.0]
    assert quant_reference.sequence(table, [1, 0]).tolist() == [[10.0, 20.0], [1.0, 2.0]]


def test_fbgemm_refuses_an_int2_row_of_half_a_word():
    """The width rule the draws follow (specs.widths): an int2 row of 4 entries is one byte, refused."""
    spec = QuantSpec("ebc", (QuantTable("t0", 3, 4, "int2", ("f0",), "tw:0"),), 1, (((0,),),), None)
    with pytest.raises(RuntimeError, match="multiple of 2 Bytes"):
        quant_modules.quantized(spec, quant_modules.float_module(spec))


def _torchrec_outputs(spec: QuantSpec) -> list[torch.Tensor]:
    """What the sharded module returns for the spec's batch: torchrec's own numbers, nothing compared."""
    quant = quant_modules.quantized(spec, quant_modules.float_module(spec))
    with quant_modules.devices_propagated():
        sharded = quant_modules.sharded(spec, quant)
        out = sharded(quant_modules.features(spec))
    if spec.pooled:
        return [out.to_dict()[f] for f in spec.features]
    return [out[f].values() for f in spec.features]


# The pinned case each plant shows on: column shards on ranks [1, 0, 1]; a row-wise reduce over 3
# ranks; a row-wise EC whose ids come back in another order than the shards'.
PLANT_SPECS = {
    "infer-cw-shards-not-permuted": PINNED["ebc"][0],
    "infer-rw-reduce-drops-last-rank": PINNED["weighted-ebc"][0],
    "infer-rw-sequence-not-unbucketized": PINNED["ec"][0],
}


def test_every_plant_has_a_spec_to_show_it():
    assert sorted(PLANT_SPECS) == INFERENCE_PLANTS


@pytest.mark.parametrize("plant", INFERENCE_PLANTS)
def test_planted_bug_changes_what_torchrec_computes(plant):
    spec = PLANT_SPECS[plant]
    clean = _torchrec_outputs(spec)
    with plants.applied([plant]):
        planted = _torchrec_outputs(spec)
    assert any(not torch.equal(a, b) for a, b in zip(clean, planted))
    assert all(torch.equal(a, b) for a, b in zip(clean, _torchrec_outputs(spec)))  # and gone once the block ends


@pytest.fixture(scope="module")
def clean_run():
    return run_clean("inference", SELFTEST, None)


def test_clean_run_fails_only_on_the_known_broken_cases(clean_run):
    failing = {r.case_id for r in clean_run.results if r.status not in ("pass", "skip")}
    assert failing == {r.case_id for r in clean_run.results if r.case_id.startswith("known-broken ")}
    assert len(failing) == len(KNOWN_BROKEN)
    assert sum(r.status == "pass" for r in clean_run.results) >= sum(len(p) for p in PINNED.values())


@pytest.mark.parametrize("plant", INFERENCE_PLANTS)
def test_self_test_catches_the_plant_with_the_inference_check(plant, clean_run):
    outcome = run_plant(plant, SELFTEST, None, clean_run)
    assert (outcome.verdict, outcome.check) == ("caught", "inference"), outcome.evidence


def test_known_broken_cases_are_known_issues_on_this_stack(clean_run):
    judged = known_issues.apply(clean_run.results, known_issues.load(), installed_versions()).cases
    broken = [r for r in judged if r.case_id.startswith("known-broken ")]
    assert len(broken) == len(KNOWN_BROKEN)
    assert all(r.status == "known-issue" for r in broken), [r.message[:300] for r in broken if r.status != "known-issue"]
