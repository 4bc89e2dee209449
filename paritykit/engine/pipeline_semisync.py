"""The plain loop with SemiSync's documented staleness: the oracle TrainPipelineSemiSync is held to
exactly, not only within drift bounds.

TrainPipelineSemiSync's promise (its docstring and ``progress``): from ``start_batch`` on, batch
``i + 1``'s embeddings are looked up after batch ``i``'s forward and before its backward, so they miss
batch ``i``'s table update (one step stale); the dense forward of every batch sees every dense step.
``StaleLookupDrive`` trains the same DMP model that way with nothing of the pipeline's: per batch,
zero the gradients, look the batch up (unless it was looked up ahead), run the model's forward with
its sharded embedding modules answering from that lookup, look the next batch up when the batch index
is at least ``start_batch``, then backward (the fused tables update in it) and the dense step. Before
``start_batch`` this is the plain loop itself.

The lookup calls each sharded module with what the model's forward hands it, named by the model:
``sparse_inputs()`` (module fqn -> batch attribute); the built-in DLRM's are below.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from paritykit.engine.pipeline_contract import prediction_of, split_output

# The built-in DLRM (builtin_models.SmallDLRM): module -> the batch attribute its forward reads.
DLRM_SPARSE_INPUTS = (("sparse", "idlist_features"), ("weighted", "idscore_features"))


def _lookup(inner: torch.nn.Module, inputs: tuple[tuple[str, str], ...], batch: Any) -> dict[str, Any]:
    """Each sharded module's output for ``batch``, computed now (awaited: the tables are read now)."""
    from torchrec.distributed.types import Awaitable

    modules = dict(inner.named_modules())
    looked = {}
    for fqn, attribute in inputs:
        if modules.get(fqn) is None:
            continue
        result = modules[fqn](getattr(batch, attribute))
        looked[fqn] = result.wait() if isinstance(result, Awaitable) else result
    return looked


@contextlib.contextmanager
def _answering(inner: torch.nn.Module, looked: dict[str, Any]) -> Iterator[None]:
    """The sharded modules return ``looked`` instead of computing (their hooks still run)."""
    modules = dict(inner.named_modules())
    for fqn, result in looked.items():
        modules[fqn].forward = lambda *_args, _result=result, **_kwargs: _result
    try:
        yield
    finally:
        for fqn in looked:
            del modules[fqn].forward


@dataclass(frozen=True)
class StaleLookupDrive:
    """A driver (``pipeline_runs.record_on_rank``): the plain loop with SemiSync's staleness."""

    start_batch: int
    sparse_inputs: tuple[tuple[str, str], ...] = DLRM_SPARSE_INPUTS

    def __call__(self, model: Any, optimizer: Any, batches: list[Any], device: torch.device) -> list[Any]:
        inner = getattr(model, "module", model)
        ahead: dict[int, dict[str, Any]] = {}
        outputs = []
        for index, batch in enumerate(batches):
            optimizer.zero_grad()
            looked = ahead.pop(index) if index in ahead else _lookup(inner, self.sparse_inputs, batch)
            with _answering(inner, looked):
                loss, prediction = split_output(model(batch))
            if index >= self.start_batch and index + 1 < len(batches):
                ahead[index + 1] = _lookup(inner, self.sparse_inputs, batches[index + 1])
            torch.sum(loss, dim=0).backward()
            optimizer.step()
            outputs.append(prediction_of((loss, prediction)))
        return outputs
