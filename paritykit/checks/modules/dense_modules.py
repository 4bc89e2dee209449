"""Each dense torchrec module as the check builds it from a spec, beside its reference.

``build(spec)`` returns torchrec's module (its parameters then overwritten with seeded values, biases
and norms included, so that a misplaced bias shows) and ``reference(spec, params, inputs)`` evaluates
the module's documented formula (formulas.py) on copies of those parameters, found by their
state-dict names. Activations are drawn as torchrec accepts them: a function (``torch.relu``), a
string (``"relu"``, ``"sigmoid"``, ``"swish_layernorm"``), one module shared by every layer
(``nn.Tanh()``) or a factory called once per layer (``lambda: nn.Sigmoid()``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from paritykit.checks.modules import formulas
from paritykit.errors import HarnessError, ParityError

Params = dict[str, torch.Tensor]

# activation name -> (what torchrec is given, factory of it; the formula's function)
ACTIVATIONS: dict[str, tuple[Callable[[], Any], Callable[[torch.Tensor], torch.Tensor]]] = {
    "torch.relu": (lambda: torch.relu, formulas.relu),
    "torch.sigmoid": (lambda: torch.sigmoid, formulas.sigmoid),
    "'relu'": (lambda: "relu", formulas.relu),
    "'sigmoid'": (lambda: "sigmoid", formulas.sigmoid),
    "nn.Tanh()": (lambda: torch.nn.Tanh(), formulas.tanh),
    "lambda: nn.Sigmoid()": (lambda: (lambda: torch.nn.Sigmoid()), formulas.sigmoid),
}
SWISH = "'swish_layernorm'"
MLP_ACTIVATIONS = tuple(ACTIVATIONS) + (SWISH,)
PERCEPTRON_ACTIVATIONS = ("torch.relu", "torch.sigmoid", "nn.Tanh()", "SwishLayerNorm(out)")
MIXTURE_ACTIVATIONS = ("torch.relu", "torch.sigmoid", "nn.Tanh()")
# The modules whose constructor takes the dtype (the others are moved with .to(dtype), as users do).
TAKES_DTYPE = ("perceptron", "mlp", "deep_fm")
# torchrec.models.dlrm's architectures: the tutorial's model is built from them.
DLRM_ARCHS = ("dense_arch", "over_arch", "interaction_arch", "interaction_dcn_arch", "interaction_projection_arch")
# The whole models: an EBC of SUM tables (``dims``: each table's (features, rows), ``rank`` the embedding
# dim), ``width`` dense input features, fed (dense (B, width), a KJT) and returning (B, 1) logits.
DLRM_MODELS = ("dlrm", "dlrm_dcn", "dlrm_projection")
DLRM_DENSE_HIDDEN, DLRM_OVER_HIDDEN, DLRM_DCN_LOW_RANK, DLRM_PROJECTIONS = 3, 2, 2, (2, 3)
# The ones fed (dense (B, D), sparse (B, F, D)); ``dims[0]`` is their (F, D).
INTERACTIONS = ("interaction_arch", "interaction_dcn_arch", "interaction_projection_arch")
KINDS = ("perceptron", "mlp", "swish_layer_norm", "cross_net", "low_rank_cross_net", "vector_cross_net",
         "mixture_cross_net", "factorization_machine", "deep_fm") + DLRM_ARCHS + DLRM_MODELS


@dataclass(frozen=True)
class DenseSpec:
    """One dense module and its input. ``sizes``: the MLP's layer sizes (Perceptron: one); ``dims``:
    the (N_k, D_k) of each embedding (FM, DeepFM), or SwishLayerNorm's (d1, d2) with ``norm_dims``
    normalized; ``layers``, ``rank``, ``experts``: the cross nets'. The DLRM archs: ``sizes`` the
    DenseArch's or OverArch's layers, or the projection's (F1, F2); ``dims`` an interaction's ((F, D),);
    ``layers`` and ``rank`` the DCN interaction's LowRankCrossNet. ``defaults``: a cross net built with
    its rank, experts and activation left out: torchrec's documented defaults (rank 1, relu; one expert,
    the form its docstring says skips the gates) are then the spec's."""

    kind: str
    batch: int
    width: int = 4
    sizes: tuple[int, ...] = ()
    activation: str = "torch.relu"
    bias: bool = True
    activation_on_last: bool = True
    layers: int = 1
    rank: int = 1
    experts: int = 1
    dims: tuple[tuple[int, int], ...] = ()
    norm_dims: int = 1
    dtype: str = "float32"
    seed: int = 0
    defaults: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def case_id(self) -> str:
        fields = {"perceptron": f"in={self.width} out={self.sizes} act={self.activation} bias={self.bias}",
                  "mlp": f"in={self.width} sizes={self.sizes} act={self.activation} bias={self.bias} last_act={self.activation_on_last}",
                  "swish_layer_norm": f"shape={self.dims} normalized_dims={self.norm_dims}",
                  "cross_net": f"N={self.width} layers={self.layers}",
                  "low_rank_cross_net": f"N={self.width} layers={self.layers} rank={self.rank}",
                  "vector_cross_net": f"N={self.width} layers={self.layers}",
                  "mixture_cross_net": f"N={self.width} layers={self.layers} rank={self.rank} experts={self.experts} act={self.activation}",
                  "factorization_machine": f"embeddings={self.dims}",
                  "deep_fm": f"embeddings={self.dims} mlp={self.sizes} act={self.activation}",
                  "dense_arch": f"in={self.width} sizes={self.sizes}",
                  "over_arch": f"in={self.width} sizes={self.sizes}",
                  "interaction_arch": f"F,D={self.dims}",
                  "interaction_dcn_arch": f"F,D={self.dims} layers={self.layers} rank={self.rank}",
                  "interaction_projection_arch": f"F,D={self.dims} F1,F2={self.sizes}",
                  **{kind: f"dense_in={self.width} tables(features,rows)={self.dims} D={self.rank} layers={self.layers}"
                     for kind in DLRM_MODELS}}[self.kind]
        return f"{self.kind} {fields} B={self.batch} {self.dtype} seed={self.seed}" + (" (defaults left out)" if self.defaults else "")


def _generator(spec: DenseSpec, *parts: Any) -> torch.Generator:
    from paritykit.harness.seeding import generator

    return generator("modules", spec.case_id(), *parts)


def _mlp(spec: DenseSpec, in_size: int) -> torch.nn.Module:
    from torchrec.modules.mlp import MLP

    kwargs: dict[str, Any] = {"bias": spec.bias, "dtype": spec.torch_dtype}
    if not spec.activation_on_last:
        if "activation_on_last" not in inspect.signature(MLP).parameters:
            raise HarnessError("this torchrec's MLP has no activation_on_last: the spec asks for it")
        kwargs["activation_on_last"] = False
    activation = "swish_layernorm" if spec.activation == SWISH else ACTIVATIONS[spec.activation][0]()
    return MLP(in_size, list(spec.sizes), activation=activation, **kwargs)


def _perceptron(spec: DenseSpec) -> torch.nn.Module:
    from torchrec.modules.activation import SwishLayerNorm
    from torchrec.modules.mlp import Perceptron

    out = spec.sizes[0]
    # SwishLayerNorm takes no dtype: the user moves it to the Perceptron's dtype.
    swish = spec.activation == "SwishLayerNorm(out)"
    activation = SwishLayerNorm(out).to(spec.torch_dtype) if swish else ACTIVATIONS[spec.activation][0]()
    return Perceptron(spec.width, out, bias=spec.bias, activation=activation, dtype=spec.torch_dtype)


def _module(spec: DenseSpec) -> torch.nn.Module:
    from torchrec.modules import crossnet, deepfm
    from torchrec.modules.activation import SwishLayerNorm

    n, layers = spec.width, spec.layers
    if spec.kind == "perceptron":
        return _perceptron(spec)
    if spec.kind == "mlp":
        return _mlp(spec, n)
    if spec.kind == "swish_layer_norm":
        d1, d2 = spec.dims[0]
        return SwishLayerNorm(d2 if spec.norm_dims == 1 else [d1, d2])
    if spec.kind == "cross_net":
        return crossnet.CrossNet(n, layers)
    if spec.defaults:
        return _with_defaults(spec)
    if spec.kind == "low_rank_cross_net":
        return crossnet.LowRankCrossNet(n, layers, low_rank=spec.rank)
    if spec.kind == "vector_cross_net":
        return crossnet.VectorCrossNet(n, layers)
    if spec.kind == "mixture_cross_net":
        return crossnet.LowRankMixtureCrossNet(n, layers, num_experts=spec.experts, low_rank=spec.rank,
                                               activation=ACTIVATIONS[spec.activation][0]())
    if spec.kind == "factorization_machine":
        return deepfm.FactorizationMachine()
    if spec.kind == "deep_fm":
        return deepfm.DeepFM(dense_module=_mlp(spec, sum(a * b for a, b in spec.dims)))
    if spec.kind in DLRM_ARCHS:
        return _dlrm_arch(spec)
    if spec.kind in DLRM_MODELS:
        return _dlrm_model(spec)
    raise HarnessError(f"unknown dense module kind {spec.kind!r}; known: {', '.join(KINDS)}")


DOCUMENTED_DEFAULTS = {"rank": 1, "experts": 1, "activation": "torch.relu"}


def _with_defaults(spec: DenseSpec) -> torch.nn.Module:
    from torchrec.modules import crossnet

    if spec.kind not in ("low_rank_cross_net", "mixture_cross_net") or any(getattr(spec, k) != v for k, v in DOCUMENTED_DEFAULTS.items()):
        raise HarnessError(f"defaults=True needs a low-rank or mixture cross net with {DOCUMENTED_DEFAULTS}, got {spec}")
    make = crossnet.LowRankCrossNet if spec.kind == "low_rank_cross_net" else crossnet.LowRankMixtureCrossNet
    return make(spec.width, spec.layers)


def _dlrm_arch(spec: DenseSpec) -> torch.nn.Module:
    from torchrec.models import dlrm
    from torchrec.modules.crossnet import LowRankCrossNet

    if spec.kind == "dense_arch":
        return dlrm.DenseArch(spec.width, list(spec.sizes))
    if spec.kind == "over_arch":
        return dlrm.OverArch(spec.width, list(spec.sizes))
    (f, d), = spec.dims
    if spec.kind == "interaction_arch":
        return dlrm.InteractionArch(f)
    if spec.kind == "interaction_dcn_arch":  # as torchrec's DLRM_DCN builds it: the crossnet over (F + 1) D
        return dlrm.InteractionDCNArch(f, LowRankCrossNet((f + 1) * d, spec.layers, low_rank=spec.rank))
    f1, f2 = spec.sizes  # the branches as torchrec's DLRM_Projection builds them: DenseArchs to F1 D and F2 D
    return dlrm.InteractionProjectionArch(f, dlrm.DenseArch((f + 1) * d, [f1 * d]), dlrm.DenseArch((f + 1) * d, [f2 * d]))


def dlrm_features(spec: DenseSpec) -> list[tuple[str, str]]:
    """(table, feature) of a DLRM spec's EBC, in the EBC's order: table t{i} looks up f{i}_{j}."""
    return [(f"t{i}", f"f{i}_{j}") for i, (count, _rows) in enumerate(spec.dims) for j in range(count)]


def dlrm_batch(spec: DenseSpec) -> dict[str, list[list[int]]]:
    """Each feature's bags of ids (0-2 ids a sample, empty bags included), in the KJT's key order:
    the EBC's reversed, so that the model must reorder them."""
    rows = {f"t{i}": r for i, (_count, r) in enumerate(spec.dims)}
    generator = _generator(spec, "ids")
    batch = {}
    for table, feature in reversed(dlrm_features(spec)):
        lengths = torch.randint(0, 3, (spec.batch,), generator=generator).tolist()
        batch[feature] = [torch.randint(0, rows[table], (n,), generator=generator).tolist() for n in lengths]
    return batch


def _dlrm_kjt(spec: DenseSpec):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = dlrm_batch(spec)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(batch), values=torch.tensor([i for bags in batch.values() for bag in bags for i in bag], dtype=torch.int64),
        lengths=torch.tensor([len(bag) for bags in batch.values() for bag in bags], dtype=torch.int32))


def _dlrm_model(spec: DenseSpec) -> torch.nn.Module:
    from torchrec.models import dlrm
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    d = spec.rank
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=rows,
                                  feature_names=[f for t, f in dlrm_features(spec) if t == f"t{i}"])
               for i, (_count, rows) in enumerate(spec.dims)]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    arch = {"embedding_bag_collection": ebc, "dense_in_features": spec.width,
            "dense_arch_layer_sizes": [DLRM_DENSE_HIDDEN, d], "over_arch_layer_sizes": [DLRM_OVER_HIDDEN, 1]}
    if spec.kind == "dlrm_dcn":
        return dlrm.DLRM_DCN(**arch, dcn_num_layers=spec.layers, dcn_low_rank_dim=DLRM_DCN_LOW_RANK)
    if spec.kind == "dlrm_projection":
        f1, f2 = DLRM_PROJECTIONS
        return dlrm.DLRM_Projection(**arch, interaction_branch1_layer_sizes=[f1 * d], interaction_branch2_layer_sizes=[f2 * d])
    return dlrm.DLRM(**arch)


def build(spec: DenseSpec) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """torchrec's module in the spec's dtype with seeded parameters, and its seeded inputs."""
    module = _module(spec)
    if spec.kind not in TAKES_DTYPE:
        module = module.to(spec.torch_dtype)
    wrong = [(name, p.dtype) for name, p in module.named_parameters() if p.dtype != spec.torch_dtype]
    if wrong:
        raise ParityError(f"{spec.kind} built with dtype={spec.dtype} has {wrong[0][0]} in {wrong[0][1]} "
                          f"({len(wrong)} parameter(s) not in {spec.dtype}) [{spec.case_id()}]")
    with torch.no_grad():
        for name, param in module.named_parameters():
            values = torch.randn(param.shape, generator=_generator(spec, name), dtype=torch.float64)
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            scale = 1.0 / fan_in ** 0.5 if param.dim() > 1 else 0.5
            # LayerNorm's scale near one (as trained), every other parameter centred on zero.
            param.copy_(1.0 + 0.25 * values if name.endswith("norm.0.weight") else scale * values)
    return module, _inputs(spec)


def _inputs(spec: DenseSpec) -> list[torch.Tensor]:
    def draw(*shape: int, part: int = 0) -> torch.Tensor:
        return torch.randn(shape, generator=_generator(spec, "input", part), dtype=torch.float64).to(spec.torch_dtype)

    if spec.kind in ("factorization_machine", "deep_fm"):
        return [draw(spec.batch, n, d, part=k) for k, (n, d) in enumerate(spec.dims)]
    if spec.kind == "swish_layer_norm":
        return [draw(spec.batch, *spec.dims[0])]
    if spec.kind in INTERACTIONS:
        (f, d), = spec.dims
        return [draw(spec.batch, d, part=0), draw(spec.batch, f, d, part=1)]
    return [draw(spec.batch, spec.width)]


def call(spec: DenseSpec, module: torch.nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor:
    """torchrec's forward as users call it."""
    if spec.kind in ("factorization_machine", "deep_fm"):
        return module(embeddings=inputs)
    if spec.kind in INTERACTIONS:
        return module(dense_features=inputs[0], sparse_features=inputs[1])
    if spec.kind in DLRM_MODELS:
        return module(dense_features=inputs[0], sparse_features=_dlrm_kjt(spec))
    return module(inputs[0])
