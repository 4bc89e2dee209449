"""pipeline: torchrec's training pipelines against a plain loop over the same model and data.

models.py        the DMP-wrapped models (DLRM-style, torchrec's TestSparseNN) and their per-rank data
runs.py          one model through one pipeline on every rank, recorded as a PipelineRun
comparison.py    per-step and final differences, normalized entropy, SemiSync bounds
assertion.py     ``assert_pipeline_parity`` and the unsafe-configuration rule
report_files.py  per-step diff tables and drift plots
matrix.py        the gate entry (fixed cases, the feature-processor control, drawn cases)
plants.py        planted bugs in torchrec's pipelines
"""

from paritykit.checks.pipeline.assertion import assert_pipeline_parity
from paritykit.checks.pipeline.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.pipeline.plants", run=run_matrix)

__all__ = ["CHECK", "assert_pipeline_parity"]
