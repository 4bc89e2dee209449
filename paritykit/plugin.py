"""pytest plugin (entry point `pytest11`): options, markers, hypothesis profiles and the rank-pool fixtures.

Loaded in every pytest run of an environment where paritykit is installed, so it imports nothing
heavy at module level. Beside its options, markers and fixtures it does two things:

- Profiles: ``dev``, ``ci`` and ``release`` are registered for every suite, so any ``@given`` test
  follows ``--hypothesis-profile ci`` or ``PARITYKIT_PROFILE=ci`` (hypothesis' option wins when
  both are given). Without either, the suite's own hypothesis settings stay as they were.
  ``--paritykit-examples N`` sets max_examples for every property that does not set its own.
- Pools under pytest-xdist: ``-n N`` without ``--dist`` distributes with ``loadgroup``, every test
  that uses ``rank_pool``/``rank_pools`` joins one xdist group, so one worker starts each pool size
  once and keeps it, and tests that share a module- or class-scoped fixture of their own module
  (a pool a test file makes itself, say) are grouped by module. N is capped at the cores this
  process may use (``--maxprocesses``): each extra worker imports torch and collects the suite
  while the pools' ranks already use the cores. Before, every worker started its own pools, and
  ``-n 4`` on 2 cores took 1.8-3.3 times the serial wall time (bench/bench_xdist_pools.py).
  A test's own ``xdist_group`` marker wins; ``--dist loadgroup`` gets the same grouping (without
  the cap); any other ``--dist``, and an explicit ``--maxprocesses``, is kept as given.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

CUDA_SKIP_REASON = "CUDA-only test: no CUDA device on this machine"
POOL_FIXTURES = ("rank_pool", "rank_pools")
POOL_GROUP = "paritykit-rank-pools"
DEFAULT_POOL_WORLD_SIZE = 2


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("paritykit")
    group.addoption(
        "--paritykit-examples",
        type=int,
        default=None,
        help="hypothesis examples per property, for every property that does not set its own (overrides the profile)",
    )
    group.addoption(
        "--paritykit-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="device for paritykit checks: auto picks cuda when there is a GPU for each rank",
    )


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    # A wrapper runs before every plain implementation, xdist's tryfirst one (which turns a bare
    # "-n N" into "--dist load" and N into that many workers) included.
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "loadgroup"
        if not getattr(config.option, "maxprocesses", None):
            # More workers than cores only add interpreters that import torch and collect the suite,
            # while the ranks of the pools already keep the cores busy.
            from paritykit.dist import host_cores

            config.option.maxprocesses = host_cores()
    return (yield)


def pytest_report_header(config: pytest.Config) -> str | None:
    if getattr(config, "_paritykit_groups_directory", None) is None:
        return None
    return (
        f"paritykit: -n {config.option.numprocesses} runs at most {config.option.maxprocesses} workers; "
        "tests that use rank pools share one worker (pass --dist to choose otherwise)"
    )


# xdist's loadgroup appends the group to each node id on the worker (item._nodeid), which pytest
# 9.2 no longer reads; so each worker writes the groups of its collection into a directory of the
# controller's, and the controller's scheduler reads them. It works with older pytest too.
GROUPS_DIRECTORY_KEY = "paritykit_xdist_groups"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001 - xdist's WorkerController
    directory = getattr(node.config, "_paritykit_groups_directory", None)
    if directory is not None:
        node.workerinput[GROUPS_DIRECTORY_KEY] = directory


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's types
    directory = getattr(config, "_paritykit_groups_directory", None)
    if directory is None:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's loadscope with each test's scope read from the groups its worker wrote."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = read_groups(directory)
            if nodeid in self.groups:
                return self.groups[nodeid]
            # An xdist that could still rename node ids put the group after the last "@".
            return nodeid.rsplit("@", 1)[-1] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid

    return GroupScheduling(config, log)


def read_groups(directory: str) -> dict[str, str]:
    groups: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.json")):
        groups.update(json.loads(path.read_text()))
    return groups


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped with a reason on CPU-only machines")
    config.addinivalue_line("markers", "world_size(n, backend=None, ranks_per_host=None): the ranks (process-group backend, "
                            "and hosts of ranks_per_host ranks each) the rank_pool fixture provides")
    # First, so that hypothesis' own pytest_configure finds the profiles `--hypothesis-profile` names.
    from paritykit.gate.profiles import PROFILE_ENV, profile_from_env, register_profiles

    register_profiles()
    if getattr(config.option, "dist", None) == "loadgroup" and not hasattr(config, "workerinput"):
        config._paritykit_groups_directory = tempfile.mkdtemp(prefix="paritykit-xdist-groups-")
    if os.environ.get(PROFILE_ENV):
        from hypothesis import settings

        try:
            settings.load_profile(profile_from_env())
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = getattr(config, "_paritykit_groups_directory", None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    examples = session.config.getoption("--paritykit-examples")
    if examples is None:
        return
    if examples < 1:
        raise pytest.UsageError(f"--paritykit-examples must be at least 1, got {examples}")
    from hypothesis import settings

    name = f"{settings.get_current_profile_name()}-paritykit-examples-{examples}"
    settings.register_profile(name, settings.get_profile(settings.get_current_profile_name()), max_examples=examples)
    settings.load_profile(name)


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and _cuda_device_count() == 0:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=CUDA_SKIP_REASON))
    directory = getattr(config, "workerinput", {}).get(GROUPS_DIRECTORY_KEY)
    if directory is None:
        return
    groups = {item.nodeid: group for item in items if (group := xdist_group_for(item)) is not None}
    path = Path(directory) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    # Written whole before the worker reports its collection, so the scheduler reads it complete.
    path.with_suffix(".tmp").rename(path)


def xdist_group_for(item: pytest.Item) -> str | None:
    """The xdist group of ``item``: its own ``xdist_group`` marker, else the plugin's (a pool, or a
    module- or class-scoped fixture of its module), else None."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & set(POOL_FIXTURES):
        return POOL_GROUP
    module = item.nodeid.split("::", 1)[0]
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in sorted(fixtures):
        for fixture in definitions.get(name, ()):
            if fixture.scope in ("module", "class") and fixture.baseid == module:
                return f"module:{module}"
    return None


@pytest.fixture(scope="session")
def paritykit_device(request: pytest.FixtureRequest) -> str:
    """The device paritykit checks run on in this session, "cpu" or "cuda".

    From ``--paritykit-device`` (default ``auto``: "cuda" when torch sees a GPU, else "cpu"). A test
    that asks for it under ``--paritykit-device cuda`` on a machine without a GPU is skipped with
    the reason "CUDA-only test: ...", never counted as passed.
    """
    from paritykit.dist import resolve_device
    from paritykit.errors import HarnessError

    try:
        return resolve_device(request.config.getoption("--paritykit-device"))
    except HarnessError:
        pytest.skip(CUDA_SKIP_REASON)


@pytest.fixture(scope="session")
def paritykit_examples(request: pytest.FixtureRequest) -> int:
    """How many examples a property should draw: ``--paritykit-examples N``, else the loaded
    hypothesis profile's max_examples (dev 5, ci 8, release 100; see PARITYKIT_PROFILE)."""
    value = request.config.getoption("--paritykit-examples")
    if value is not None:
        return value
    from hypothesis import settings

    return settings().max_examples


@pytest.fixture(scope="session")
def rank_pools(request: pytest.FixtureRequest):
    """The session's pools, one per (world size, ranks per host, backend), started on first use and closed at the end.

    ``rank_pools.get(n)`` returns a pool of ``n`` ranks (a ``paritykit.dist.RankPool``, or the
    launcher's ranks under torchrun); ``rank_pools.get(n, backend="gloo")`` picks the backend;
    ``rank_pools.get(4, ranks_per_host=2)`` a pool standing for 2 hosts of 2 ranks. With
    ``--paritykit-device auto`` a pool runs on CUDA when this machine has a GPU for each of its
    ranks, else on CPU (``pool.device`` says which); with ``cuda`` a size larger than the GPUs is
    refused. Under ``pytest -n N`` every test using this fixture runs on one worker (see the module).
    """
    from paritykit.dist import PoolProvider

    provider = PoolProvider(device=request.config.getoption("--paritykit-device"))
    yield provider
    provider.close()


@pytest.fixture
def rank_pool(request: pytest.FixtureRequest, rank_pools):
    """A pool of ``@pytest.mark.world_size(n)`` ranks (default 2), shared by every test of the session.

    ``rank_pool.run(fn, *args)`` runs a module-level ``fn`` on every rank and returns the results in
    rank order; ``rank_pool.device`` is where the ranks compute. ``world_size(n, backend="gloo")``
    picks the process-group backend, ``world_size(4, ranks_per_host=2)`` 2 hosts of 2 ranks. Safe
    inside ``@given`` tests (the pool outlives the example; the profiles suppress hypothesis'
    function_scoped_fixture health check). With ``--paritykit-device cuda`` and fewer GPUs than
    ranks, the test is skipped with the reason.
    """
    from paritykit.dist import resolve_device
    from paritykit.errors import HarnessError

    marker = request.node.get_closest_marker("world_size")
    world_size = marker.args[0] if marker is not None else DEFAULT_POOL_WORLD_SIZE
    backend = marker.kwargs.get("backend") if marker is not None else None
    ranks_per_host = marker.kwargs.get("ranks_per_host") if marker is not None else None
    try:
        resolve_device(request.config.getoption("--paritykit-device"), ranks_per_host=world_size)
    except HarnessError as exc:
        pytest.skip(f"CUDA-only test: {exc}")
    return rank_pools.get(world_size, backend=backend, ranks_per_host=ranks_per_host)
