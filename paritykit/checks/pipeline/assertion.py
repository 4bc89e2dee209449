"""``assert_pipeline_parity``: a model under torchrec's training pipelines trains exactly like a plain loop,
and that plain loop like the unsharded model.

    def my_ranker():                               # module level, so the ranks can build it too
        return MyRanker(...)                       # forward(batch) -> (loss, prediction)

    paritykit.assert_pipeline_parity(
        my_ranker,
        {"user": table_wise(rank=1), "item": column_wise(ranks=[1, 0])},   # or a torchrec ShardingPlan
        batches,                                   # batches[step][rank], torchrec Pipelineables (ModelInput)
        pipelines=("sparse_dist", "fused:new", "semi_sync"),
        pool=rank_pool,                            # optional: a RankPool of len(batches[0]) ranks
    )

The built-in form ``assert_pipeline_parity(pool, run_spec, pipelines)`` keeps working (told apart by
its second argument, a RunSpec). Both forms go through one path (parity.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from paritykit.checks.known_configurations import named_in_failures
from paritykit.checks.pipeline.comparison import DEFAULT_SEMI_SYNC_BOUNDS, REFERENCE, PipelineParityResult, SemiSyncBounds
from paritykit.engine.pipeline_contract import check_forward_contract, check_pipelineable, model_loss
from paritykit.engine.builtin_models import batches_of, builtin_setup
from paritykit.engine.configuration import configurations_of
from paritykit.checks.pipeline.parity import PipelineCase, run_parity_case, with_td_batches
from paritykit.engine.pipeline_catalog import EXACT, SEMI_SYNC, STOPS_WITH_DATA, VARIANTS, available
from paritykit.engine.pipeline_runs import PIPELINES, RunSpec
from paritykit.engine.setup import DEFAULT_LR, build_setup
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.configuration import described_by
from paritykit.harness.devices import resolve_device
from paritykit.harness.dmp import table_parameters
from paritykit.harness.optimizers import OptimizerSpec

ALL_PIPELINES = tuple(name for name in PIPELINES if name != REFERENCE)


def training_variants() -> tuple[str, ...]:
    """The catalog's training pipelines this torchrec has (pipeline_catalog), also accepted by name."""
    return available(EXACT) + available(SEMI_SYNC) + available(STOPS_WITH_DATA)


def feature_processed_modules(model: torch.nn.Module) -> list[str]:
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    return [name for name, module in model.named_modules() if isinstance(module, FeatureProcessedEmbeddingBagCollection)]


def unsafe_configuration(has_feature_processor: Any, pipeline: str) -> str:
    """Why ``pipeline`` is unsafe for a model with a feature processor, or "" when it is not known to be.

    TrainPipelineFusedSparseDist looks up the next batch's embeddings while the optimizer step of
    the current one runs; it relies on fused TBE having updated the tables in backward. A feature
    processor's parameters (e.g. position weights) are updated by the optimizer step instead, so on
    a GPU the overlapped lookup can read them before or after the update. On CPU everything runs in
    program order, so equal numbers prove nothing; torchrec's own docstring names this case. A
    lookup on the current stream ("fused:current*") is ordered after the optimizer and stays safe.
    ``has_feature_processor`` may be a RunSpec (the built-in form).
    """
    if isinstance(has_feature_processor, RunSpec):
        has_feature_processor = has_feature_processor.model.feature_processor
    class_name, options = PIPELINES[pipeline] if pipeline in PIPELINES else (VARIANTS[pipeline].class_name, dict(VARIANTS[pipeline].options))
    lookup_stream = options.get("emb_lookup_stream", "data_dist")
    if has_feature_processor and class_name == "TrainPipelineFusedSparseDist" and lookup_stream != "current":
        return (
            f"unsafe configuration: {pipeline} (TrainPipelineFusedSparseDist, emb_lookup_stream={lookup_stream!r}) "
            "with a feature processor: the next batch's lookup overlaps the optimizer step that updates the "
            "feature processor's parameters, so its numbers depend on stream timing on a GPU. Use "
            "emb_lookup_stream='current' or TrainPipelineSparseDist."
        )
    return ""


def checked_pipelines(pipelines: Iterable[str], has_feature_processor: bool, allow_unsafe: bool) -> tuple[str, ...]:
    """Known names, in order, once each; ParityError for a known-unsafe one unless allowed."""
    if isinstance(pipelines, str):
        pipelines = (pipelines,)
    names = tuple(dict.fromkeys(pipelines))
    known = ALL_PIPELINES + training_variants()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise HarnessError(f"unknown pipeline(s) {unknown}; choose from {', '.join(known)}")
    unsafe = [n for n in names if unsafe_configuration(has_feature_processor, n)]
    if unsafe and not allow_unsafe:
        raise ParityError(unsafe_configuration(has_feature_processor, unsafe[0]))
    return names


def assert_pipeline_parity(
    model_fn: Callable[[], torch.nn.Module] | Any,
    plan: Any = None,
    batches: Any = None,
    *,
    pipelines: Iterable[str] = ALL_PIPELINES,
    pool: Any = None,
    embedding_optimizer: OptimizerSpec | str | None = None,
    dense_optimizer: OptimizerSpec | str | None = None,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    td_batches: Any = None,
    semi_sync_start_batch: int = 0,
    semi_sync_bounds: SemiSyncBounds = DEFAULT_SEMI_SYNC_BOUNDS,
    anchor: bool = True,
    report_dir: Path | str | None = None,
    allow_unsafe: bool = False,
) -> PipelineParityResult:
    """Train ``model_fn()`` sharded by ``plan`` through a plain loop and each of ``pipelines``; ParityError
    naming pipeline, step, rank, module or key and element at the first broken promise.

    The model's ``forward(batch)`` must return ``(loss, prediction)``, as torchrec's pipelines require
    (they back-propagate ``torch.sum(loss, dim=0)`` and return the prediction); anything else is a
    HarnessError before any rank runs. ``batches[step][rank]`` are torchrec Pipelineables (such as
    ``ModelInput``). ``plan`` maps table names (or module FQNs to tables) to torchrec's
    ``sharding_plan`` generators, or is a ``ShardingPlan``; a plan or batch mistake is a HarnessError
    before any rank runs. Tables train with the fused ``embedding_optimizer`` ("sgd", "adagrad",
    "rowwise_adagrad"), the rest with ``dense_optimizer``, both at ``lr`` (the CPU stream shim
    applied where needed).

    Promises held: base, sparse_dist and every fused:* pipeline equal the plain loop bit for bit per
    step (embeddings by key, prediction, loss) and in the final tables, dense parameters and both
    optimizers' state; semi_sync is exact through batch ``semi_sync_start_batch`` and within
    ``semi_sync_bounds`` after it. With ``anchor`` the plain loop must also match the unsharded model
    trained with torchrec's gradient semantics (the sharding engine's reference and tolerance), so a
    bug shared by DMP and every pipeline cannot hide. ``td_batches`` (the same data with sparse
    features as TensorDicts) runs every pipeline again, each required to equal its KJT run exactly.
    A pipeline known to be unsafe for the model (a feature processor under an overlapping fused
    lookup) is a ParityError before anything runs unless ``allow_unsafe``.
    """
    if _is_builtin_form(model_fn, plan):
        names = batches if batches is not None else pipelines
        return _assert_builtin(model_fn, plan or RunSpec(), names, semi_sync_bounds, report_dir, allow_unsafe, anchor)
    if plan is None or batches is None:
        raise HarnessError("assert_pipeline_parity(model_fn, plan, batches, ...): give the plan and batches[step][rank]")
    device = resolve_device(getattr(pool, "device", None) or "cpu")
    setup = build_setup(model_fn, plan, batches, loss_fn=model_loss, embedding_optimizer=embedding_optimizer,
                        dense_optimizer=dense_optimizer, lr=lr, seed=seed, device=device)
    model = _checked_model(setup)
    names = checked_pipelines(pipelines, bool(feature_processed_modules(model)), allow_unsafe)
    label = getattr(model_fn, "__qualname__", type(model_fn).__name__)
    case = PipelineCase(setup, names, label, inputs=("kjt", "td") if td_batches is not None else ("kjt",),
                        semi_sync_start_batch=semi_sync_start_batch, semi_sync_bounds=semi_sync_bounds, anchor=anchor)
    if td_batches is not None:
        case = with_td_batches(case, [list(step) for step in td_batches])
    # A failure names the known torchrec issues its configuration matches (known_configurations.py).
    with named_in_failures("pipeline"), described_by(lambda _exc: configurations_of(case.setup)):
        return run_on_pool(case, pool, report_dir)


def _checked_model(setup: Any) -> torch.nn.Module:
    """The unsharded model, checked in the caller against what the pipelines need of it."""
    check_pipelineable(setup.batches)
    model = setup.model_fn()
    model.load_state_dict(setup.full_state)
    tables = {id(p) for p in table_parameters(model)}
    if all(id(p) in tables for p in model.parameters()):
        raise HarnessError("torchrec's train pipelines step a dense optimizer, and this model has no parameter outside its embedding tables")
    check_forward_contract(model, setup.batches[0][0])
    return model


def run_on_pool(case: PipelineCase, pool: Any, report_dir: Path | str | None) -> PipelineParityResult:
    if pool is None:
        from paritykit.dist import RankPool

        with RankPool(case.setup.world_size, device=case.setup.device) as own_pool:
            return run_parity_case(case, own_pool, report_dir)
    if pool.world_size != case.setup.world_size:
        raise HarnessError(f"the batches are for {case.setup.world_size} ranks (batches[step][rank]); the pool has {pool.world_size}")
    return run_parity_case(case, pool, report_dir)


def _is_builtin_form(first: Any, second: Any) -> bool:
    """``(pool, RunSpec | None, pipelines)``: a RunSpec second, or a rank pool first with no plan."""
    if isinstance(second, RunSpec):
        return True
    return second is None and (first is None or (hasattr(first, "call") and hasattr(first, "world_size")))


def builtin_case(spec: RunSpec, world_size: int, pipelines: tuple[str, ...], **options: Any) -> PipelineCase:
    """The PipelineCase of a built-in RunSpec (its model, data, device, SemiSync start and input type)."""
    setup = builtin_setup(spec.model, batches_of(spec.model, spec.data, world_size), spec.device)
    inputs = {"kjt": ("kjt",), "td": ("td",), "both": ("kjt", "td")}[options.pop("inputs", spec.input_type)]
    case = PipelineCase(setup, pipelines, _describe(spec), inputs=inputs, semi_sync_start_batch=spec.semi_sync_start_batch,
                        overlap_optimizer=spec.overlap_optimizer, **options)
    return with_td_batches(case) if "td" in inputs else case


def _assert_builtin(pool: Any, spec: RunSpec, pipelines: Iterable[str], bounds: SemiSyncBounds, report_dir: Any,
                    allow_unsafe: bool, anchor: bool) -> PipelineParityResult:
    names = checked_pipelines(pipelines, spec.model.feature_processor, allow_unsafe)
    if pool is None:
        raise HarnessError("the built-in form assert_pipeline_parity(pool, spec, pipelines) needs a rank pool")
    case = builtin_case(spec, pool.world_size, names, semi_sync_bounds=bounds, anchor=anchor)
    return run_parity_case(case, pool, report_dir)


def _describe(spec: RunSpec) -> str:
    m = spec.model
    return f"{m.kind} ({'+'.join(m.sharding_types)}, {m.fused_optimizer}+{m.dense_optimizer}, {spec.input_type} batches)"
