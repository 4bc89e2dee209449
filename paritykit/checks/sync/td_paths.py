"""The two TD paths into an embedding module, as budget regions: torchrec's own TD input and
paritykit's ``td_to_kjt``.

torchrec's ``forward(td)`` goes through ``maybe_td_to_kjt``, which cats the TD's lengths into a KJT
without metadata, so the forward's ``to_dict`` -> ``length_per_key`` reads the device lengths: 1.
``paritykit.convert.td_to_kjt`` takes length_per_key from the nested tensors' shapes, so the
conversion and the forward read nothing: 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from paritykit.checks.sync.features import require_torchrec_td_input
from paritykit.checks.sync.inputs import device_td

Prepare = Callable[[torch.device], Callable[[], Any]]


def torchrec_td_path(make_module: Callable[[torch.device], Any], what: str) -> Prepare:
    """The region ``module(td)``; unsupported where torchrec has no TD input for ``what``."""

    def prepare(device: torch.device) -> Callable[[], Any]:
        require_torchrec_td_input(what)
        module = make_module(device)
        td = device_td(device)
        return lambda: module(td)

    return prepare


def paritykit_td_path(make_module: Callable[[torch.device], Any]) -> Prepare:
    """The region ``module(td_to_kjt(td))``: the conversion counted with the forward."""

    def prepare(device: torch.device) -> Callable[[], Any]:
        from paritykit.convert import td_to_kjt

        module = make_module(device)
        td = device_td(device)
        return lambda: module(td_to_kjt(td))

    return prepare
