"""The reference side of a dense case: the documented formula (formulas.py) on copies of torchrec's
parameters, read by their state-dict names (the names are torchrec's public checkpoint format)."""

from __future__ import annotations

from typing import Callable

import torch

from paritykit.checks.modules import formulas
from paritykit.checks.modules.dense_modules import (ACTIVATIONS, DLRM_ARCHS, DLRM_MODELS, DLRM_OVER_HIDDEN, SWISH,
                                                    DenseSpec, Params, dlrm_batch, dlrm_features)
from paritykit.errors import HarnessError, ParityError

Tensor = torch.Tensor


def _activation(spec: DenseSpec, params: Params, prefix: str, width: int) -> Callable[[Tensor], Tensor]:
    """The formula of the activation named by the spec, for the layer whose parameters start with ``prefix``."""
    if spec.activation in (SWISH, "SwishLayerNorm(out)"):
        weight, bias = params[f"{prefix}_activation_fn.norm.0.weight"], params[f"{prefix}_activation_fn.norm.0.bias"]
        return lambda x: formulas.swish_layer_norm(x, 1, weight, bias)
    return ACTIVATIONS[spec.activation][1]


def _mlp(spec: DenseSpec, params: Params, x: Tensor, prefix: str) -> Tensor:
    layers = []
    for i, size in enumerate(spec.sizes):
        at = f"{prefix}_mlp.{i}."
        last_bare = not spec.activation_on_last and i == len(spec.sizes) - 1
        activation = (lambda t: t) if last_bare else _activation(spec, params, at, size)
        layers.append((params[f"{at}_linear.weight"], _bias(spec, params, f"{at}_linear.bias"), activation))
    return formulas.mlp(x, layers)


def _bias(spec: DenseSpec, params: Params, name: str) -> Tensor | None:
    """A linear layer's bias exactly where the user asked for one (bias=True)."""
    if spec.bias != (name in params):
        raise ParityError(f"{spec.kind} built with bias={spec.bias}: its parameters {'lack' if spec.bias else 'hold'} {name!r}")
    return params[name] if spec.bias else None


def _per_layer(params: Params, name: str, layers: int) -> list[Tensor]:
    return [params[f"{name}.{layer}"] for layer in range(layers)]


def _mixture(spec: DenseSpec, params: Params, x: Tensor) -> Tensor:
    layers = [{"U": params[f"U_kernels.{l}"], "C": params[f"C_kernels.{l}"], "V": params[f"V_kernels.{l}"],
               "b": params[f"bias.{l}"].reshape(-1)} for l in range(spec.layers)]
    gates = None if spec.experts == 1 else [params[f"gates.{i}.weight"].reshape(-1) for i in range(spec.experts)]
    return formulas.mixture_cross_net(x, layers, gates, ACTIVATIONS[spec.activation][1])


def _relu_layers(params: Params, prefix: str, count: int) -> list:
    """A DenseArch's or OverArch's MLP: ``count`` relu perceptrons under ``prefix``."""
    return [(params[f"{prefix}_mlp.{i}._linear.weight"], params[f"{prefix}_mlp.{i}._linear.bias"], formulas.relu)
            for i in range(count)]


def _dlrm_arch(spec: DenseSpec, params: Params, inputs: list[Tensor]) -> Tensor:
    """torchrec.models.dlrm's archs: DenseArch an MLP with relu after every layer; OverArch one with relu
    after all but the last, a plain linear layer; the interactions over the dense output and the
    sparse features (none: the dense output alone)."""
    if spec.kind == "dense_arch":
        return formulas.mlp(inputs[0], _relu_layers(params, "model.", len(spec.sizes)))
    if spec.kind == "over_arch":
        hidden = formulas.mlp(inputs[0], _relu_layers(params, "model.0.", len(spec.sizes) - 1))
        return formulas.linear(hidden, params["model.1.weight"], params["model.1.bias"])
    dense, sparse = inputs
    if sparse.shape[1] == 0:
        return dense
    if spec.kind == "interaction_arch":
        return formulas.dlrm_interaction(dense, sparse)
    combined = torch.cat([dense, sparse.reshape(sparse.shape[0], -1)], dim=1)
    if spec.kind == "interaction_dcn_arch":
        return formulas.low_rank_cross_net(combined, _per_layer(params, "crossnet.W_kernels", spec.layers),
                                           _per_layer(params, "crossnet.V_kernels", spec.layers),
                                           _per_layer(params, "crossnet.bias", spec.layers))
    branches = [formulas.mlp(combined, _relu_layers(params, f"interaction_branch{k}.model.", 1)) for k in (1, 2)]
    return formulas.dlrm_projection_interaction(dense, *branches)


def _sparse_arch(spec: DenseSpec, params: Params) -> Tensor:
    """DLRM's SparseArch by hand: each feature's bags summed from its table's rows, the features in the
    EBC's order (not the KJT's), stacked (B, F, D)."""
    batch, pooled = dlrm_batch(spec), []
    for table, feature in dlrm_features(spec):
        weight = params[f"sparse_arch.embedding_bag_collection.embedding_bags.{table}.weight"]
        # index_select of an empty bag still reaches the table: torchrec's zero gradient has its counterpart.
        rows = [weight.index_select(0, torch.tensor(bag, dtype=torch.int64)).sum(dim=0) for bag in batch[feature]]
        pooled.append(torch.stack(rows))
    return torch.stack(pooled, dim=1)


def _dlrm_model(spec: DenseSpec, params: Params, dense_input: Tensor) -> Tensor:
    """DLRM.forward: the dense arch, the sparse arch, their interaction, the over arch; each arch's
    formula as above, with the parameters under the model's names."""
    def under(prefix: str) -> Params:
        return {name[len(prefix):]: t for name, t in params.items() if name.startswith(prefix)}

    dense = formulas.mlp(dense_input, _relu_layers(params, "dense_arch.model.", 2))
    sparse = _sparse_arch(spec, params)
    (f, d) = (sparse.shape[1], spec.rank)
    inter_kind = {"dlrm": "interaction_arch", "dlrm_dcn": "interaction_dcn_arch",
                  "dlrm_projection": "interaction_projection_arch"}[spec.kind]
    inter = _dlrm_arch(DenseSpec(inter_kind, spec.batch, dims=((f, d),), layers=spec.layers), under("inter_arch."),
                       [dense, sparse])
    return _dlrm_arch(DenseSpec("over_arch", spec.batch, sizes=(DLRM_OVER_HIDDEN, 1)), under("over_arch."), [inter])


def reference(spec: DenseSpec, params: Params, inputs: list[Tensor]) -> Tensor:
    """The module's documented output for ``inputs`` under ``params``."""
    x, layers = inputs[0], spec.layers
    if spec.kind == "perceptron":
        activation = _activation(spec, params, "", spec.sizes[0])
        return formulas.mlp(x, [(params["_linear.weight"], _bias(spec, params, "_linear.bias"), activation)])
    if spec.kind == "mlp":
        return _mlp(spec, params, x, "")
    if spec.kind == "swish_layer_norm":
        return formulas.swish_layer_norm(x, spec.norm_dims, params["norm.0.weight"], params["norm.0.bias"])
    if spec.kind == "cross_net":
        biases = [b.reshape(-1) for b in _per_layer(params, "bias", layers)]
        return formulas.cross_net(x, _per_layer(params, "kernels", layers), biases)
    if spec.kind == "low_rank_cross_net":
        return formulas.low_rank_cross_net(x, _per_layer(params, "W_kernels", layers), _per_layer(params, "V_kernels", layers),
                                           _per_layer(params, "bias", layers))
    if spec.kind == "vector_cross_net":
        kernels = [k.reshape(-1) for k in _per_layer(params, "kernels", layers)]
        return formulas.vector_cross_net(x, kernels, [b.reshape(-1) for b in _per_layer(params, "bias", layers)])
    if spec.kind == "mixture_cross_net":
        return _mixture(spec, params, x)
    if spec.kind == "factorization_machine":
        return formulas.factorization_machine(inputs)
    if spec.kind == "deep_fm":
        return _mlp(spec, params, formulas.flatten_concat(inputs), "dense_module.")
    if spec.kind in DLRM_ARCHS:
        return _dlrm_arch(spec, params, inputs)
    if spec.kind in DLRM_MODELS:
        return _dlrm_model(spec, params, inputs[0])
    raise HarnessError(f"no reference for dense module kind {spec.kind!r}")
