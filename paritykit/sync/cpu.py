"""The CPU proxy backend of paritykit.sync: counts the host reads that would synchronize on a GPU.

Which tensors stand for device tensors
--------------------------------------
On a CPU-only run every tensor lives on the host, and ``.to(device)`` with ``device == "cpu"`` is a
no-op that returns the very same tensor, so neither the device field nor object identity can tell
"device" data from host data. The proxy therefore uses one rule:

    every tensor stands for a device tensor, except the ones that stand for host tensors.

A tensor stands for a host tensor (it is an instance of the marker subclass ``HostTensor``) when:
  * a test or a data pipeline declared it so with ``paritykit.sync.on_host(...)``: the data was
    prepared on the host (the CPU JaggedTensors of TorchRec's advice);
  * it was created inside a proxy session by a factory given no device (``torch.tensor(data)``,
    ``torch.zeros(n)``, ...) or the device string ``"cpu"`` -- what lands on the host on a GPU run.
    A factory given a ``torch.device`` object (torchrec's ``device=self.device()``) stands for the
    device. The legacy typed constructors (``torch.IntTensor(data, device="cpu")``, how torchrec
    makes a VBE KJT's ``stride_per_key_per_rank``) only ever make CPU tensors, so inside a session
    what they build from Python data is host data too;
  * it is the result of a copy to the host (``.cpu()``), or was computed from a host tensor: the
    subclass propagates through every op by torch's own subclass machinery, so the host side
    stays host across ``torch.cat``/``sum``/fbgemm ops, exactly as CPU tensors stay CPU on a GPU.
``.to(device)`` of a host tensor is the host->device move: it returns a plain (device) tensor,
and counts as a synchronization when blocking (``non_blocking=False``), as a pageable blocking copy
does under CUDA's sync debug mode. ``.to(...)`` of a device tensor stays on the device and never
counts: in a CPU run the proxy cannot tell ``.to("cpu")``-meant-as-host-copy from
``.to(device)``; code that copies to the host says ``.cpu()``, as torchrec's hot paths do.

Why this gives the CUDA backend's counts on the budget corpus
-------------------------------------------------------------
On a GPU, a host read synchronizes exactly when the tensor read lives on the device, and a tensor
lives on the device exactly when it was moved there, created there, or computed from such. The
rules above reproduce that partition: data the corpus prepares on the host is declared with
``on_host`` (or built in the session from Python data), stays host through every op computed from
it, and becomes device data only at ``.to(device)``; everything the model and torchrec compute
from device inputs stays plain, hence device. The counted operations are the ones the CUDA sync
debug mode flags: ``item``/``tolist``/``bool``/``int``/``float``/``index``, copies between host and
device that are not ``non_blocking`` (``memcpy_and_sync``), and data-dependent ops whose output
size needs the data (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``, boolean-mask indexing, ``equal``/``allclose``). Every host read on the corpus
paths happens in Python (torchrec's ``_safe_tolist`` and friends), where the proxy sees it.

Limits, stated: reads done inside C++ kernels (an fbgemm op that calls ``.item()`` internally, e.g.
``keyed_jagged_index_select_dim1`` given no output size) are invisible to the proxy; compiled
(dynamo) regions are not counted; a tensor made *before* any session by a legacy constructor or a
``device="cpu"`` factory is not known to be host data unless declared with ``on_host`` (which does
declare a KJT's ``stride_per_key_per_rank``, host data by torchrec's construction). The CUDA backend
has none of these limits and is the reference when a GPU exists.

Cost
----
Nothing runs per aten op: only the handful of Python entry points above are wrapped, and only
while a session is open (installed on the first ``attach``, removed on the last ``detach``), so
with no guard open the proxy costs nothing. Host tensors pay a ``__torch_function__`` call per op;
device tensors pay nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.overrides import get_default_nowrap_functions

from paritykit.harness.patching import PatchSet
from paritykit.sync.kinds import D2H_COPY, DATA_DEPENDENT, H2D_COPY, ITEM, NUMPY, SCALAR, TOLIST
from paritykit.sync.listeners import Listeners

_local = threading.local()


class HostTensor(torch.Tensor):
    """A CPU tensor that stands for a host tensor in a proxy run (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ORIGINAL_TO or func is torch.Tensor.to:
            return _host_to(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _NOWRAP:
            return out
        return _as_host(out)


_NOWRAP = get_default_nowrap_functions()
_ORIGINAL_TO = torch._C.TensorBase.to


def _as_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) is HostTensor or value.device.type != "cpu":
            return value
        return value.as_subclass(HostTensor)
    if isinstance(value, (tuple, list)):
        converted = [_as_host(v) for v in value]
        return tuple(converted) if isinstance(value, tuple) else converted
    return value


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host-standing alias of a CPU tensor (same storage); other devices are returned as they are."""
    return _as_host(tensor)


def is_host(tensor: torch.Tensor) -> bool:
    return type(tensor) is HostTensor


def _host_to(args: tuple, kwargs: dict) -> torch.Tensor:
    # Tensor.to on a host tensor: a move to the device when a device is named, else a cast on the host.
    self = args[0]
    device, _dtype, non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        out = _ORIGINAL_TO(*args, **kwargs)
    if device is None:
        return _as_host(out)
    if not non_blocking and self.numel() > 0:
        _emit(H2D_COPY)
    # On CPU `.to("cpu")` returns the same object: hand back a plain alias, the device-side tensor.
    return out.as_subclass(torch.Tensor) if type(out) is HostTensor else out


def _is_device_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value) is not HostTensor


def _emit(kind: str) -> None:
    if getattr(_local, "depth", 0) > 1 or torch.compiler.is_compiling():
        return
    _listeners.notify(kind)


class _Depth:
    """Counts nesting of wrapped calls so that a wrapped call made by another one is not counted twice."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


_DEPTH = _Depth()


def _read(kind: str, original: Callable) -> Callable:
    """Wrap a Tensor method that reads the tensor's data on the host."""

    def wrapper(self, *args, **kwargs):
        with _DEPTH:
            if type(self) is not HostTensor:
                _emit(kind)
            return original(self, *args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", kind)
    return wrapper


def _data_dependent(original: Callable, needs_sync: Callable[..., bool] | None = None) -> Callable:
    """Wrap an op whose output size depends on the data of its first (device) tensor argument."""

    def wrapper(*args, **kwargs):
        with _DEPTH:
            if args and _is_device_tensor(args[0]) and (needs_sync is None or needs_sync(*args, **kwargs)):
                _emit(DATA_DEPENDENT)
            return original(*args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", "data_dependent")
    return wrapper


def _repeat_interleave_syncs(input, repeats=None, dim=None, *, output_size=None) -> bool:
    # torch.repeat_interleave(repeats_tensor) has one argument; int repeats never read the data.
    if repeats is None:
        return output_size is None
    return isinstance(repeats, torch.Tensor) and output_size is None


def _where_syncs(condition, *rest, **kwargs) -> bool:
    return not rest and not kwargs  # torch.where(cond) is nonzero


def _is_bool_index(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype is torch.bool or index.dtype is torch.uint8
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, torch.Tensor) and (i.dtype is torch.bool or i.dtype is torch.uint8) for i in index)
    return False


def _getitem(original: Callable) -> Callable:
    def __getitem__(self, index):
        if type(index) is int or type(index) is slice:
            return original(self, index)
        with _DEPTH:
            if type(self) is not HostTensor and _is_bool_index(index):
                _emit(DATA_DEPENDENT)
            return original(self, index)

    return __getitem__


def _setitem(original: Callable) -> Callable:
    def __setitem__(self, index, value):
        if type(index) is int or type(index) is slice:
            return original(self, index, value)
        with _DEPTH:
            if type(self) is not HostTensor and _is_bool_index(index):
                _emit(DATA_DEPENDENT)
            return original(self, index, value)

    return __setitem__


def _cpu(original: Callable) -> Callable:
    def cpu(self, *args, **kwargs):
        with _DEPTH:
            if type(self) is HostTensor:
                return original(self, *args, **kwargs)
            if self.numel() > 0:
                _emit(D2H_COPY)
            return _as_host(original(self, *args, **kwargs).as_subclass(HostTensor))

    return cpu


def _copy_(original: Callable) -> Callable:
    def copy_(self, src, non_blocking=False):
        if not non_blocking and isinstance(src, torch.Tensor) and (type(self) is HostTensor) != (type(src) is HostTensor):
            with _DEPTH:
                if self.numel() > 0:
                    _emit(D2H_COPY if type(self) is HostTensor else H2D_COPY)
                return original(self, src, non_blocking)
        return original(self, src, non_blocking)

    return copy_


def _factory(original: Callable, from_data: bool) -> Callable:
    """Factories: no device (or the string "cpu") is the host; a torch.device stands for the device."""

    def factory(*args, **kwargs):
        device = kwargs.get("device")
        out = original(*args, **kwargs)
        if device is None or device == "cpu" and isinstance(device, str):
            return _as_host(out)
        if from_data and args and not isinstance(args[0], torch.Tensor) and out.numel() > 0:
            with _DEPTH:
                _emit(H2D_COPY)  # torch.tensor(data, device=cuda) is a blocking pageable copy
        return out

    factory.__name__ = getattr(original, "__name__", "factory")
    return factory


class _LegacyConstructorType(type):
    """Stands in for a legacy typed constructor (``torch.IntTensor``) while a session is open.

    Calling it builds the tensor with the original and marks what it built from Python data as
    host data (these constructors only make CPU tensors); ``isinstance``/``issubclass`` checks and
    attributes go to the original, so code that inspects the type sees no difference.
    """

    def __call__(cls, *args, **kwargs):
        out = cls.original(*args, **kwargs)
        from_data = not any(isinstance(a, torch.Tensor) for a in args)
        return _as_host(out) if from_data else out

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.original)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, cls.original)

    def __getattr__(cls, name):
        return getattr(cls.original, name)


def _legacy_constructor(original: Any) -> Any:
    return _LegacyConstructorType(original.__name__, (), {"original": original, "__doc__": original.__doc__})


_LEGACY_CONSTRUCTORS = (
    "DoubleTensor", "FloatTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
    "IntTensor", "ShortTensor", "CharTensor", "ByteTensor", "BoolTensor",
)


def _patches() -> list[tuple[Any, str, Callable[[Callable], Callable]]]:
    tensor = torch.Tensor
    legacy = [(torch, name, _legacy_constructor) for name in _LEGACY_CONSTRUCTORS if hasattr(torch, name)]
    return legacy + [
        (tensor, "item", lambda f: _read(ITEM, f)),
        (tensor, "tolist", lambda f: _read(TOLIST, f)),
        (tensor, "__bool__", lambda f: _read(SCALAR, f)),
        (tensor, "__int__", lambda f: _read(SCALAR, f)),
        (tensor, "__float__", lambda f: _read(SCALAR, f)),
        (tensor, "__index__", lambda f: _read(SCALAR, f)),
        (tensor, "numpy", lambda f: _read(NUMPY, f)),
        (tensor, "equal", lambda f: _read(SCALAR, f)),
        (tensor, "cpu", _cpu),
        (tensor, "copy_", _copy_),
        (tensor, "__getitem__", _getitem),
        (tensor, "__setitem__", _setitem),
        (tensor, "nonzero", _data_dependent),
        (tensor, "argwhere", _data_dependent),
        (tensor, "masked_select", _data_dependent),
        (tensor, "unique", _data_dependent),
        (tensor, "unique_consecutive", _data_dependent),
        (tensor, "repeat_interleave", lambda f: _data_dependent(f, _repeat_interleave_syncs)),
        (torch, "nonzero", _data_dependent),
        (torch, "argwhere", _data_dependent),
        (torch, "masked_select", _data_dependent),
        (torch, "unique", _data_dependent),
        (torch, "unique_consecutive", _data_dependent),
        (torch, "repeat_interleave", lambda f: _data_dependent(f, _repeat_interleave_syncs)),
        (torch, "where", lambda f: _data_dependent(f, _where_syncs)),
        (torch, "equal", lambda f: _read(SCALAR, f)),
        (torch, "allclose", lambda f: _read(SCALAR, f)),
        (torch, "tensor", lambda f: _factory(f, from_data=True)),
        (torch, "as_tensor", lambda f: _factory(f, from_data=True)),
        (torch, "from_numpy", lambda f: _factory(f, from_data=False)),
        (torch, "zeros", lambda f: _factory(f, from_data=False)),
        (torch, "ones", lambda f: _factory(f, from_data=False)),
        (torch, "empty", lambda f: _factory(f, from_data=False)),
        (torch, "full", lambda f: _factory(f, from_data=False)),
        (torch, "arange", lambda f: _factory(f, from_data=False)),
    ]


_hooks = PatchSet(_patches)

# Proxy sync events go to ``listener(kind)``; the first listener installs the hooks, the last removes them.
_listeners = Listeners(_hooks.install, _hooks.uninstall)
attach, detach = _listeners.attach, _listeners.detach


def installed() -> bool:
    return _hooks.installed
