"""The CUDA backend of paritykit.sync: torch's own sync debug mode, every warning counted.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call (a blocking copy in
either direction through ``memcpy_and_sync``, a stream or device synchronize, ``item``, ``nonzero``,
...) emit a UserWarning from C++. Python's warning machinery dedupes by default ("default" action:
once per location), which would hide every repeat of a sync in a loop; an "always" filter for that
message at the front of the filter list, and a ``showwarning`` hook that records the event with its
Python stack, see every one. Other warnings go to the previous hook untouched. The previous debug
mode, filters and hook are restored when the last session closes.

The mode is per process: in a multi-process run each rank opens its own session.
"""

from __future__ import annotations

import linecache
import re
import warnings
from types import FrameType
from typing import Any, Callable

import torch

from paritykit.sync import kinds
from paritykit.sync.listeners import Listeners

SYNC_WARNING = "called a synchronizing CUDA operation"
_SYNC_WARNING_RE = re.compile(re.escape(SYNC_WARNING))

_state: dict[str, Any] = {}

# The warning carries no kind; the Python call that issued it does. First match wins. A copy's
# direction is read from the line too: to the host (.cpu(), .numpy(), .to("cpu")) or, for every
# other blocking copy (.to(device), copy_, torch.tensor(data, device=...)), to the device. An
# fbgemm op that synchronizes reads an output size from the device inside C++ (e.g.
# keyed_jagged_index_select_dim1 or permute_1D_sparse_data given no output size).
_KIND_BY_SOURCE = (
    (re.compile(r"\.tolist\("), kinds.TOLIST),
    (re.compile(r"\.item\("), kinds.ITEM),
    (re.compile(r"\.numpy\("), kinds.NUMPY),
    (re.compile(r"\.cpu\(|\.to\(\s*(\"cpu\"|'cpu'|torch\.device\(\s*[\"']cpu)"), kinds.D2H_COPY),
    (re.compile(r"\.to\(|copy_\(|torch\.(tensor|as_tensor)\(|\bpin_memory\("), kinds.H2D_COPY),
    (re.compile(r"nonzero|masked_select|unique|repeat_interleave|argwhere|torch\.ops\.fbgemm\."), kinds.DATA_DEPENDENT),
    (re.compile(r"synchronize\("), kinds.STREAM_SYNC),
    (re.compile(r"\b(bool|int|float|len)\(|\bif\b|\bwhile\b|\bassert\b|\bequal\(|allclose\("), kinds.SCALAR),
)

# torchrec's stream-scoped device->host copy (_safe_tolist and _safe_tolist_2d call it): its sync is
# a stream synchronize, but it stands for the host read its caller makes of the copy.
TORCHREC_COPY_HELPER = "_cuda_to_cpu_safe"
_HOST_READS = (kinds.TOLIST, kinds.ITEM, kinds.NUMPY, kinds.SCALAR)


def classify_source_line(line: str) -> str:
    """The kind of a CUDA sync, read from the Python source line that triggered it."""
    for pattern, kind in _KIND_BY_SOURCE:
        if pattern.search(line or ""):
            return kind
    return kinds.UNCLASSIFIED


def classify_sync(line: str, function: str, caller_line: str) -> str:
    """The kind of a CUDA sync raised at ``line`` of ``function``, called from ``caller_line``.

    A sync inside torchrec's copy helper is named for what its caller does with the copy
    (``_cuda_to_cpu_safe(tensor).tolist()``: a tolist, as the CPU proxy names it), and is a
    device->host copy when the caller only takes the host tensor.
    """
    if function == TORCHREC_COPY_HELPER:
        kind = classify_source_line(caller_line)
        return kind if kind in _HOST_READS else kinds.D2H_COPY
    return classify_source_line(line)


def classify_frame(frame: FrameType | None) -> str:
    """``classify_sync`` for the innermost Python frame outside torch of a CUDA sync."""
    if frame is None:
        return kinds.UNCLASSIFIED
    caller = frame.f_back
    return classify_sync(
        _source_line(frame), frame.f_code.co_name, _source_line(caller) if caller is not None else ""
    )


def _source_line(frame: FrameType) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _check_available() -> None:
    if not torch.cuda.is_available():
        from paritykit.errors import HarnessError

        raise HarnessError("sync backend 'cuda' needs a CUDA device; none is available (use backend='cpu')")


def _install() -> None:
    _check_available()
    catcher = warnings.catch_warnings()
    catcher.__enter__()
    warnings.filterwarnings("always", message=".*" + re.escape(SYNC_WARNING), category=UserWarning)
    previous_show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UserWarning) and _SYNC_WARNING_RE.search(str(message)):
            _listeners.notify("")  # the kind is read from the stack by the listener
            return
        previous_show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    _state["catcher"] = catcher
    _state["previous_mode"] = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")


def _uninstall() -> None:
    try:
        torch.cuda.set_sync_debug_mode(_state.pop("previous_mode"))
    finally:
        _state.pop("catcher").__exit__(None, None, None)


_listeners = Listeners(_install, _uninstall)
attach, detach = _listeners.attach, _listeners.detach


PROFILER_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profiler_sync_count(fn: Callable[[], Any]) -> int:
    """Run ``fn`` under the torch profiler; count the host-blocking CUDA runtime calls it recorded.

    The cross-check for the warning count: each synchronizing call of the sync debug mode ends in
    one of these runtime calls (``memcpy_and_sync`` ends in ``cudaStreamSynchronize``).
    """
    _check_available()
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name in PROFILER_SYNC_EVENTS)
