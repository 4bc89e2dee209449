"""The inference check's gate entry: quantized EBCs (plain and weighted) and ECs, each unsharded and
sharded for inference on CPU, against the stored rows read by hand; then the known-broken
reproductions. Inference sharding runs every rank in this process: no pool is needed."""

from __future__ import annotations

from typing import Any

from paritykit.checks.inference.cases import run_quant_case
from paritykit.checks.inference.known_broken import KNOWN_BROKEN
from paritykit.checks.inference.specs import MODULES, PINNED, quant_specs
from paritykit.checks.results import CaseResult
from paritykit.checks.runner import GateConfig, run_case, run_property

NAME = "inference"
CPU_ONLY = ("the inference check shards for inference on CPU in this version (torchrec places a GPU inference "
            "shard on its rank's device, which needs one GPU per rank)")


def run_matrix(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    if config.device != "cpu":
        return [CaseResult(NAME, "inference", "skip", replay=config.replay(NAME), message=CPU_ONLY)]
    results: list[CaseResult] = []
    for module in MODULES:
        results += run_property(NAME, quant_specs(module), run_quant_case, config, case_id=lambda spec: spec.case_id(),
                                explicit=PINNED[module])
    for rule, (what, body) in KNOWN_BROKEN.items():
        results.append(run_case(NAME, f"known-broken {rule}: {what}", config, body))
    return results
