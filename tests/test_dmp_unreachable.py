"""What the DMP block leaves to a GPU, checked on the installed CPU stack so that the entries of
paritykit/gate/coverage_unreachable.toml go stale loudly: the day one of these runs on CPU, its entry
must go and a comparison take its place."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_dmp_collection_refuses_a_cpu_device_before_anything_else():
    model_parallel = pytest.importorskip("torchrec.distributed.model_parallel")
    collection = getattr(model_parallel, "DMPCollection", None)
    if collection is None:
        pytest.skip("this torchrec has no DMPCollection")
    with pytest.raises(AssertionError, match="CUDA or MTIA"):
        collection(module=nn.Linear(1, 1), device=torch.device("cpu"), plan=None, world_size=2, sharding_group_size=1,
                   global_pg=None)


def test_ec_index_dedup_has_no_cpu_kernel_in_fbgemm():
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm

    offsets = torch.tensor([0, 2])
    with pytest.raises(NotImplementedError, match="CPU"):
        torch.ops.fbgemm.jagged_unique_indices(torch.tensor([0, 10]), torch.tensor([0]), offsets, torch.tensor([1, 1]))


def test_the_fused_embedding_collection_refuses_a_cpu_device():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingCollection

    with pytest.raises(AssertionError, match="CUDA, meta"):
        FusedEmbeddingCollection(tables=[EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=4, feature_names=["f0"])],
                                 optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, device=torch.device("cpu"))


def test_nothing_in_torchrec_applies_the_variable_all_to_all():
    from pathlib import Path

    import torchrec

    root = Path(torchrec.__file__).parent
    callers = [path for path in root.rglob("*.py") if "All2Allv_Req.apply" in path.read_text()]
    assert callers == []
