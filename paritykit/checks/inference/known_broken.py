"""Inference configurations torchrec gets wrong, each run on purpose by every gate as a minimal
reproduction against the stored rows, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it. The draws keep clear of them (specs.py)."""

from __future__ import annotations

from typing import Any, Callable

from paritykit.checks.inference.cases import run_quant_case
from paritykit.checks.inference.specs import FLOAT_TABLE_SHARDED, PACKED_ONE_ROW, ROW_WISE_MEAN, QuantSpec, QuantTable

# One bag of two ids that fall in the two ranks' row shards (rows 0-3 and 4-7).
ROW_WISE_MEAN_SPEC = QuantSpec("ebc", (QuantTable("t0", 8, 8, "int8", ("f0",), "rw", mean=True),), 2, (((0, 7),),), None)
PACKED_ONE_ROW_SPEC = QuantSpec("ebc", (QuantTable("t0", 1, 8, "int4", ("f0",), "rw"),), 2, (((0,),),), None)
FLOAT_TABLE_SPEC = QuantSpec("ebc", (QuantTable("t0", 4, 8, "fp16", ("f0",), "tw:0"),), 1, (((1, 2),),), None)

KNOWN_BROKEN: dict[str, tuple[str, Callable[[], Any]]] = {
    ROW_WISE_MEAN: ("a quantized EBC's MEAN table sharded row-wise on 2 ranks, one bag with an id on each, against the stored rows",
                    lambda: run_quant_case(ROW_WISE_MEAN_SPEC)),
    FLOAT_TABLE_SHARDED: ("a quantized EBC's fp16 table sharded table-wise on 1 rank, scale and bias split out, against the stored rows",
                          lambda: run_quant_case(FLOAT_TABLE_SPEC)),
    PACKED_ONE_ROW: ("a quantized EBC's int4 table of one row sharded row-wise on 2 ranks, loaded from the unsharded state dict",
                     lambda: run_quant_case(PACKED_ONE_ROW_SPEC)),
}
