"""What a training pipeline's options promise beyond its numbers, checked on the rank that runs it.

The numbers of these pipelines equal the plain loop's whether or not the option works, so each is held
to the option's own meaning (torchrec's docstrings), with an oracle of paritykit's own:

- **the caller's batches are left alone** unless ``free_features_storage_early`` asks the pipeline to
  free the batch's features: every tensor of every batch equal, bit for bit, to a copy taken before
  the run (on a CPU ``batch.to(cpu)`` is the caller's batch itself, so a pipeline that frees its
  features frees the caller's data);
- ``apply_jit=True`` **scripts the unsharded modules**: every child of a module on the path to a
  sharded module that has no sharded module inside it and that ``torch.jit.script`` accepts (tried
  here on the child) has a ``torch.jit.ScriptModule`` of its name in the model after the run; none
  exists without the option;
- ``clear_data_dist_inputs=True`` **frees each input all-to-all's input tensors** once sent: every
  input tensor a ``KJTAllToAllTensorsAwaitable`` of the run held has no storage left after the run
  (2+ ranks; on one rank torchrec sends nothing);
- **the sharded modules a pipeline pipelines** (their forward replaced by torchrec's pipelined
  forward) and the post-processing modules it runs in its data-dist stage (swapped for a
  ``PipelinedPostproc`` in the model) are those the model declares in
  ``pipelined_modules(pipeline_postproc)`` (a model without it is not checked): a module behind a
  post-processing module is pipelined only with ``pipeline_postproc=True``, and then the
  post-processing module is swapped too (left in place, it would run a second time in the forward).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from paritykit.errors import ParityError


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a batch holds (KJTs, TensorDicts, dataclasses, dicts, lists), in a fixed order."""
    if isinstance(value, torch.Tensor):
        # A TensorDict batch's jagged features are nested tensors: compared by their parts.
        return [value.values(), value.offsets()] if value.is_nested else [value]
    if hasattr(value, "values") and hasattr(value, "lengths") and callable(getattr(value, "lengths")):
        weights = value.weights_or_none() if hasattr(value, "weights_or_none") else None
        return [value.values(), value.lengths()] + ([weights] if weights is not None else [])
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for name in value.__dataclass_fields__ for t in _tensors(getattr(value, name))]
    if hasattr(value, "__dict__"):
        return [t for name in sorted(vars(value)) for t in _tensors(vars(value)[name])]
    return []


class BatchGuard:
    """Copies of the caller's batches, to show after the run that the pipeline left them alone."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.copies = [[t.detach().clone() for t in _tensors(batch)] for batch in batches]

    def assert_intact(self, label: str) -> None:
        for step, (batch, kept) in enumerate(zip(self.batches, self.copies)):
            now = _tensors(batch)
            for index, (tensor, before) in enumerate(zip(now, kept)):
                if tensor.untyped_storage().nbytes() == 0 and before.numel() > 0:
                    raise ParityError(f"{label}: the caller's batch {step} lost its data (tensor {index} freed) "
                                      "though the pipeline was not asked to free features (free_features_storage_early)")
                if not torch.equal(tensor, before):
                    raise ParityError(f"{label}: the caller's batch {step} changed (tensor {index})")


def _holds_sharded(module: torch.nn.Module) -> bool:
    from torchrec.distributed.types import ShardedModule

    return any(isinstance(m, ShardedModule) for m in module.modules())


def scriptable_dense_children(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """fqn -> child, for every child without a sharded module inside, of a module that holds one."""
    from torchrec.distributed.types import ShardedModule

    found: dict[str, torch.nn.Module] = {}

    def walk(module: torch.nn.Module, path: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, ShardedModule):
                continue
            if _holds_sharded(child):
                walk(child, f"{path}{name}.")
            else:
                found[f"{path}{name}"] = child

    walk(model, "")
    return found


def assert_scripted(model: torch.nn.Module, apply_jit: bool, label: str) -> None:
    """apply_jit's meaning: each unsharded child that TorchScript accepts has a scripted module of its
    name in the model after the run (and none exists without the option). Where, is not asked: under
    DMP with DDP torchrec 1.8 registers its scripted graph beside the module the forward runs
    (docs/pipeline.md)."""
    scripted = [fqn for fqn, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
    if not apply_jit:
        if scripted:
            raise ParityError(f"{label}: modules scripted without apply_jit: {sorted(scripted)}")
        return
    missed = []
    for fqn, child in scriptable_dense_children(getattr(model, "module", model)).items():
        if any(name == fqn or name.endswith(f".{fqn}") for name in scripted):
            continue
        try:
            torch.jit.script(copy.deepcopy(child))
        except Exception:  # noqa: BLE001 - TorchScript refuses it: torchrec may leave it eager too
            continue
        missed.append(fqn)
    if missed:
        raise ParityError(f"{label}: apply_jit=True scripted none of the unsharded modules {sorted(missed)}")


@contextlib.contextmanager
def recorded_all_to_all_inputs() -> Iterator[list[torch.Tensor]]:
    """Every input tensor a KJTAllToAllTensorsAwaitable is built with while the block runs."""
    from torchrec.distributed.dist_data import KJTAllToAllTensorsAwaitable

    inputs: list[torch.Tensor] = []
    original = KJTAllToAllTensorsAwaitable.__init__

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        inputs.extend(getattr(self, "_input_tensors", []))

    KJTAllToAllTensorsAwaitable.__init__ = recording
    try:
        yield inputs
    finally:
        KJTAllToAllTensorsAwaitable.__init__ = original


def assert_inputs_freed(inputs: list[torch.Tensor], label: str) -> None:
    if not inputs:
        raise ParityError(f"{label}: clear_data_dist_inputs=True on 2+ ranks, but no input all-to-all was recorded")
    kept = [i for i, tensor in enumerate(inputs) if tensor.untyped_storage().nbytes() > 0]
    if kept:
        raise ParityError(f"{label}: clear_data_dist_inputs=True, but {len(kept)} of {len(inputs)} input all-to-all "
                          f"tensors still hold their storage after the run (first: #{kept[0]})")


def pipelined_fqns(model: torch.nn.Module) -> set[str]:
    """The sharded modules whose forward is torchrec's pipelined forward now, and the modules swapped
    for a PipelinedPostproc."""
    from torchrec.distributed.train_pipeline.postproc import PipelinedPostproc
    from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward
    from torchrec.distributed.types import ShardedModule

    inner = getattr(model, "module", model)
    return {fqn for fqn, m in inner.named_modules()
            if (isinstance(m, ShardedModule) and isinstance(m.forward, BaseForward)) or isinstance(m, PipelinedPostproc)}


def declared_pipelined(model: torch.nn.Module, pipeline_postproc: bool) -> set[str] | None:
    """What the model says a pipeline must pipeline, or None when it says nothing."""
    declare = getattr(getattr(model, "module", model), "pipelined_modules", None)
    return None if declare is None else set(declare(pipeline_postproc))


def assert_pipelined(model: torch.nn.Module, expected: set[str], label: str) -> None:
    found = pipelined_fqns(model)
    if found != expected:
        raise ParityError(f"{label}: pipelined modules {sorted(found)}, expected {sorted(expected)} "
                          "(a sharded module left unpipelined runs its input dist inside the forward; a post-processing "
                          "module left unswapped runs again in the forward)")
