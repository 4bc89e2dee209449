"""The modules check's config cases (checks/modules/config_cases.py): they pass on the installed
torchrec, and each fails on a torchrec changed where it looks (the change monkeypatched in)."""

from __future__ import annotations

import pytest

from paritykit.checks.modules import config_cases
from paritykit.errors import ParityError


@pytest.mark.parametrize("what,body", config_cases.CONFIG_CASES, ids=[what for what, _ in config_cases.CONFIG_CASES])
def test_each_config_case_compares_something_and_passes(what, body):
    metrics = body()
    assert metrics and all(count > 0 for count in metrics.values()), (what, metrics)


def test_a_data_type_converted_to_another_is_caught(monkeypatch):
    import torch
    from torchrec.modules import embedding_configs
    from torchrec.types import DataType

    real = embedding_configs.dtype_to_data_type
    monkeypatch.setattr(embedding_configs, "dtype_to_data_type",
                        lambda dtype: DataType.FP16 if dtype == torch.bfloat16 else real(dtype))
    with pytest.raises(ParityError, match=r"data_type_to_dtype\(BF16\) = torch.bfloat16, which dtype_to_data_type takes back to FP16"):
        config_cases.data_types_convert()


def test_mean_pooling_left_to_a_row_wise_kernel_is_caught(monkeypatch):
    from torchrec.modules import embedding_configs
    from torchrec.modules.embedding_configs import PoolingMode, PoolingType

    real = embedding_configs.pooling_type_to_pooling_mode
    monkeypatch.setattr(embedding_configs, "pooling_type_to_pooling_mode",
                        lambda pooling, sharding=None: PoolingMode.MEAN if pooling == PoolingType.MEAN else real(pooling, sharding))
    with pytest.raises(ParityError, match=r"MEAN, ShardingType.ROW_WISE\) = PoolingMode.MEAN, expected PoolingMode.SUM"):
        config_cases.poolings_convert()


def test_reset_parameters_that_skips_init_fn_is_caught(monkeypatch):
    from torchrec.modules.embedding_modules import EmbeddingCollection

    monkeypatch.setattr(EmbeddingCollection, "reset_parameters", lambda self: None)
    with pytest.raises(ParityError, match="ec table 't_init' after reset_parameters"):
        config_cases.init_fn_and_reset()


def test_an_inference_threshold_left_unset_is_caught(monkeypatch):
    from torchrec.modules.embedding_configs import CountBasedEvictionPolicy

    monkeypatch.setattr(CountBasedEvictionPolicy, "__post_init__", lambda self: None)
    with pytest.raises(ParityError, match=r"CountBasedEvictionPolicy\(eviction_threshold=7\).inference_eviction_threshold = None"):
        config_cases.eviction_defaults()
