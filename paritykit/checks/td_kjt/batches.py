"""A rank's batch in each form a route feeds, and the oracle's input, on any device.

    route_input(rank_batch, "td-paritykit", form, device)   # what the sharded module is fed
    oracle_kjt(rank_batch, device)                          # what the unsharded module is fed

For a variable batch per feature (VBE) the sharded module needs torchrec's inverse indices, which
a TensorDict has no place for: the TD routes attach them to the converted KJT. The oracle never
sees inverse indices: it gets every feature expanded to the output's B rows by paritykit's own
row arithmetic (``RankBatch.expanded_lengths``), so a wrong expansion inside torchrec cannot be
shared by the reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from paritykit.checks.td_kjt.sharded_spec import (
    ROUTE_KJT,
    ROUTE_PARITYKIT,
    ROUTE_TORCHREC,
    RankBatch,
)
from paritykit.convert import td_to_kjt
from paritykit.errors import HarnessError, ParityError


@contextlib.contextmanager
def built_by_paritykit(what: str) -> Iterator[None]:
    """A failure while paritykit builds an input is paritykit's (a harness error), not torchrec's."""
    try:
        yield
    except (HarnessError, ParityError):
        raise
    except Exception as exc:
        raise HarnessError(f"td-kjt: paritykit failed while building {what}: {type(exc).__name__}: {exc}") from exc


def with_inverse_indices(kjt: Any, inverse: tuple[tuple[int, ...], ...], device: torch.device) -> Any:
    """``kjt`` as a VBE KJT (one rank, its own batch size per key) carrying ``inverse`` in key order."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = kjt.keys()
    return KeyedJaggedTensor(
        keys=keys,
        values=kjt.values(),
        weights=kjt.weights_or_none(),
        lengths=kjt.lengths(),
        # Marked VBE even when every key happens to have the same batch size: torchrec then expands.
        stride_per_key_per_rank=[[b] for b in kjt.stride_per_key()],
        inverse_indices=(list(keys), torch.tensor(inverse, dtype=torch.int64, device=device)),
    )


def route_input(rank_batch: RankBatch, route: str, form: str, device: torch.device) -> Any:
    """What ``route`` feeds the sharded module for this batch."""
    with built_by_paritykit(f"the {route} input"):
        return _route_input(rank_batch, route, form, device)


def _route_input(rank_batch: RankBatch, route: str, form: str, device: torch.device) -> Any:
    batch = rank_batch.batch
    if route == ROUTE_KJT:
        kjt = batch.to_kjt(device)
    elif route == ROUTE_PARITYKIT:
        kjt = td_to_kjt(batch.to_td(form, device))
    elif route == ROUTE_TORCHREC:
        if rank_batch.inverse is not None:
            raise HarnessError("torchrec's TensorDict route has no inverse indices; a VBE case must not draw it")
        return batch.to_td(form, device)
    else:
        raise HarnessError(f"unknown route {route!r}")
    return kjt if rank_batch.inverse is None else with_inverse_indices(kjt, rank_batch.inverse, device)


def oracle_kjt(rank_batch: RankBatch, device: torch.device) -> Any:
    """A fixed-batch KJT of the output's B rows per feature, built from the drawn ids and weights."""
    with built_by_paritykit("the unsharded module's input"):
        return _oracle_kjt(rank_batch, device)


def _oracle_kjt(rank_batch: RankBatch, device: torch.device) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = rank_batch.batch
    if rank_batch.inverse is None:
        return batch.to_kjt(device)
    values, weights, lengths = [], [], []
    for k, key in enumerate(batch.keys):
        rows = batch.lengths[k]
        starts = [sum(rows[:r]) for r in range(len(rows))]
        ids = batch.ids(key)
        for r in rank_batch.inverse[k]:
            values.append(ids[starts[r] : starts[r] + rows[r]])
            if batch.weighted:
                weights.append(batch.weights(key)[starts[r] : starts[r] + rows[r]])
            lengths.append(rows[r])
    return KeyedJaggedTensor(
        keys=list(batch.keys),
        values=torch.cat(values).to(device),
        weights=torch.cat(weights).to(device) if batch.weighted else None,
        lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
        stride=rank_batch.output_batch_size,
    )
