"""What torchrec's training pipelines require of a model and its batches, checked before any rank runs.

torchrec's pipelines call ``losses, output = model(batch)``, back-propagate ``torch.sum(losses,
dim=0)`` and return ``output`` from ``progress()``; they move each batch with ``batch.to(device,
non_blocking=True)`` and tell the allocator about other streams with ``batch.record_stream(s)``
(``torchrec.streamable.Pipelineable``), and they step one (dense) optimizer. A model or batch that
does not fit fails deep inside torchrec on a rank; here it is a HarnessError naming what to change.
"""

from __future__ import annotations

from typing import Any

import torch

from paritykit.errors import HarnessError

FORWARD_CONTRACT = (
    "torchrec's train pipelines need forward(batch) to return (loss, prediction): they back-propagate "
    "torch.sum(loss, dim=0) and return the prediction from progress()"
)


def split_output(output: Any) -> tuple[torch.Tensor, Any]:
    """(loss, prediction) of one forward; HarnessError when the model does not return that pair."""
    if not isinstance(output, (tuple, list)) or len(output) != 2:
        raise HarnessError(f"{FORWARD_CONTRACT}; the model returned {_describe(output)}")
    loss, prediction = output
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise HarnessError(f"{FORWARD_CONTRACT}; its first element is {_describe(loss)}, not a floating loss tensor")
    return loss, prediction


def model_loss(output: Any, batch: Any = None) -> torch.Tensor:
    """The loss the pipelines back-propagate: ``torch.sum(loss, dim=0)`` of the model's own loss.

    Used as the ``loss_fn`` of the plain loop and of the unsharded reference, so that all three
    train on the very number the pipelines do.
    """
    loss, _prediction = split_output(output)
    return torch.sum(loss, dim=0)


def prediction_of(output: Any) -> Any:
    """What a pipeline's ``progress()`` returns for a forward that returned ``output``."""
    return split_output(output)[1]


def check_pipelineable(batches: list[list[Any]]) -> None:
    """Every ``batches[step][rank]`` can be moved and stream-recorded the way the pipelines do."""
    from torchrec.streamable import Pipelineable

    for step, per_rank in enumerate(batches):
        for rank, batch in enumerate(per_rank):
            if not isinstance(batch, (torch.Tensor, Pipelineable)):
                raise HarnessError(
                    f"batches[{step}][{rank}] is a {type(batch).__name__}: torchrec's train pipelines take a "
                    "torch.Tensor or a torchrec.streamable.Pipelineable (with to() and record_stream(), such as "
                    "torchrec.distributed.test_utils.test_model.ModelInput)"
                )


def check_forward_contract(model: torch.nn.Module, batch: Any) -> None:
    """One eager forward of the unsharded model on ``batch``: it must return (loss, prediction)."""
    with torch.no_grad():
        output = model(*batch) if isinstance(batch, tuple) else model(batch)
    split_output(output)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} elements"
    return f"a {type(value).__name__}"
