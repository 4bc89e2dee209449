"""What the installed torchrec offers to the budgets, detected by feature (never by version).

A budget whose region needs a missing feature raises UnsupportedByTorchrec: the case is reported
as unsupported, neither passed nor failed.
"""

from __future__ import annotations

import importlib

from paritykit.errors import UnsupportedByTorchrec


def require_torchrec_td_input(what: str) -> None:
    """torchrec's modules take a TensorDict through ``torchrec.sparse.tensor_dict.maybe_td_to_kjt``.

    EmbeddingCollection.forward and ShardedEmbeddingCollection.input_dist call it on their input;
    a torchrec without it has no TD input for ``what``.
    """
    try:
        module = importlib.import_module("torchrec.sparse.tensor_dict")
    except ImportError as exc:
        raise UnsupportedByTorchrec(f"{what}: this torchrec has no TensorDict input ({exc})") from None
    if not hasattr(module, "maybe_td_to_kjt"):
        raise UnsupportedByTorchrec(f"{what}: this torchrec has no torchrec.sparse.tensor_dict.maybe_td_to_kjt")


def require_regroup_as_dict() -> None:
    """``KeyedTensor.regroup_as_dict`` exists on this torchrec."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    if not hasattr(KeyedTensor, "regroup_as_dict"):
        raise UnsupportedByTorchrec("this torchrec's KeyedTensor has no regroup_as_dict")
