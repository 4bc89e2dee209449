"""pytest plugin (entry point `pytest11`): options, markers and the rank_pool fixture.

Loaded in every pytest run of an environment where paritykit is installed, so it imports nothing
heavy at module level.
"""

from __future__ import annotations

import pytest

CUDA_SKIP_REASON = "CUDA-only test: no CUDA device on this machine"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("paritykit")
    group.addoption(
        "--paritykit-examples",
        type=int,
        default=None,
        help="hypothesis examples per paritykit property (overrides the profile's max_examples)",
    )
    group.addoption(
        "--paritykit-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="device for paritykit checks: auto picks cuda when available",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped with a reason on CPU-only machines")
    config.addinivalue_line("markers", "world_size(n, backend=None): the ranks (and process-group backend) the rank_pool fixture provides")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=CUDA_SKIP_REASON))


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if requested == "cuda" and not _cuda_available():
        pytest.skip(CUDA_SKIP_REASON)
    return requested


@pytest.fixture(scope="session")
def paritykit_device(request: pytest.FixtureRequest) -> str:
    """The device paritykit checks run on: --paritykit-device, with auto resolved."""
    return resolve_device(request.config.getoption("--paritykit-device"))


@pytest.fixture(scope="session")
def paritykit_examples(request: pytest.FixtureRequest) -> int:
    """Examples per property: --paritykit-examples, else the loaded hypothesis profile's max_examples."""
    value = request.config.getoption("--paritykit-examples")
    if value is not None:
        return value
    from hypothesis import settings

    return settings().max_examples


@pytest.fixture(scope="session")
def _paritykit_pools(paritykit_device: str):
    """One pool per world size for the whole session (per xdist worker); closed at the end."""
    from paritykit.dist import PoolProvider

    provider = PoolProvider(device=paritykit_device)
    yield provider
    provider.close()


@pytest.fixture
def rank_pool(request: pytest.FixtureRequest, _paritykit_pools):
    """A RankPool of `world_size(n)` ranks (default 2), reused across tests of this worker.

    The pool is cached for the session, so it is safe inside @given tests; hypothesis still warns
    about a function-scoped fixture there: suppress HealthCheck.function_scoped_fixture.

    `@pytest.mark.world_size(n, backend="gloo")` picks the process-group backend too.
    """
    marker = request.node.get_closest_marker("world_size")
    world_size = marker.args[0] if marker is not None else 2
    backend = marker.kwargs.get("backend") if marker is not None else None
    return _paritykit_pools.get(world_size, backend=backend)


@pytest.fixture(scope="session")
def rank_pools(_paritykit_pools):
    """The session's pools: ``rank_pools.get(n)`` for tests that span several world sizes."""
    return _paritykit_pools
