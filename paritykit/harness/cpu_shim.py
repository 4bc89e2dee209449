"""A device-neutral stream shim that lets torchrec's own stream-based pipelines run on CPU.

TrainPipelineFusedSparseDist and TrainPipelineSemiSync are written against CUDA streams. On a
machine without CUDA they reach things only CUDA provides; which things depends on the torchrec and
torch versions, so each patch below is applied where a probe shows this stack needs it (by
feature, never by version number; ``shim_patches()`` lists them with the probes' answers):

1. ``record_stream``: ``Tensor.record_stream(torch.cpu.Stream)`` raises "unknown parameter type".
   The pipelines call it (directly and through ``KeyedJaggedTensor/KeyedTensor/ModelInput.record_stream``
   and the module contexts) with ``torch.cpu.current_stream()``. The shim makes it a no-op for a
   ``torch.cpu.Stream``; every other stream goes to the original method.
2. ``forward-device``: ``runtime_forwards.BaseForward`` picks ``torch.device("cuda")`` when it is
   given no stream, and the pipelines give it none on CPU (their data-dist stream is None there);
   ``EmbeddingPipelinedForward.__call__`` then asks ``torch.cuda.current_stream()``. The shim sets
   that device to CPU for forwards constructed without a stream.
3. ``cpu-stream-device``: torch's CPU ``Stream`` stub has no ``.device``. torchrec 1.9's
   ``_start_embedding_lookup_stream_synced`` calls ``torch.get_device_module(stream.device)`` on
   ``torch.cpu.current_stream()``; the shim gives CPU streams ``device == torch.device("cpu")``.

Anything else torchrec reaches on CPU that the shim does not provide fails as ``ShimGap``, a
HarnessError (exit 2) naming the shim and the torchrec call, never as a parity failure: an
attribute that torch's CPU ``Stream``/``Event`` stubs lack, and CUDA being initialised on a
machine without CUDA (``torch.cuda._lazy_init``). A new torchrec that needs more shows up so.

Why the numerics of the schedule are unchanged: ``record_stream`` only tells the CUDA caching
allocator that a block is still in use on another stream, so that its memory is not reused early;
it neither reads nor writes tensor values, and a CPU tensor has no stream-ordered allocator at all.
The device of a forward or a stream only selects which module's ``current_stream()`` is used for
the same no-op waits and ``record_stream`` calls. Every CPU operation runs in program order on one
stream, so the pipeline computes exactly the sequence of operations its Python code issues: the
same calls, in the same order, on the same tensors, as on a GPU where every cross-stream wait is
honoured. (The cross-stream *races* a GPU may allow are a separate matter; see
``overlap_optimizer_with_lookup``.)

On a machine with CUDA, ``stream_shim()`` patches nothing: torchrec runs exactly as shipped.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from paritykit.errors import ShimGap
from paritykit.harness import call_context
from paritykit.harness.patching import patched, replaced

SHIM = "paritykit's CPU stream shim (paritykit.harness.cpu_shim)"


def shim_needed() -> bool:
    """True where torchrec's stream pipelines cannot run as shipped (no CUDA)."""
    return not torch.cuda.is_available()


@dataclass(frozen=True)
class ShimPatch:
    """One patch of the shim: what it covers, and whether this stack needs it (a probe's answer)."""

    name: str
    covers: str
    needed: bool


def torchrec_caller() -> str:
    """The innermost frame outside torch and this module: who reached the uncovered thing."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__") or "")
        if module != __name__ and module.partition(".")[0] != "torch":
            return f"{module}.{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return "(unknown caller)"


def _record_stream_needed() -> bool:
    try:
        torch.zeros(1).record_stream(torch.cpu.current_stream())
    except (RuntimeError, TypeError):
        return True
    return False


def _forward_device_needed() -> bool:
    try:
        from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward
    except ImportError:
        return False
    try:
        device = BaseForward("probe", None, None, None, stream=None)._device
    except Exception:  # noqa: BLE001 - a changed constructor: keep the (harmless) patch
        return True
    return torch.device(device).type != "cpu"


def _cpu_stream_device_needed() -> bool:
    return not hasattr(torch.cpu.Stream(), "device")


@functools.lru_cache(maxsize=1)
def shim_patches() -> tuple[ShimPatch, ...]:
    """The shim's patches and whether the installed torch/torchrec need each (probed once)."""
    return (
        ShimPatch("record_stream", "Tensor.record_stream(torch.cpu.Stream) is a no-op", _record_stream_needed()),
        ShimPatch("forward-device", "runtime_forwards.BaseForward without a stream uses the CPU", _forward_device_needed()),
        ShimPatch("cpu-stream-device", "torch.cpu.Stream.device is torch.device('cpu')", _cpu_stream_device_needed()),
    )


def _record_stream_ignoring_cpu(original: Any) -> Any:
    @functools.wraps(original)
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, torch.cpu.Stream):
            return None
        return original(self, stream)

    return record_stream


def _base_forward_init_on_cpu(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    return __init__


def _uncovered_attribute(stub: str) -> Callable[[Any], Any]:
    """A ``__getattr__`` for torch's CPU stubs: an attribute they lack is a gap of the shim."""

    def make(_original: Any) -> Any:
        def __getattr__(self: Any, name: str) -> Any:
            raise ShimGap(f"{SHIM} does not cover {stub}.{name}, which torchrec reached from {torchrec_caller()}")

        return __getattr__

    return make


def _cuda_init_guarded(original: Any) -> Any:
    @functools.wraps(original)
    def _lazy_init(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises without CUDA
            raise ShimGap(
                f"{SHIM} does not cover a CUDA call that torchrec made on a machine without CUDA, "
                f"from {torchrec_caller()}: {type(exc).__name__}: {exc}"
            ) from exc

    return _lazy_init


def _patches_for(needed: set[str]) -> list[tuple[Any, str, Callable[[Any], Any]]]:
    from torchrec.distributed.train_pipeline import runtime_forwards

    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (torch.cpu.Stream, "__getattr__", _uncovered_attribute("torch.cpu.Stream")),
        (torch.cpu.Event, "__getattr__", _uncovered_attribute("torch.cpu.Event")),
        (torch.cuda, "_lazy_init", _cuda_init_guarded),
    ]
    if "record_stream" in needed:
        patches.append((torch.Tensor, "record_stream", _record_stream_ignoring_cpu))
    if "forward-device" in needed and hasattr(runtime_forwards, "BaseForward"):
        patches.append((runtime_forwards.BaseForward, "__init__", _base_forward_init_on_cpu))
    if "cpu-stream-device" in needed:
        patches.append((torch.cpu.Stream, "device", lambda _original: property(lambda self: torch.device("cpu"))))
    return patches


_left_out: list[str] = []


@contextlib.contextmanager
def without_patches(*names: str) -> Iterator[None]:
    """Leave the named patches out of every ``stream_shim()`` in the block, on every rank it calls
    too: what torchrec does on CPU without them (a new release's needs show up as a ShimGap)."""
    unknown = sorted(set(names) - {p.name for p in shim_patches()})
    if unknown:
        raise ValueError(f"unknown shim patch(es) {unknown}; the shim has {[p.name for p in shim_patches()]}")
    _left_out.extend(names)
    try:
        yield
    finally:
        del _left_out[len(_left_out) - len(names):]


def _without_patches_on_rank(names: tuple[str, ...]) -> contextlib.AbstractContextManager[None]:
    return without_patches(*names)


@call_context.register
def _carry_left_out_patches() -> tuple[Callable[[Any], Any], tuple[str, ...]] | None:
    return (_without_patches_on_rank, tuple(_left_out)) if _left_out else None


@contextlib.contextmanager
def stream_shim(force: bool = False) -> Iterator[bool]:
    """Apply the patches this stack needs for the duration of the block, then restore everything.

    Yields whether anything was patched. ``force=True`` patches even where CUDA exists, and applies
    every patch whatever the probes say (only useful to test the shim itself). Patches named by an
    enclosing ``without_patches`` are left out.
    """
    if not (force or shim_needed()):
        yield False
        return
    needed = {p.name for p in shim_patches() if (p.needed or force) and p.name not in _left_out}
    with contextlib.ExitStack() as stack:
        for owner, name, make in _patches_for(needed):
            stack.enter_context(replaced(owner, name, make))
        yield True


@contextlib.contextmanager
def overlap_optimizer_with_lookup(pipeline: Any) -> Iterator[None]:
    """Emulate on CPU the GPU interleaving in which the next embedding lookup overlaps the optimizer.

    TrainPipelineFusedSparseDist starts the lookup of batch i+1 on its emb_lookup stream without
    waiting for the optimizer step of batch i, which runs on the current stream. Its premise is that
    the lookup reads nothing the optimizer writes (fused TBE tables are updated in backward). On CPU
    program order always lets the optimizer finish first, which hides any violation of that premise.
    This context makes each lookup read the values that the optimizer-updated parameters of the
    pipelined (sharded) modules had *before* the latest ``optimizer.step()``, i.e. the worst case the
    GPU schedule permits. Parameters the optimizer does not update are untouched, so a model that
    satisfies the premise computes exactly what it computes without this context.

    It applies only where the lookup runs on a stream other than the current one; with
    ``emb_lookup_stream="current"`` the GPU orders the lookup after the optimizer and nothing changes.
    """
    from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineFusedSparseDist

    if not isinstance(pipeline, TrainPipelineFusedSparseDist):
        raise TypeError(f"overlap_optimizer_with_lookup needs a TrainPipelineFusedSparseDist, got {type(pipeline).__name__}")
    if _lookup_on_current_stream(pipeline):
        yield
        return

    optimizer = pipeline._optimizer
    original_step = optimizer.step
    original_lookup = pipeline.start_embedding_lookup
    before_step: dict[torch.nn.Parameter, torch.Tensor] = {}

    def optimizer_params() -> set[torch.nn.Parameter]:
        return {p for group in optimizer.param_groups for p in group["params"]}

    def exposed_params() -> list[torch.nn.Parameter]:
        updated = optimizer_params()
        return [p for module in pipeline._pipelined_modules for p in module.parameters() if p in updated]

    def step(*args: Any, **kwargs: Any) -> Any:
        before_step.clear()
        before_step.update({p: p.detach().clone() for p in exposed_params()})
        return original_step(*args, **kwargs)

    def start_embedding_lookup(*args: Any, **kwargs: Any) -> Any:
        # Swap storage with .data so that autograd sees no in-place write on the parameter.
        current = {p: p.data for p in before_step}
        for p, old in before_step.items():
            p.data = old
        try:
            return original_lookup(*args, **kwargs)
        finally:
            for p, value in current.items():
                p.data = value

    with patched(optimizer, "step", step), patched(pipeline, "start_embedding_lookup", start_embedding_lookup):
        yield


def _lookup_on_current_stream(pipeline: Any) -> bool:
    stream = pipeline._emb_lookup_stream
    if stream is None:
        return False
    if isinstance(stream, torch.cpu.Stream):
        return True
    return stream == torch.get_device_module(pipeline._device).current_stream()
