"""The embedding configs and the unsharded modules' construction, against what they mean:

- every table DataType converts to the torch dtype whose conversion back is that DataType; its width
  (``DATA_TYPE_NUM_BITS``) is torch's width of that dtype and fbgemm's bit rate of the SparseType it
  converts to, which is a float type exactly when the dtype is; other dtypes are refused;
- a PoolingType converts to fbgemm's PoolingMode of its name (MEAN under a row-wise or table-row-wise
  sharding to SUM: the module divides afterwards, which the sharding check compares) and to the
  name nn.EmbeddingBag takes; NONE has no such name;
- an EBC or EC refuses two tables of one name, an EC tables of different widths, naming the table; a
  ManagedCollisionCollection a remapper whose slots are not its table's rows (more or fewer), naming the table;
  a table given no feature names is looked up by its own name; a table's ``init_fn`` sets its
  weight at construction and again at ``reset_parameters`` (a module on the meta device keeps none);
- a virtual table's eviction policy left without an inference setting takes the training one (one
  collecting feature scores itself starts from an empty mapping), and its metadata header is 16 bytes
  (id, timestamp, count) in elements of the table's type.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.errors import expect


def _torch_bits(dtype: torch.dtype) -> int | None:
    """torch's width of a dtype in bits; None for the quantized ones (iinfo gives a packed one's byte)."""
    if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4):
        return None
    if dtype.is_floating_point:
        return torch.finfo(dtype).bits
    try:
        return torch.iinfo(dtype).bits
    except TypeError:
        return None


def data_types_convert() -> dict[str, Any]:
    from torchrec.modules import embedding_configs as configs
    from torchrec.types import DataType

    widths = 0
    for data_type in DataType:
        dtype = configs.data_type_to_dtype(data_type)
        back = configs.dtype_to_data_type(dtype)
        expect(back == data_type, f"data_type_to_dtype({data_type}) = {dtype}, which dtype_to_data_type takes back to {back}")
        bits = configs.DATA_TYPE_NUM_BITS.get(data_type)
        if bits is None:
            continue  # an id type (INT32, INT64): no table holds it, no width listed
        torch_bits = _torch_bits(dtype)
        expect(torch_bits in (None, bits), f"DATA_TYPE_NUM_BITS[{data_type}] = {bits}, torch's {dtype} is {torch_bits} bits")
        sparse = configs.data_type_to_sparse_type(data_type)
        expect(sparse.bit_rate() == bits, f"data_type_to_sparse_type({data_type}) = {sparse}, {sparse.bit_rate()} bits, not {bits}")
        expect(sparse.as_dtype().is_floating_point == dtype.is_floating_point,
                f"data_type_to_sparse_type({data_type}) = {sparse} ({sparse.as_dtype()}), of another kind than {dtype}")
        widths += 1
    for alias, data_type in ((torch.half, DataType.FP16), (torch.long, DataType.INT64), (torch.int, DataType.INT32),
                             (torch.qint8, DataType.INT8), (torch.quint8, DataType.INT8)):
        found = configs.dtype_to_data_type(alias)
        expect(found == data_type, f"dtype_to_data_type({alias}) = {found}, expected {data_type} (the same width and kind)")
    for foreign in (torch.bool, torch.complex64, torch.float64):
        expect(_refuses(lambda foreign=foreign: configs.dtype_to_data_type(foreign)) is not None,
                f"dtype_to_data_type({foreign}) gave a table DataType; no table holds {foreign}")
    return {"data_types": len(DataType), "widths": widths}


def _refuses(call: Callable[[], Any]) -> str | None:
    """The words of the exception ``call`` raises; None when it returns."""
    try:
        call()
    except Exception as exc:  # torchrec raises bare Exception for some refusals
        return str(exc) or type(exc).__name__
    return None


def _named(mode: Any) -> str:
    """fbgemm's PoolingMode prints as its number."""
    return f"PoolingMode.{mode.name}" if hasattr(mode, "name") else repr(mode)


def poolings_convert() -> dict[str, Any]:
    from torchrec.modules import embedding_configs as configs
    from torchrec.modules.embedding_configs import PoolingMode, PoolingType
    from torchrec.distributed.types import ShardingType

    divided_after = {ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE}
    pairs = 0
    for pooling in PoolingType:
        for sharding in (None, *ShardingType):
            mode = configs.pooling_type_to_pooling_mode(pooling, sharding)
            expected = PoolingMode.SUM if pooling == PoolingType.MEAN and sharding in divided_after else PoolingMode[pooling.name]
            expect(mode == expected, f"pooling_type_to_pooling_mode({pooling}, {sharding}) = {_named(mode)}, expected {_named(expected)}")
            pairs += 1
        if pooling == PoolingType.NONE:
            expect(_refuses(lambda: configs.pooling_type_to_str(pooling)) is not None,
                    "pooling_type_to_str(PoolingType.NONE) named a pooling; nn.EmbeddingBag has none for it")
            continue
        name = configs.pooling_type_to_str(pooling)
        expect(name == pooling.name.lower(), f"pooling_type_to_str({pooling}) = {name!r}, nn.EmbeddingBag calls it {pooling.name.lower()!r}")
    return {"pairs": pairs}


def _config(kind: str, name: str, dim: int = 4, features: list[str] | None = None, init_fn: Any = None) -> Any:
    """A table of 5 rows for an EBC ("ebc": EmbeddingBagConfig) or an EC (EmbeddingConfig)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

    make = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    return make(name=name, num_embeddings=5, embedding_dim=dim, feature_names=[f"f_{name}"] if features is None else features,
                init_fn=init_fn)


def _module(kind: str, tables: list[Any], device: str = "cpu") -> Any:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    make = EmbeddingBagCollection if kind == "ebc" else EmbeddingCollection
    return make(tables=tables, device=torch.device(device))


def construction_refusals() -> dict[str, Any]:
    for kind in ("ebc", "ec"):
        words = _refuses(lambda: _module(kind, [_config(kind, "t_dup"), _config(kind, "t_other"), _config(kind, "t_dup")]))
        expect(words is not None and "t_dup" in words, f"{kind} with two tables named 't_dup': {words or 'built'}")
    words = _refuses(lambda: _module("ec", [_config("ec", "t_a", 4), _config("ec", "t_b", 8)]))
    expect(words is not None and all(part in words for part in ("t_b", "8", "4")),
            f"ec with tables of 4 and 8 columns: {words or 'built'}; expected a refusal naming 't_b' and both widths")
    for zch_size in (7, 3):  # a remapper's ids past the table's rows, or some of its rows never reached
        words = _refuses(lambda zch_size=zch_size: _managed(zch_size, rows=5))
        expect(words is not None and "t_mc" in words,
               f"a managed collision collection of a table of 5 rows remapped into {zch_size} slots: {words or 'built'}; "
               "expected a refusal naming the table")
    _managed(5, rows=5)  # the remapper's slots the table's rows: built
    return {"refusals": 5}


def _managed(zch_size: int, rows: int) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    remapper = MCHManagedCollisionModule(zch_size=zch_size, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(),
                                         eviction_interval=1)
    return ManagedCollisionCollection(managed_collision_modules={"t_mc": remapper},
                                      embedding_configs=[EmbeddingConfig(name="t_mc", num_embeddings=rows, embedding_dim=4, feature_names=["f_mc"])])


def _filled(weight: torch.Tensor) -> None:
    """An init_fn: each element its index over 7."""
    with torch.no_grad():
        weight.copy_(torch.arange(weight.numel(), dtype=weight.dtype).view_as(weight) / 7)


def _weights(module: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def init_fn_and_reset() -> dict[str, Any]:
    for kind in ("ebc", "ec"):
        module = _module(kind, [_config(kind, "t_init", init_fn=_filled), _config(kind, "t_plain")])
        expected = torch.empty(5, 4)
        _filled(expected)
        for moment in ("at construction", "after reset_parameters"):
            initialized = {name: w for name, w in _weights(module).items() if ".t_init." in name}
            expect(len(initialized) == 1 and all(torch.equal(w, expected) for w in initialized.values()),
                    f"{kind} table 't_init' {moment}: its weight is not what its init_fn sets ({list(initialized)})")
            with torch.no_grad():
                for p in module.parameters():
                    p.fill_(-1.0)
            module.reset_parameters()
        meta = _module(kind, [_config(kind, "t_init", init_fn=_filled)], device="meta")
        meta.reset_parameters()
        expect(all(p.is_meta for p in meta.parameters()), f"{kind} on the meta device holds data after reset_parameters")
    return {"modules": 2}


def table_name_as_feature() -> dict[str, Any]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids, lengths = torch.tensor([3, 0, 4]), torch.tensor([2, 1])
    for kind in ("ebc", "ec"):
        module = _module(kind, [_config(kind, "t_named", features=[])])
        weight = next(module.parameters())  # the one table's
        out = module(KeyedJaggedTensor(keys=["t_named"], values=ids, lengths=lengths))
        if kind == "ebc":
            found, expected = out["t_named"], torch.stack([weight[3] + weight[0], weight[4]])
        else:
            found, expected = out["t_named"].values(), weight[ids]
        expect(torch.equal(found.detach(), expected.detach()),
                f"{kind} table 't_named' given no feature names, looked up by its name: {found.tolist()}, expected {expected.tolist()}")
    return {"modules": 2}


def eviction_defaults() -> dict[str, Any]:
    """Each policy built with training settings only: its inference settings are the training ones; a
    set inference setting is kept; the metadata header spans 16 bytes of the table's elements."""
    from torchrec.modules import embedding_configs as configs
    from torchrec.types import DataType

    copies = {  # policy -> (training field, inference field) pairs
        "CountBasedEvictionPolicy": [("eviction_threshold", "inference_eviction_threshold")],
        "TimestampBasedEvictionPolicy": [("eviction_ttl_mins", "inference_eviction_ttl_mins")],
        "CountTimestampMixedEvictionPolicy": [("eviction_threshold", "inference_eviction_threshold"),
                                              ("eviction_ttl_mins", "inference_eviction_ttl_mins")],
        "FeatureL2NormBasedEvictionPolicy": [("eviction_threshold", "inference_eviction_threshold")],
        "FeatureScoreBasedEvictionPolicy": [("eviction_ttl_mins", "inference_eviction_ttl_mins"),
                                            ("training_id_keep_count", "max_inference_id_num_per_rank")],
    }
    checked = 0
    for name, pairs in copies.items():
        policy_type = getattr(configs, name, None)
        if policy_type is None:
            continue  # not in this torchrec
        fields = set(policy_type.__dataclass_fields__)
        for training, inference in pairs:
            if training not in fields:
                continue  # a policy of another torchrec
            # Where the training setting is, its inference counterpart is (both supported stacks have each pair).
            expect(inference in fields, f"{name} has {training} but no {inference}")
            policy = policy_type(**{training: 7})
            expect(getattr(policy, inference) == 7, f"{name}({training}=7).{inference} = {getattr(policy, inference)!r}, expected 7 (the training setting)")
            kept = policy_type(**{training: 7, inference: 3})
            expect(getattr(kept, inference) == 3, f"{name}({training}=7, {inference}=3).{inference} = {getattr(kept, inference)!r}, expected 3")
            checked += 1
    scored = getattr(configs, "FeatureScoreBasedEvictionPolicy", None)
    if scored is not None and {"enable_auto_feature_score_collection", "feature_score_mapping"} <= set(scored.__dataclass_fields__):
        collecting = scored(enable_auto_feature_score_collection=True)
        expect(collecting.feature_score_mapping == {}, "FeatureScoreBasedEvictionPolicy collecting feature scores itself "
                f"holds {collecting.feature_score_mapping!r}, not an empty mapping to collect them into")
        checked += 1
    header = getattr(configs, "VirtualTableEvictionPolicy", None)
    if header is not None and hasattr(header, "init_metaheader_config"):
        for data_type, dim in ((DataType.FP32, 8), (DataType.FP16, 6)):
            policy = header()
            policy.init_metaheader_config(data_type, dim)
            elements = 16 // torch.empty(0, dtype=configs.data_type_to_dtype(data_type)).element_size()
            expect((policy.get_meta_header_len(), policy.get_embedding_dim()) == (elements, dim),
                    f"init_metaheader_config({data_type}, {dim}): header {policy.get_meta_header_len()} elements, "
                    f"dim {policy.get_embedding_dim()}; expected {elements} (16 bytes) and {dim}")
            policy.init_metaheader_config(DataType.INT8, dim + 1)  # once set, kept
            expect(policy.get_embedding_dim() == dim, "init_metaheader_config set the header of an initialized policy again")
            checked += 1
    return {"settings": checked}


CONFIG_CASES: tuple[tuple[str, Callable[[], dict[str, Any]]], ...] = (
    ("configs: table data types convert to torch and fbgemm types of their width and kind", data_types_convert),
    ("configs: pooling types convert to fbgemm's pooling modes and nn.EmbeddingBag's names", poolings_convert),
    ("configs: an EBC/EC refuses tables of one name, an EC tables of different widths, a managed collision collection a "
     "remapper of another size than its table", construction_refusals),
    ("configs: a table's init_fn sets its weight at construction and at reset_parameters", init_fn_and_reset),
    ("configs: a table given no feature names is looked up by its own name", table_name_as_feature),
    ("configs: an eviction policy's inference settings default to its training ones", eviction_defaults),
)
