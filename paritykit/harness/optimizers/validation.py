"""A spec checked in the caller, before any rank runs: a HarnessError naming the key at fault.

    require_embedding_optimizer(spec, device)   # a fused optimizer the installed fbgemm trains on device,
                                                # with only hyper-parameters its kernel reads
    require_dense_optimizer(spec)               # a torch optimizer that takes every keyword named
"""

from __future__ import annotations

import inspect

import torch

from paritykit.errors import HarnessError
from paritykit.harness.optimizers.catalog import DENSE, FUSED, fused_problems
from paritykit.harness.optimizers.fbgemm import supported_fused_optimizers
from paritykit.harness.optimizers.spec import OptimizerSpec


def require_embedding_optimizer(spec: OptimizerSpec, device: str = "cpu") -> OptimizerSpec:
    """``spec`` as a fused embedding optimizer: a HarnessError naming the key at fault, before any rank runs."""
    if spec.fused is None:
        raise HarnessError(f"{spec.name!r} has no fused TBE equivalent; embedding tables train with one of {tuple(FUSED)}")
    supported = supported_fused_optimizers(device)
    if spec.name not in supported:
        raise HarnessError(f"embedding optimizer {spec.name!r} (fbgemm {spec.fused.emb_opt_type}) has no {device} kernel in the "
                           f"installed fbgemm; it has {supported}")
    problems = fused_problems(spec.fused, spec.kwargs)
    if problems:
        raise HarnessError(f"embedding optimizer {spec.describe()}: " + "; ".join(problems))
    return spec


def require_dense_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """``spec`` as a dense optimizer: a torch optimizer that takes every keyword the spec names."""
    if spec.name not in DENSE:
        raise HarnessError(f"{spec.name!r} is not a dense optimizer; dense parameters train with one of {tuple(DENSE)}")
    accepted = inspect.signature(spec.torch_class()).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(key for key in spec.kwargs if key not in accepted)
    if unknown and not takes_any:
        raise HarnessError(f"dense optimizer {spec.describe()}: {DENSE[spec.name][0]} takes no {unknown}")
    try:  # torch checks the values (betas below 1, ...) when it is built
        spec.torch_class()([torch.nn.Parameter(torch.zeros(1, 1))], **spec.arguments())
    except (ValueError, TypeError, RuntimeError) as exc:
        raise HarnessError(f"dense optimizer {spec.describe()}: {exc}") from exc
    return spec
