"""The sharded-training engine every check builds on, below the checks.

A model factory, a plan and per-rank batches become a ``TrainingSetup`` (setup.py, validated in the
caller); the ranks shard the model from the same initial state and train it (training.py); the
unsharded model is trained in one process with torchrec's gradient semantics (reference.py); the two
records are compared per step and after the last one under a stated tolerance (comparison.py,
tolerances.py). ``assert_sharded_matches_unsharded`` (assertion.py) is the whole path for a user's
model; the sharding, td-kjt and pipeline checks reuse its parts.

assertion.py   the public assertion for a user's model
setup.py       TrainingSetup: the plan resolved, the batches checked, the initial state taken
training.py    the rank side: DMP from the same initial state, N steps, everything recorded
reference.py   the oracle: the unsharded model trained with torchrec's gradient semantics
comparison.py  per step embeddings, outputs and losses, then state and optimizer state
tolerances.py  the stated bounds (norm-wise, per dtype; exact for gathers; a qcomm codec's roundoff)
dmp_options.py how DMP and torchrec's collectives run it (sync collectives, gradient division, a
               hyper-parameter schedule, qcomm, meta init, reshard via resharding.py): never the numbers
probes.py, outputs.py, losses.py, inputs.py   recording embedding outputs, outputs, the default loss,
               the batches' checks
pipeline_contract.py, pipeline_setup.py, pipeline_runs.py   the same setup through torchrec's training
               pipelines (and the plain loop) on every rank, recorded in the same TrainingRecord
builtin_models.py   the built-in DLRM-style and TestSparseNN models, their plans and batches
optim_wrapping.py, optim_training.py, optim_reference.py, optim_schedule.py, optim_model.py
               torchrec's optimizer wrappers as users stack them on the ranks, and their oracle
               (torch's optimizers and clipping, a hand-computed schedule) for the optim check
checkpoint.py, checkpoint_setup.py, checkpoint_reference.py, checkpoint_comparison.py,
checkpoint_roundtrip.py   a checkpoint round trip: save and restore on the ranks as torchrec users
               do, the resumed run's oracle, what a reload must hold, the comparisons
"""
