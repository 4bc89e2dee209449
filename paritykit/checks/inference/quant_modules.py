"""Build a case's modules the way an inference user does: a float EBC/EC with seeded weights,
quantized by torchrec (``from_float`` under a QuantConfig, scale and bias split out in the state dict),
then sharded for inference on CPU by ``torchrec.inference.modules.shard_quant_model`` with a plan of
the case's placements, its weights loaded from the unsharded quantized module's state dict."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from paritykit.checks.inference.specs import QuantSpec, QuantTable
from paritykit.errors import HarnessError, UnsupportedByTorchrec

TORCH_WEIGHT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4,
                       "fp16": torch.float16, "fp32": torch.float32}
# The module path the sharding plan names (shard_quant_model shards children of a model).
MODULE_PATH = "embeddings"


class Holder(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        setattr(self, MODULE_PATH, module)

    def forward(self, features: Any) -> Any:
        return getattr(self, MODULE_PATH)(features)


def float_module(spec: QuantSpec) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType

    generator = torch.Generator().manual_seed(spec.seed)
    if spec.pooled:
        configs = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features),
                                      pooling=PoolingType.MEAN if t.mean else PoolingType.SUM) for t in spec.tables]
        module: torch.nn.Module = EmbeddingBagCollection(tables=configs, is_weighted=spec.module == "weighted-ebc")
        tables = module.embedding_bags
    else:
        configs = [EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features))
                   for t in spec.tables]
        module = EmbeddingCollection(tables=configs)
        tables = module.embeddings
    with torch.no_grad():
        for table in spec.tables:
            weight = tables[table.name].weight
            weight.copy_(torch.randn(weight.shape, generator=generator))
    return module


def quantized(spec: QuantSpec, module: torch.nn.Module) -> torch.nn.Module:
    from torch.ao import quantization as quant
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.quant import embedding_modules as qmodules

    split = getattr(qmodules, "quant_prep_enable_quant_state_dict_split_scale_bias_for_types", None)
    if split is None:
        raise UnsupportedByTorchrec("this torchrec cannot split a quantized table's scale and bias out of its state dict")
    float_type = EmbeddingBagCollection if spec.pooled else EmbeddingCollection
    split(module, [float_type])
    per_table = {t.name: TORCH_WEIGHT_DTYPES[t.kind] for t in spec.tables}
    module.qconfig = qmodules.QuantConfig(
        activation=quant.PlaceholderObserver.with_args(dtype=getattr(torch, spec.output_dtype)),
        weight=quant.PlaceholderObserver.with_args(dtype=torch.qint8),
        per_table_weight_dtype=per_table,
    )
    quant_type = qmodules.EmbeddingBagCollection if spec.pooled else qmodules.EmbeddingCollection
    return quant_type.from_float(module)


@contextlib.contextmanager
def devices_propagated() -> Iterator[None]:
    """Inference lookups are placed on "cuda" unless torchrec is told to follow the sharding's device
    type; a process-wide setting, restored afterwards."""
    try:
        from torchrec.distributed import global_settings
    except ImportError as exc:
        raise UnsupportedByTorchrec(f"this torchrec has no global_settings to place inference lookups on CPU: {exc}") from exc
    if not hasattr(global_settings, "set_propogate_device"):
        raise UnsupportedByTorchrec("this torchrec cannot place inference lookups on CPU (no set_propogate_device)")
    before = global_settings.get_propogate_device()
    global_settings.set_propogate_device(True)
    try:
        yield
    finally:
        global_settings.set_propogate_device(before)


def _generator(table: QuantTable) -> Any:
    from torchrec.distributed import sharding_plan as sp

    kind, _, ranks = table.placement.partition(":")
    if kind == "tw":
        return sp.table_wise(rank=int(ranks))
    if kind == "rw":
        return sp.row_wise(sizes_placement=([int(n) for n in ranks.split(",")], "cpu")) if ranks else sp.row_wise()
    if kind == "cw":
        return sp.column_wise(ranks=[int(r) for r in ranks.split(",")])
    raise HarnessError(f"table {table.name}: unknown placement {table.placement!r}")


def sharder(spec: QuantSpec) -> Any:
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS

    fused = {FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True}
    if spec.pooled:
        from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder

        return QuantEmbeddingBagCollectionSharder(fused_params=fused)
    from torchrec.distributed.quant_embedding import QuantEmbeddingCollectionSharder

    return QuantEmbeddingCollectionSharder(fused_params=fused)


def sharded(spec: QuantSpec, quant: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``quant`` sharded on CPU by the spec's plan, loaded from ``quant``'s state dict."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.inference.modules import shard_quant_model

    the_sharder = sharder(spec)
    plan_of_module = construct_module_sharding_plan(
        quant, per_param_sharding={t.name: _generator(t) for t in spec.tables}, local_size=spec.world_size,
        world_size=spec.world_size, device_type="cpu", sharder=the_sharder)
    plan = ShardingPlan({MODULE_PATH: plan_of_module})
    model, _ = shard_quant_model(Holder(copy.deepcopy(quant)), world_size=spec.world_size, compute_device="cpu",
                                 sharding_device="cpu", sharders=[the_sharder], sharding_plan=plan)
    model.load_state_dict(Holder(quant).state_dict())
    return getattr(model, MODULE_PATH)


def features(spec: QuantSpec) -> Any:
    """The case's batch as a KJT, in feature order (lengths per feature, then per sample)."""
    from torchrec import KeyedJaggedTensor

    ids = [i for feature in spec.bags for bag in feature for i in bag]
    lengths = [len(bag) for feature in spec.bags for bag in feature]
    weights = None
    if spec.weights is not None:
        weights = torch.tensor([w for feature in spec.weights for bag in feature for w in bag], dtype=torch.float32)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(spec.features), values=torch.tensor(ids, dtype=torch.int64),
                                               lengths=torch.tensor(lengths, dtype=torch.int64), weights=weights)
