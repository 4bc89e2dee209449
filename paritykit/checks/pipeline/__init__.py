"""pipeline: torchrec's training pipelines against a plain loop over the same DMP model, and that
plain loop against the unsharded model.

The engine runs the pipelines (``paritykit.engine``: pipeline_contract.py, builtin_models.py,
pipeline_setup.py, pipeline_runs.py: one setup through one torchrec pipeline on every rank, recorded
as a TrainingRecord). The check itself:
td_input.py      the same batches with TensorDict sparse features; whether this torchrec takes them
comparison.py    per-step and final differences, normalized entropy, SemiSync bounds
verdicts.py      exact, SemiSync and unsharded-anchor verdicts
parity.py        one case: plain loop, anchor, every pipeline on KJT and/or TD batches
assertion.py     ``assert_pipeline_parity`` (a user's model, or the built-in RunSpec form)
report_files.py  per-step diff tables and drift plots
matrix.py        the gate entry (fixed cases, the feature-processor control, drawn cases)
surface.py, surface_runs.py, pt2_compile.py   the rest of torchrec's pipeline machinery, each against its oracle
benchmark.py     runtime and memory of every pipeline, KJT and TD (``paritykit bench pipelines``)
plants.py        planted bugs in torchrec's pipelines and in what DMP shares with them
"""

from paritykit.checks.pipeline.assertion import assert_pipeline_parity
from paritykit.checks.pipeline.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.pipeline.plants", run=run_matrix,
                   oracle="a plain training loop over the same sharded model, anchored to the unsharded model")

__all__ = ["CHECK", "assert_pipeline_parity"]
