"""How a sharded run asks torchrec to run it, beyond the plan: options of DistributedModelParallel and
of torchrec's collectives that must not change the numbers the unsharded reference computes.

    DmpOptions(sync_collectives=True)                 # torchrec_use_sync_collectives: the *_sync collectives
    DmpOptions(gradient_division=False)               # set_gradient_division(False): gradients summed, not averaged
    DmpOptions(hyper_parameters=({"lr": 0.1}, {"lr": 0.05, "eps": 1e-3}, ...))   # one per step
    DmpOptions(qcomm=QComm("fp16", "fp16"))           # quantized communication (bound: codec_tolerance)
    DmpOptions(meta_model=True)                       # built on the meta device, DMP's init_parameters
    DmpOptions(init_data_parallel=False)              # DDP wrapped later by dmp.init_data_parallel()
    DmpOptions(copy=True)                             # train dmp.copy(device), not the DMP itself
    DmpOptions(dense_from_bare=True)                  # the dense optimizer over dmp.bare_named_parameters()
    DmpOptions(reshard=Reshard(before_step=2, plan=new_plan))   # DMP.reshard to another placement mid-run
    DmpOptions(ec_index_dedup=True)                   # set_ec_index_dedup (fbgemm's CPU build cannot run it)
    DmpOptions(plan_by_dmp=True)                      # DMP given no plan: it plans itself (collective_plan)
    DmpOptions(debug_checks=True)                     # TORCHREC_VALIDATE_COLLECTIVES=1, TORCHREC_OVERFLOW_DEBUG=1

Everything here is resolved in the caller (``check``: a HarnessError before any rank runs) and pickles to
the ranks. The rank side (``on_rank``, ``sharded``, ``before_step``, ``after_step``) is called by
``training.train_on_rank``; the reference side (``reference_step``) by ``reference.train_reference``.
torchrec's process-wide switches are set for one call and restored after it: a rank pool is reused.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from paritykit.engine.resharding import reshard
from paritykit.errors import HarnessError, ParityError
from paritykit.harness.dmp import dense_parameters

# The hyper-parameters fbgemm's update_hyper_parameters takes that the reference's optimizers share.
HYPER_PARAMETERS = ("lr", "eps")
CODEC_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class QComm:
    """torchrec's QCommsConfig by precision name, for the forward and the backward communication."""

    forward: str = "fp16"
    backward: str = "fp16"
    # fbgemm's codecs multiply by it before encoding and divide after decoding (FP16/BF16 only).
    backward_loss_scale: float | None = None


@dataclass(frozen=True)
class Reshard:
    """Before step ``before_step``, every sharded module moves to ``plan`` (a resolved ShardingPlan) by
    DistributedModelParallel.reshard with the delta torchrec's own ``output_sharding_plans_delta`` computes."""

    before_step: int
    plan: Any = field(hash=False)


@dataclass(frozen=True)
class DmpOptions:
    sync_collectives: bool = False
    gradient_division: bool | None = None  # None: whatever torchrec's switch says in the caller
    hyper_parameters: tuple[Mapping[str, float], ...] = field(default=(), hash=False)
    qcomm: QComm | None = None
    meta_model: bool = False
    init_data_parallel: bool = True
    copy: bool = False
    dense_from_bare: bool = False
    reshard: Reshard | None = None
    ec_index_dedup: bool = False
    # A plain nn.EmbeddingBag is sharded by torchrec's EmbeddingBagSharder, which is not among the
    # default sharders and takes its optimizer from these fused params (not from the parameter).
    embedding_bag_fused_params: tuple[tuple[str, Any], ...] | None = None
    # DMP is given no plan and plans itself as the tutorial's users let it (EmbeddingShardingPlanner's
    # collective_plan: rank 0 plans, the plan is broadcast). The run's plan is then what the planner
    # makes in the caller for the same topology and sharders (dmp_planned), which the ranks' must equal.
    # On CPU ranks it is given no device either (its documented default is the CPU).
    plan_by_dmp: bool = False
    # The EBC/EC sharders given torchrec's use_one_tbe_per_table fused param: each table its own TBE
    # (kernel) where torchrec would group a rank's tables into one, so a rank's lookups are merged.
    one_tbe_per_table: bool = False
    # torchrec's runtime debug checks, as their environment variables turn them on: every splits
    # all-to-all carries a tag of what it exchanges, checked on arrival (TORCHREC_VALIDATE_COLLECTIVES),
    # and the splits are checked for int32 overflow (TORCHREC_OVERFLOW_DEBUG). Neither may change a number.
    debug_checks: bool = False

    def check(self, steps: int, embedding_optimizer: str) -> None:
        """HarnessError naming the option at fault, before any rank runs."""
        from torchrec.distributed import comm_ops, embedding

        if self.sync_collectives and not hasattr(comm_ops, "set_use_sync_collectives"):
            raise HarnessError("sync_collectives: this torchrec has no comm_ops.set_use_sync_collectives")
        if self.ec_index_dedup and not hasattr(embedding, "set_ec_index_dedup"):
            raise HarnessError("ec_index_dedup: this torchrec has no torchrec.distributed.embedding.set_ec_index_dedup")
        if self.hyper_parameters and len(self.hyper_parameters) != steps:
            raise HarnessError(f"hyper_parameters: one entry per step ({steps}), got {len(self.hyper_parameters)}")
        for step, entry in enumerate(self.hyper_parameters):
            unknown = sorted(set(entry) - set(HYPER_PARAMETERS))
            if unknown or "lr" not in entry:
                raise HarnessError(f"hyper_parameters[{step}]: give 'lr' and at most {HYPER_PARAMETERS}; got {sorted(entry)}")
            if "eps" in entry and embedding_optimizer == "sgd":
                raise HarnessError(f"hyper_parameters[{step}]: sgd has no eps")
        if self.debug_checks:
            from torchrec.distributed import collective_utils

            if not hasattr(collective_utils, "validate_collectives_enabled"):
                raise HarnessError("debug_checks: this torchrec has no collective validation (TORCHREC_VALIDATE_COLLECTIVES)")
        if self.one_tbe_per_table:
            from torchrec.distributed import embedding_sharding

            if not hasattr(embedding_sharding, "USE_ONE_TBE_PER_TABLE"):
                raise HarnessError("one_tbe_per_table: this torchrec's table grouping has no use_one_tbe_per_table")
        if self.qcomm is not None:
            for name in (self.qcomm.forward, self.qcomm.backward):
                if name not in CODEC_PRECISIONS:
                    raise HarnessError(f"qcomm: precision {name!r} is not one of {sorted(CODEC_PRECISIONS)}")
        if self.reshard is not None and not 0 < self.reshard.before_step < steps:
            raise HarnessError(f"reshard.before_step must fall between two steps (1..{steps - 1}), got {self.reshard.before_step}")

    def describe(self) -> str:
        parts = [name for name in ("sync_collectives", "meta_model", "copy", "dense_from_bare", "ec_index_dedup", "plan_by_dmp",
                                   "one_tbe_per_table", "debug_checks")
                 if getattr(self, name)]
        parts += [] if self.gradient_division is None else [f"gradient_division={self.gradient_division}"]
        parts += [] if self.init_data_parallel else ["init_data_parallel=False"]
        parts += [f"hyper_parameters={[dict(e) for e in self.hyper_parameters]}"] if self.hyper_parameters else []
        parts += [f"qcomm={self.qcomm.forward}/{self.qcomm.backward}"] if self.qcomm else []
        parts += [f"reshard@{self.reshard.before_step}"] if self.reshard else []
        parts += ["EmbeddingBagSharder"] if self.embedding_bag_fused_params is not None else []
        return " ".join(parts) or "defaults"

    # -- the rank side --------------------------------------------------------------------------

    @contextlib.contextmanager
    def on_rank(self) -> Iterator[None]:
        """torchrec's process-wide switches for one call, restored after it (the pool is reused)."""
        from torchrec.distributed import comm_ops, embedding

        saved = comm_ops.get_use_sync_collectives(), comm_ops.get_gradient_division(), embedding.get_ec_index_dedup()
        with contextlib.ExitStack() as stack:
            if self.sync_collectives:
                # torchrec's own context manager where it has one (it restores the switch itself).
                switch = getattr(comm_ops, "torchrec_use_sync_collectives", None)
                if switch is not None:
                    stack.enter_context(switch())
                else:
                    comm_ops.set_use_sync_collectives(True)
            if self.debug_checks:
                stack.enter_context(torchrec_debug_checks())
            yield from self._switched(saved)

    def _switched(self, saved: tuple[bool, bool, bool]) -> Iterator[None]:
        import warnings

        from torchrec.distributed import comm_ops, embedding

        try:
            if self.gradient_division is not None:
                comm_ops.set_gradient_division(self.gradient_division)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the switch is deprecated, not gone
                embedding.set_ec_index_dedup(self.ec_index_dedup or saved[2])
            yield
        finally:
            comm_ops.set_use_sync_collectives(saved[0])
            comm_ops.set_gradient_division(saved[1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                embedding.set_ec_index_dedup(saved[2])

    def sharded(self, build: Callable[[], nn.Module], sharding_plan: Any, device: torch.device) -> nn.Module:
        """The model from ``build()`` (on the meta device if asked) in DistributedModelParallel with these options."""
        import torch.distributed as dist
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        model = _on_meta(build()) if self.meta_model else build()
        given_device = None if self.plan_by_dmp and device.type == "cpu" else device
        dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=given_device,
                                       plan=None if self.plan_by_dmp else sharding_plan, sharders=self._sharders(device),
                                       init_data_parallel=self.init_data_parallel, init_parameters=True)
        if self.plan_by_dmp:
            _require_same_plan(dmp.plan, sharding_plan)
        if self.debug_checks:
            _require_validation_on()
        if not self.init_data_parallel:
            dmp.init_data_parallel()
            dmp.init_data_parallel()  # documented as safe to call again
        return dmp

    def trained(self, dmp: nn.Module, device: torch.device) -> nn.Module:
        """The module the steps train: ``dmp`` or its copy."""
        return dmp.copy(device) if self.copy else dmp

    def dense_parameters(self, dmp: nn.Module) -> dict[str, nn.Parameter]:
        return dense_parameters(dmp, bare=self.dense_from_bare)

    def before_step(self, dmp: nn.Module, step: int) -> None:
        if self.reshard is not None and step == self.reshard.before_step:
            reshard(dmp, self.reshard.plan)
        if self.hyper_parameters:
            _set_fused_hyper_parameters(dmp.fused_optimizer, self.hyper_parameters[step], step)

    def after_step(self, dmp: nn.Module) -> None:
        if self.hyper_parameters:
            # What a user's loop does with a CombinedOptimizer; a fused step only sets the learning rate.
            dmp.fused_optimizer.step()

    def _sharders(self, device: torch.device) -> list[Any]:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.sharding_plan import get_default_sharders

        sharders = get_default_sharders()
        if self.embedding_bag_fused_params is not None:
            from torchrec.distributed.embeddingbag import EmbeddingBagSharder

            sharders.append(EmbeddingBagSharder(fused_params=dict(self.embedding_bag_fused_params)))
        if self.qcomm is None and not self.one_tbe_per_table:
            return sharders
        options: dict[str, Any] = {}
        if self.one_tbe_per_table:
            from torchrec.distributed.embedding_sharding import USE_ONE_TBE_PER_TABLE

            options["fused_params"] = {USE_ONE_TBE_PER_TABLE: True}
        if self.qcomm is not None:
            from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

            options["qcomm_codecs_registry"] = get_qcomm_codecs_registry(
                QCommsConfig(forward_precision=CommType(self.qcomm.forward), backward_precision=CommType(self.qcomm.backward),
                             backward_loss_scale=self.qcomm.backward_loss_scale),
                device=device)
        replacing = [EmbeddingBagCollectionSharder(**options), EmbeddingCollectionSharder(**options)]
        replaced = {sharder.module_type for sharder in replacing}
        return replacing + [sharder for sharder in sharders if sharder.module_type not in replaced]

    # -- the reference side ---------------------------------------------------------------------

    def reference_step(self, embedding_optimizer: Any, step: int) -> None:
        """The same hyper-parameters on the reference's embedding optimizer before step ``step``."""
        if not self.hyper_parameters or embedding_optimizer is None:
            return
        for group in embedding_optimizer.param_groups:
            group.update(self.hyper_parameters[step])


VALIDATE_COLLECTIVES = "TORCHREC_VALIDATE_COLLECTIVES"


@contextlib.contextmanager
def torchrec_debug_checks() -> Iterator[None]:
    """torchrec's debug checks for one call, as a fresh process with TORCHREC_VALIDATE_COLLECTIVES=1 and
    TORCHREC_OVERFLOW_DEBUG=1 sees them. DMP's constructor reads the first once per process (and the
    pool's processes have built DMPs before); dist_data reads the second at its import."""
    from torchrec.distributed import collective_utils, dist_data

    saved = (os.environ.get(VALIDATE_COLLECTIVES), collective_utils._INITIALIZED, collective_utils._USE_COLLECTIVE_VALIDATION,
             getattr(dist_data, "_TORCHREC_OVERFLOW_DEBUG", None))
    os.environ[VALIDATE_COLLECTIVES] = "1"
    collective_utils._INITIALIZED = False
    if saved[3] is not None:
        dist_data._TORCHREC_OVERFLOW_DEBUG = True
    try:
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(VALIDATE_COLLECTIVES, None)
        else:
            os.environ[VALIDATE_COLLECTIVES] = saved[0]
        collective_utils._INITIALIZED, collective_utils._USE_COLLECTIVE_VALIDATION = saved[1], saved[2]
        if saved[3] is not None:
            dist_data._TORCHREC_OVERFLOW_DEBUG = saved[3]


def _require_validation_on() -> None:
    """DistributedModelParallel's constructor turns collective validation on where the variable says so."""
    from torchrec.distributed import collective_utils

    if not collective_utils.validate_collectives_enabled():
        raise ParityError(f"{VALIDATE_COLLECTIVES}=1, yet DistributedModelParallel left collective validation off "
                          "(collective_utils.validate_collectives_enabled() is False after its constructor)")


def _on_meta(model: nn.Module) -> nn.Module:
    """The model as a user builds it on the meta device: the same modules, every tensor on meta, the
    tables still marked with their in-backward optimizer (``Module.to`` makes new parameters)."""
    marks = {name: dict(vars(param)) for name, param in model.named_parameters()}
    model = model.to("meta")
    for name, param in model.named_parameters():
        for key, value in marks[name].items():
            setattr(param, key, value)
    return model


def dmp_planned(model: nn.Module, world_size: int, ranks_per_host: int, device: str) -> Any:
    """The plan DistributedModelParallel makes when given none, made in the caller: its planner
    (EmbeddingShardingPlanner on a Topology of the run's world size, hosts and device) over the default
    sharders. No rank has run; the ranks' own plan must come out the same (``_require_same_plan``)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from paritykit.harness.noise import quiet_planner

    with quiet_planner():
        topology = Topology(world_size=world_size, local_world_size=ranks_per_host, compute_device=device)
        return EmbeddingShardingPlanner(topology=topology).plan(model, get_default_sharders())


def _require_same_plan(actual: Any, expected: Any) -> None:
    """ParityError naming each table whose placement in DMP's own plan is not the planner's."""
    from paritykit.harness.plans import placements_of

    got, wanted = placements_of(actual), placements_of(expected)
    problems = [f"{module or '<root>'}.{table}: DMP planned {got.get((module, table))}, the planner {wanted.get((module, table))}"
                for module, table in sorted(set(got) | set(wanted)) if got.get((module, table)) != wanted.get((module, table))]
    if problems:
        raise ParityError("DistributedModelParallel given no plan (collective_plan) placed tables otherwise than "
                          "EmbeddingShardingPlanner.plan for the same topology and sharders:\n  " + "\n  ".join(problems))


def _set_fused_hyper_parameters(fused: Any, entry: Mapping[str, float], step: int) -> None:
    """A user's two ways: even steps through ``param_groups`` (a scheduler's way; ``zero_grad`` hands the
    learning rate to the kernels), odd steps through ``update_hyper_parameters``. ``eps`` has only the
    second way (zero_grad passes the learning rate alone), and so it goes that way every time."""
    if step % 2 == 0:
        for group in fused.param_groups:
            group["lr"] = entry["lr"]
        fused.zero_grad()
        rest = {key: value for key, value in entry.items() if key != "lr"}
        if rest:
            fused.update_hyper_parameters(rest)
    else:
        fused.update_hyper_parameters(dict(entry))
        # Keep the groups in step with the kernels, or the next step() would hand back the old rate.
        for group in fused.param_groups:
            group["lr"] = entry["lr"]
