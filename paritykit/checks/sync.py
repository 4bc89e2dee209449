"""The `sync` check: sync budgets of TorchRec hot paths, one case per budget.

Each budget builds its inputs outside the counted region (on ``config.device``; host data declared
with ``on_host``), then counts the region on the backend of that device: the CUDA backend on
"cuda", the CPU proxy on "cpu". A case fails when the region makes more syncs than its budget;
the message names the call sites. Every budget says which torchrec call is the sync.

The budgets that need the rank pool (a sharded EBC's input_dist, one step of each training
pipeline) live in paritykit.sync_dist_budgets with their justification; ``run`` runs them on the
world-size-2 pool when it is given pools.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.checks.base import GateConfig, result_from_exception
from paritykit.report import CaseResult
from paritykit.sync import check_budget, count_syncs, on_host

NAME = "sync"

KEYS = ("f0", "f1", "f2")
BATCH = 4
# Lengths per key (batch of 4), key-major as in a KJT's lengths tensor.
LENGTHS = ((2, 0, 1, 3), (1, 1, 0, 2), (0, 3, 1, 1))
NUM_EMBEDDINGS = 16


@dataclass(frozen=True)
class SyncBudget:
    """A hot path and the most syncs it may make.

    prepare(device) builds the inputs, uncounted, and returns the region to count.
    sites: the torchrec functions the syncs are attributed to (checked by the tests).
    """

    name: str
    budget: int
    prepare: Callable[[torch.device], Callable[[], Any]]
    sites: tuple[str, ...] = ()


def _values(lengths: tuple[int, ...], offset: int) -> list[int]:
    return [(offset + i) % NUM_EMBEDDINGS for i in range(sum(lengths))]


def host_jts() -> dict[str, Any]:
    """One JaggedTensor per key, built on the host and declared so."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    jts = {
        key: JaggedTensor(values=torch.tensor(_values(lens, 3 * k)), lengths=torch.tensor(lens))
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }
    return on_host(jts)


def device_kjt(device: torch.device, synced: bool) -> Any:
    """A KJT whose tensors were made on the device; without metadata unless ``synced``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [n for lens in LENGTHS for n in lens]
    values = [v for k, lens in enumerate(LENGTHS) for v in _values(lens, 3 * k)]
    kjt = KeyedJaggedTensor(
        keys=list(KEYS),
        values=torch.tensor(values, device=device),
        lengths=torch.tensor(lengths, device=device),
    )
    if synced:
        kjt.sync()
    return kjt


def make_ebc(device: torch.device) -> Any:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{key}", embedding_dim=4, num_embeddings=NUM_EMBEDDINGS, feature_names=[key])
        for key in KEYS
    ]
    return EmbeddingBagCollection(tables=tables, device=device)


def device_td(device: torch.device) -> Any:
    """The same batch as a TensorDict of nested jagged tensors on the device (torchrec's TD input)."""
    from tensordict import TensorDict

    features = {
        key: torch.nested.nested_tensor_from_jagged(
            torch.tensor(_values(lens, 3 * k), device=device), lengths=torch.tensor(lens, device=device)
        )
        for k, (key, lens) in enumerate(zip(KEYS, LENGTHS))
    }
    return TensorDict(features, batch_size=[BATCH], device=device)


# --- the budgets ----------------------------------------------------------------------------------


def _ebc_forward_moved_kjt(device: torch.device) -> Callable[[], Any]:
    # from_jt_dict computes length_per_key/offset_per_key on the host (its tolist reads host data)
    # and KJT.to carries them over, so EBC.forward -> to_dict -> length_per_key reads nothing.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ebc = make_ebc(device)
    kjt = KeyedJaggedTensor.from_jt_dict(host_jts()).to(device)
    return lambda: ebc(kjt)


def _build_and_forward_nonblocking(device: torch.device) -> Callable[[], Any]:
    # The whole of TorchRec's advice inside the region: build from host JTs (host reads only),
    # move with non_blocking=True (cudaMemcpyAsync, no memcpy_and_sync), forward with metadata.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ebc = make_ebc(device)
    jts = host_jts()
    return lambda: ebc(KeyedJaggedTensor.from_jt_dict(jts).to(device, non_blocking=True))


def _move_blocking(device: torch.device) -> Callable[[], Any]:
    # KJT.to without non_blocking: values.to(device) and lengths.to(device) are each a blocking
    # pageable copy (memcpy_and_sync); weights and offsets are None, so 2.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_jt_dict(host_jts())
    return lambda: kjt.to(device)


def _ebc_forward_unsynced_kjt(device: torch.device) -> Callable[[], Any]:
    # EBC.forward -> KJT.to_dict -> length_per_key -> _maybe_compute_length_per_key:
    # _safe_tolist(torch.sum(lengths.view(len(keys), stride), dim=1)) reads the device lengths: 1.
    ebc = make_ebc(device)
    kjt = device_kjt(device, synced=False)
    return lambda: ebc(kjt)


def _from_lengths_sync(device: torch.device) -> Callable[[], Any]:
    # from_lengths_sync -> KJT.sync() -> length_per_key (the one tolist); offset_per_key is then
    # _cumsum of that Python list, no read: 1.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = device_kjt(device, synced=False)
    values, lengths = kjt.values(), kjt.lengths()
    return lambda: KeyedJaggedTensor.from_lengths_sync(keys=list(KEYS), values=values, lengths=lengths)


def _plain_constructor(device: torch.device) -> Callable[[], Any]:
    # The constructor only stores tensors (metadata deferred): 0 at construction.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = device_kjt(device, synced=False)
    values, lengths = kjt.values(), kjt.lengths()
    return lambda: KeyedJaggedTensor(keys=list(KEYS), values=values, lengths=lengths)


def _length_per_key_unsynced(device: torch.device) -> Callable[[], Any]:
    # length_per_key -> _maybe_compute_length_per_key -> _safe_tolist: 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.length_per_key()


def _length_per_key_synced(device: torch.device) -> Callable[[], Any]:
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.length_per_key()


def _permute_synced(device: torch.device) -> Callable[[], Any]:
    # KJT.permute builds indices_tensor = torch.tensor(indices, device=self.device()): a blocking
    # host->device copy of a Python list (1). permute_2D_sparse_data gets permuted_lengths_sum
    # from the metadata, so fbgemm does not read the lengths.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.permute([2, 0, 1])


def _permute_with_indices_tensor(device: torch.device) -> Callable[[], Any]:
    # The same with the indices tensor made beforehand on the device: 0.
    kjt = device_kjt(device, synced=True)
    indices_tensor = torch.tensor([2, 0, 1], dtype=torch.int, device=device)
    return lambda: kjt.permute([2, 0, 1], indices_tensor)


def _split_synced(device: torch.device) -> Callable[[], Any]:
    # split slices values/lengths with length_per_key/offset_per_key, already known: 0.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.split([1, 2])


def _split_unsynced(device: torch.device) -> Callable[[], Any]:
    # split -> length_per_key (1 tolist) then offset_per_key (_cumsum of the list): 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.split([1, 2])


def _to_dict_synced(device: torch.device) -> Callable[[], Any]:
    # _maybe_compute_kjt_to_jt_dict splits with length_per_key and views the lengths: 0.
    kjt = device_kjt(device, synced=True)
    return lambda: kjt.to_dict()


def _to_dict_unsynced(device: torch.device) -> Callable[[], Any]:
    # to_dict -> length_per_key: 1.
    kjt = device_kjt(device, synced=False)
    return lambda: kjt.to_dict()


def _torchrec_td_path(device: torch.device) -> Callable[[], Any]:
    # EBC.forward(td) -> maybe_td_to_kjt builds a KJT from cat'ed lengths without metadata, so
    # to_dict -> length_per_key reads the device lengths: 1.
    ebc = make_ebc(device)
    td = device_td(device)
    return lambda: ebc(td)


def _paritykit_td_path(device: torch.device) -> Callable[[], Any]:
    # paritykit.convert.td_to_kjt promises sync-free metadata: 0 for conversion and forward.
    from paritykit.convert import td_to_kjt

    ebc = make_ebc(device)
    td = device_td(device)
    return lambda: ebc(td_to_kjt(td))


BUDGETS: tuple[SyncBudget, ...] = (
    SyncBudget("ebc_forward.kjt_from_host_jts_moved", 0, _ebc_forward_moved_kjt),
    SyncBudget("ebc_forward.build_move_nonblocking_forward", 0, _build_and_forward_nonblocking),
    SyncBudget("kjt.to_device_blocking", 2, _move_blocking, ("to",)),
    SyncBudget("ebc_forward.kjt_without_metadata", 1, _ebc_forward_unsynced_kjt, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.from_lengths_sync", 1, _from_lengths_sync, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.plain_constructor", 0, _plain_constructor),
    SyncBudget("kjt.length_per_key.without_metadata", 1, _length_per_key_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.length_per_key.with_metadata", 0, _length_per_key_synced),
    SyncBudget("kjt.permute", 1, _permute_synced, ("permute",)),
    SyncBudget("kjt.permute.indices_tensor_given", 0, _permute_with_indices_tensor),
    SyncBudget("kjt.split.with_metadata", 0, _split_synced),
    SyncBudget("kjt.split.without_metadata", 1, _split_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget("kjt.to_dict.with_metadata", 0, _to_dict_synced),
    SyncBudget("kjt.to_dict.without_metadata", 1, _to_dict_unsynced, ("_maybe_compute_length_per_key",)),
    SyncBudget("td_path.torchrec_maybe_td_to_kjt", 1, _torchrec_td_path, ("_maybe_compute_length_per_key",)),
    SyncBudget("td_path.paritykit_td_to_kjt", 0, _paritykit_td_path),
)


def backend_for(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"the sync check runs on 'cpu' or 'cuda', got {device!r}")
    return device


def measure(budget: SyncBudget, device: str, *, stacks: bool = False):
    """Prepare the budget's inputs on ``device``, count its region, and return the SyncRecord."""
    backend = backend_for(device)
    region = budget.prepare(torch.device(device))
    with count_syncs(backend=backend, stacks=stacks) as record:
        region()
    return record


def run_budget(budget: SyncBudget, config: GateConfig) -> CaseResult:
    replay = f"{config.replay(NAME)}  # case: {budget.name}"
    started = time.perf_counter()
    try:
        record = measure(budget, config.device)
        check_budget(record, budget.budget, what=budget.name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("paritykit."):
            return CaseResult(NAME, budget.name, "skip", replay=replay, message=f"needs {exc.name}, not in this installation")
        return result_from_exception(NAME, budget.name, replay, exc, started)
    except ImportError as exc:
        return CaseResult(NAME, budget.name, "skip", replay=replay, message=f"not in this installation: {exc}")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return result_from_exception(NAME, budget.name, replay, exc, started)
    return CaseResult(
        NAME,
        budget.name,
        "pass",
        replay=replay,
        metrics={"syncs": record.total, "budget": budget.budget, "by_kind": record.by_kind, "by_site": record.by_site},
        duration_s=time.perf_counter() - started,
    )


def run_dist_budget(budget: Any, config: GateConfig, pool: Any) -> CaseResult:
    """One rank-pool budget (paritykit.sync_dist_budgets) on ``pool``: every rank within its budget."""
    from paritykit.sync_dist_budgets import check_dist_budget, measure_dist

    replay = f"{config.replay(NAME)}  # case: {budget.name}"
    started = time.perf_counter()
    try:
        records_per_rank, _ = measure_dist(budget, pool, config.device)
        check_dist_budget(budget, records_per_rank)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return result_from_exception(NAME, budget.name, replay, exc, started)
    return CaseResult(
        NAME,
        budget.name,
        "pass",
        replay=replay,
        metrics={
            "syncs_per_rank": [[record.total for record in records] for records in records_per_rank],
            "budget_per_rank": list(budget.budgets),
            "by_site_rank0": records_per_rank[0][0].by_site,
        },
        duration_s=time.perf_counter() - started,
    )


def run(config: GateConfig, pools: Any = None) -> list[CaseResult]:
    """Every budget of the corpus on ``config.device``; with ``pools``, also the rank-pool budgets.

    The rank-pool budgets are counts per rank at world size 2: they are skipped (with a reason)
    when the configuration does not select world size 2, and left out when no pools are given.
    """
    results = [run_budget(budget, config) for budget in BUDGETS]
    if pools is None:
        return results
    from paritykit.sync_dist_budgets import DIST_BUDGETS, WORLD_SIZE

    if WORLD_SIZE not in config.world_sizes:
        return results + [
            CaseResult(NAME, budget.name, "skip", replay=config.replay(NAME), message=f"needs world size {WORLD_SIZE}")
            for budget in DIST_BUDGETS
        ]
    pool = pools.get(WORLD_SIZE)
    return results + [run_dist_budget(budget, config, pool) for budget in DIST_BUDGETS]
