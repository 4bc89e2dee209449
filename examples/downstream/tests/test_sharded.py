"""Our embedding tables sharded over two ranks give the unsharded model's output."""

import pytest
import torch

import paritykit


def sharded_matches_unsharded_on_rank():
    """Runs on every rank of the pool: shard the model's EBC table-wise, copy weights, compare."""
    import torch.distributed as dist
    from torchrec.distributed import ShardingEnv
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.shard import shard
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_model import RankingModel

    model = RankingModel(seed=11)
    plan = construct_module_sharding_plan(
        model.sparse, {"history": table_wise(rank=0), "tags": table_wise(rank=1)},
        world_size=dist.get_world_size(), device_type="cpu", sharder=EmbeddingBagCollectionSharder(),
    )
    sharded = shard(model.sparse, plan, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"))
    full = model.sparse.state_dict()
    for name, value in sharded.state_dict().items():
        for local in value.local_shards():
            rows, cols = local.metadata.shard_offsets
            height, width = local.metadata.shard_sizes
            local.tensor.copy_(full[name][rows : rows + height, cols : cols + width])
    batch = KeyedJaggedTensor.from_lengths_sync(
        ["user_history", "item_tags"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([2, 1, 1, 1])
    )
    sharded_output = sharded(batch).wait()
    paritykit.assert_close(sharded_output, model.sparse(batch), msg=f"rank {dist.get_rank()}")
    return sharded_output.values().shape


@pytest.mark.world_size(2)
def test_table_wise_sharding_matches_the_unsharded_model(rank_pool):
    shapes = rank_pool.run(sharded_matches_unsharded_on_rank)
    assert shapes == [torch.Size([2, 16]), torch.Size([2, 16])]
