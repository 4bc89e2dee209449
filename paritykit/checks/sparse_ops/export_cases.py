"""The KJT ops under ``torch.export`` (non-strict), as a model is exported for serving: a module that
splits, indexes, unpacks and permutes its KeyedJaggedTensor input is exported with
``torch.export.export(..., strict=False)``, and the exported program, run on a KJT of the same lengths
and other values, must give what the reference gives for each op. Non-strict tracing takes the ops'
export branches (``torch._check`` and ``torch.narrow`` in place of Python slicing), which eager runs
never reach; the KJTs and JaggedTensors the program returns come back through torchrec's pytree
registration.

Pinned inputs only: one export costs about a second. A variable batch (VBE) is not exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from paritykit.checks.sparse_ops.build import build_kjt
from paritykit.checks.sparse_ops.expect import expect_jt, expect_kjt
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED
from paritykit.checks.sparse_ops.reference import kjt_permute, kjt_split, kjt_to_dict
from paritykit.checks.sparse_ops.specs import KJTSpec
from paritykit.errors import HarnessError


@dataclass(frozen=True)
class ExportCase:
    kjt: KJTSpec
    segments: tuple[int, ...]  # kjt.split
    key: str  # kjt[key]
    indices: tuple[int, ...]  # kjt.permute

    def case_id(self) -> str:
        return f"kjt.export(strict=False): split{list(self.segments)}, [{self.key!r}], to_dict, permute{list(self.indices)} of {self.kjt!r}"


def export_cases() -> tuple[ExportCase, ...]:
    unweighted = KJTSpec(("f0", "f1", "f2", "f3"), ((1, 2), (0, 0), (3, 0), (2, 2)), None, 2, False, "int32", "float32",
                         "int64", "offsets", False, 21)
    return (ExportCase(PINNED_FIXED, (1, 2), "f0", (2, 0, 1)), ExportCase(unweighted, (2, 2), "f3", (3, 1, 1, 0)))


class _Ops(torch.nn.Module):
    def __init__(self, case: ExportCase) -> None:
        super().__init__()
        self.segments, self.key, self.indices = list(case.segments), case.key, list(case.indices)

    def forward(self, kjt: Any) -> tuple:
        return kjt.split(self.segments), kjt[self.key], kjt.to_dict(), kjt.permute(self.indices)


def run_export_case(case: ExportCase) -> dict[str, Any]:
    from paritykit.harness.noise import quiet_export

    if case.kjt.strides is not None:
        raise HarnessError(f"{case.case_id()}: a variable-batch KJT is not exported by this case")
    traced = build_kjt(case.kjt.reference(), case.kjt.form, case.kjt.metadata)
    with quiet_export():
        program = torch.export.export(_Ops(case), (traced,), strict=False)
    # Run on a KJT of the same lengths and other values: a program that kept the traced input's values
    # as constants fails (the lengths are the shapes it was exported for).
    ref = replace(case.kjt, seed=case.kjt.seed + 1).reference()
    pieces, jt, per_key, permuted = program.module()(build_kjt(ref, case.kjt.form, case.kjt.metadata))
    where = "the exported program's"
    expected_pieces = kjt_split(ref, list(case.segments))
    for i, (piece, want) in enumerate(zip(pieces, expected_pieces)):
        expect_kjt(piece, want, f"{where} kjt.split({list(case.segments)})[{i}]", inverse=False)
    reference_dict = kjt_to_dict(ref)
    expect_jt(jt, reference_dict[case.key], f"{where} kjt[{case.key!r}]")
    for key, want in reference_dict.items():
        expect_jt(per_key[key], want, f"{where} kjt.to_dict()[{key!r}]")
    expect_kjt(permuted, kjt_permute(ref, list(case.indices)), f"{where} kjt.permute({list(case.indices)})", inverse=False)
    return {"ops": 4, "pieces": len(expected_pieces), "keys": len(reference_dict)}
