"""Planted bugs in the TensorDict -> KJT conversion, for the td-kjt check's negative controls."""

from __future__ import annotations

from typing import ContextManager

import torch

import paritykit.convert as convert
from paritykit.harness.patching import replaced
from paritykit.harness.plants import register

CHECK = "td-kjt"


def _patched(name: str, replacement) -> ContextManager[None]:
    return replaced(convert, name, replacement)


@register("offsets-off-by-one", check=CHECK)
def offsets_off_by_one():
    """Every inner row boundary of the first feature moves one position later."""

    def replacement(original):
        def lengths_from_offsets(offsets, batch_sizes, variable_batch):
            shifted = offsets[0].clone()
            if shifted.numel() > 2:
                shifted[1:-1] = torch.minimum(shifted[1:-1] + 1, shifted[-1])
            return original([shifted, *offsets[1:]], batch_sizes, variable_batch)

        return lengths_from_offsets

    return _patched("_lengths_from_offsets", replacement)


@register("feature-key-swap", check=CHECK)
def feature_key_swap():
    """The first two keys trade names; their data stays where it was."""

    def replacement(original):
        def assemble(keys, features):
            swapped = list(keys)
            if len(swapped) > 1:
                swapped[0], swapped[1] = swapped[1], swapped[0]
            return original(swapped, features)

        return assemble

    return _patched("_assemble", replacement)


@register("weights-dropped", check=CHECK)
def weights_dropped():
    """Weights are silently left out of the KJT, as torchrec's own conversion does."""

    def replacement(original):
        def assemble(keys, features):
            for feature in features:
                feature.weights = None
            return original(keys, features)

        return assemble

    return _patched("_assemble", replacement)
