"""Planted bugs in the torchrec code the DMP cases cover (dmp_cases.py): the synchronous collectives,
gradient division, the fused optimizer's hyper-parameter API, resharding, quantized communication,
the sharded nn.EmbeddingBag and DMP's parameter listing. Registered for the sharding check (plants.py
imports this module); each is shown by tests/test_dmp_plants.py to move torchrec's own numbers and to
be caught. None touches the unsharded reference.
"""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "sharding"


@register("sync-all-to-all-backward-not-divided", check=CHECK)
def sync_all_to_all_backward_not_divided() -> ContextManager[None]:
    """torchrec's synchronous all-to-all (AllToAllSingle, under every *_sync pooled, sequence and
    variable-batch collective) stops dividing the gradient by the world size while division is on."""
    from torchrec.distributed import comm_ops

    def planted(original):
        def backward(ctx, grad):
            result = original(ctx, grad)
            if ctx.gradient_division:
                result[0].mul_(ctx.group_size)
            return result

        return staticmethod(backward)

    return replaced(comm_ops.AllToAllSingle, "backward", planted)


@register("pooled-all-to-all-divides-with-division-off", check=CHECK)
def pooled_all_to_all_divides_with_division_off() -> ContextManager[None]:
    """set_gradient_division(False) is ignored by the pooled all-to-all's backward: table- and
    column-wise gradients are still divided by the world size."""
    import torch.distributed as dist
    from torchrec.distributed import comm_ops

    def planted(original):
        def backward(ctx, *unused):
            result = original(ctx, *unused)
            if not comm_ops.GRADIENT_DIVISION and result[3] is not None:
                result[3].div_(dist.get_world_size(ctx.pg))
            return result

        return staticmethod(backward)

    return replaced(comm_ops.All2All_Pooled_Req, "backward", planted)


@register("fused-hyper-parameters-skip-an-optimizer", check=CHECK)
def fused_hyper_parameters_skip_an_optimizer() -> ContextManager[None]:
    """CombinedOptimizer.update_hyper_parameters passes the new learning rate and eps to every one of
    its optimizers but the last: one group of fused tables keeps training at the old ones."""
    from torchrec.optim.keyed import CombinedOptimizer

    def planted(original):
        def update_hyper_parameters(self, params_dict):
            for _, opt in self._optims[:-1]:
                if hasattr(opt, "update_hyper_parameters"):
                    opt.update_hyper_parameters(params_dict)

        return update_hyper_parameters

    return replaced(CombinedOptimizer, "update_hyper_parameters", planted)


@register("reshard-drops-optimizer-state", check=CHECK)
def reshard_drops_optimizer_state() -> ContextManager[None]:
    """Resharding moves the tables but not their optimizer state: the resharded tables restart Adagrad
    from zero (the state received and kept locally is never copied into the new shards)."""
    from torchrec.distributed.sharding import dynamic_sharding

    return replaced(dynamic_sharding, "_update_optimizer_state_post_resharding", lambda original: lambda *a, **k: None)


@register("qcomm-backward-loss-scale-not-undone", check=CHECK)
def qcomm_backward_loss_scale_not_undone() -> ContextManager[None]:
    """torchrec builds the backward codec of quantized communication so that its decoder does not undo
    the loss scale its encoder applied: gradients of sharded tables arrive scaled."""
    from torchrec.distributed import fbgemm_qcomm_codec

    def planted(original):
        def get_qcomm_codecs(config):
            codecs = original(config)
            backward = codecs.backward
            scale = getattr(backward, "_loss_scale", None)
            if scale is not None:
                decode = backward.decode
                backward.decode = lambda tensor, ctx=None: decode(tensor, ctx) * scale
            return codecs

        return get_qcomm_codecs

    return replaced(fbgemm_qcomm_codec, "get_qcomm_codecs", planted)


@register("sharded-embedding-bag-drops-weights", check=CHECK)
def sharded_embedding_bag_drops_weights() -> ContextManager[None]:
    """A sharded nn.EmbeddingBag pools every id with weight 1, ignoring its per_sample_weights."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBag

    def planted(original):
        def input_dist(self, ctx, input, offsets=None, per_sample_weights=None):
            return original(self, ctx, input, offsets, None)

        return input_dist

    return replaced(ShardedEmbeddingBag, "input_dist", planted)


@register("bare-named-parameters-only-sharded", check=CHECK)
def bare_named_parameters_only_sharded() -> ContextManager[None]:
    """DistributedModelParallel.bare_named_parameters lists the sharded modules' parameters only: an
    optimizer built over it never trains the dense layers."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    def planted(original):
        def bare_named_parameters(self, prefix="", recurse=True):
            sharded = set(DistributedModelParallel._sharded_parameter_names(self.module))
            for name, param in original(self, prefix, recurse):
                if name in sharded or "embedding" in name:
                    yield name, param

        return bare_named_parameters

    return replaced(DistributedModelParallel, "bare_named_parameters", planted)


@register("all-gather-backward-not-divided", check=CHECK)
def all_gather_backward_not_divided() -> ContextManager[None]:
    """The pooled all-gather's backward (its reduce-scatter of the gradients) stops dividing by the world
    size although gradient division is on."""
    import torch.distributed as dist
    from torchrec.distributed import comm_ops

    def planted(original):
        def backward(ctx, *unused):
            result = original(ctx, *unused)
            if comm_ops.GRADIENT_DIVISION:
                result[3].mul_(dist.get_world_size(ctx.pg))
            return result

        return staticmethod(backward)

    return replaced(comm_ops.AllGatherBase_Req, "backward", planted)
