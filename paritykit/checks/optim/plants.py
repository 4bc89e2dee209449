"""Planted bugs in torchrec's optimizer wrappers and python optimizers (torchrec/optim/), for the
optim check's negative controls.

The oracle never runs torchrec.optim (torch's optimizers and clipping, the hand-computed schedule,
the row-wise Adagrad rule written out), so each of these moves only torchrec's side.
"""

from __future__ import annotations

from typing import ContextManager

from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "optim"


@register("clip-norm-local-shards-only", check=CHECK)
def clip_norm_local_shards_only() -> ContextManager[None]:
    """Global gradient clipping sums the norms of this rank's shards only (the all-reduce over the
    process groups is skipped): every rank clips by a different, too small norm."""
    import torchrec.optim.clipping as clipping

    def planted(original):
        def local_only(grad_list, max_norm, norm_type=2.0, process_groups=None):
            return original(grad_list, max_norm, norm_type, None)

        return local_only

    return replaced(clipping, "_batch_cal_norm", planted)


@register("clip-coefficient-not-clamped", check=CHECK)
def clip_coefficient_not_clamped() -> ContextManager[None]:
    """Global gradient clipping scales by max_gradient / norm without clamping it at 1: gradients
    whose norm is below the threshold are scaled up to it (a safety net that inflates every step)."""
    import torch
    from torchrec.optim.clipping import GradientClippingOptimizer

    def planted(original):
        def unclamped(self):
            total, grads = self.compute_total_grad_norm()
            torch._foreach_mul_(grads, self._max_gradient / (total + 1e-6))
            return total

        return unclamped

    return replaced(GradientClippingOptimizer, "clip_grad_norm_", planted)


@register("warmup-multiplier-one-step-late", check=CHECK)
def warmup_multiplier_one_step_late() -> ContextManager[None]:
    """WarmupOptimizer sets the learning rate of the iteration before the one about to run."""
    from torchrec.optim.warmup import WarmupOptimizer

    def planted(original):
        def late(self, iter_, stage_id):
            return original(self, max(iter_ - 1, 0), stage_id)

        return late

    return replaced(WarmupOptimizer, "_set_lr", planted)


@register("combined-optimizer-param-groups-copied", check=CHECK)
def combined_optimizer_param_groups_copied() -> ContextManager[None]:
    """CombinedOptimizer hands out copies of its optimizers' param groups: an lr set through it (a
    warm-up, a user's schedule, a loaded checkpoint) never reaches the optimizers."""
    from torchrec.optim.keyed import CombinedOptimizer

    copies = property(lambda self: [dict(group) for _, opt in self._optims for group in opt.param_groups])
    return replaced(CombinedOptimizer, "param_groups", lambda original: copies)


@register("rowwise-adagrad-drops-weight-decay", check=CHECK)
def rowwise_adagrad_drops_weight_decay() -> ContextManager[None]:
    """torchrec's RowWiseAdagrad does not pass weight_decay on to its update."""
    import torchrec.optim.rowwise_adagrad as rowwise

    def planted(original):
        def without_weight_decay(*args, **kwargs):
            return original(*args, **{**kwargs, "weight_decay": 0.0})

        return without_weight_decay

    return replaced(rowwise, "adagrad", planted)


@register("keyed-load-skips-param-groups", check=CHECK)
def keyed_load_skips_param_groups() -> ContextManager[None]:
    """KeyedOptimizer.load_state_dict loads the state but not the saved param groups (their lr)."""
    from torchrec.optim.keyed import KeyedOptimizer

    def planted(original):
        def state_only(self, state_dict):
            saved = self.defaults["_save_param_groups"]
            self.defaults["_save_param_groups"] = False
            try:
                original(self, state_dict)
            finally:
                self.defaults["_save_param_groups"] = saved

        return state_only

    return replaced(KeyedOptimizer, "load_state_dict", planted)


@register("fused-module-rowwise-adagrad-as-adagrad", check=CHECK)
def fused_module_rowwise_adagrad_as_adagrad() -> ContextManager[None]:
    """FusedEmbeddingBagCollection maps torchrec's RowWiseAdagrad to fbgemm's element-wise EXACT_ADAGRAD."""
    import torchrec.modules.fused_embedding_modules as fused_modules
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    def planted(original):
        def convert_optimizer_type_and_kwargs(optimizer_type, optimizer_kwargs):
            converted = original(optimizer_type, optimizer_kwargs)
            if converted is not None and converted[0] == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
                return EmbOptimType.EXACT_ADAGRAD, converted[1]
            return converted

        return convert_optimizer_type_and_kwargs

    return replaced(fused_modules, "convert_optimizer_type_and_kwargs", planted)
@register("rowwise-adagrad-load-recasts-step", check=CHECK)
def rowwise_adagrad_load_recasts_step() -> ContextManager[None]:
    """RowWiseAdagrad.load_state_dict turns every loaded step into a new float32 tensor, whatever dtype
    the checkpoint stored (a float64 step stops counting at 2**24 in float32)."""
    import torch
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    def planted(original):
        def recast_steps(self, state):
            original(self, state)
            for entry in self.state.values():
                entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)

        return recast_steps

    return replaced(RowWiseAdagrad, "__setstate__", planted)


@register("fused-module-init-bounds-ignored", check=CHECK)
def fused_module_init_bounds_ignored() -> ContextManager[None]:
    """FusedEmbeddingBagCollection skips initialising its tables from their configs' weight_init_min/max:
    they keep fbgemm's own initial values (zeros)."""
    import torchrec.modules.fused_embedding_modules as fused_modules

    def planted(original):
        def _init_parameters(self):
            return None

        return _init_parameters

    return replaced(fused_modules._BatchedFusedEmbeddingLookups, "_init_parameters", planted)
