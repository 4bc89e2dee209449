"""Module configurations torchrec gets wrong, each run on purpose by every gate as a minimal
reproduction against the formula, so that its failure is matched against the known issues
(paritykit/checks/known_issues.toml, case ``known-broken <rule>: <what>``) and ``--strict`` notices
the day torchrec fixes it. The draws keep clear of them (draws.py)."""

from __future__ import annotations

from typing import Any, Callable

from paritykit.checks.modules.dense_cases import run_dense_case
from paritykit.checks.modules.dense_modules import SWISH, DenseSpec

MLP_SWISH_DTYPE = "mlp-swish-layernorm-ignores-dtype"

KNOWN_BROKEN: dict[str, tuple[str, Callable[[], Any]]] = {
    MLP_SWISH_DTYPE: ("MLP(activation='swish_layernorm', dtype=torch.float64) against its formula",
                      lambda: run_dense_case(DenseSpec("mlp", 3, 4, (4, 5), SWISH, dtype="float64"))),
}
