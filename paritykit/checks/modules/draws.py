"""The drawn dense cases (hypothesis), one strategy per module family, and the pinned ones each
family always runs first: the configurations its planted bugs need (two cross layers, so that x_l
is not x_0; several experts, a batch of several samples; embeddings of one dimension; SwishLayerNorm
over two dimensions; an MLP with its last activation)."""

from __future__ import annotations

from hypothesis import strategies as st

from paritykit.checks.modules.dense_modules import (DLRM_ARCHS, DLRM_MODELS, MIXTURE_ACTIVATIONS, MLP_ACTIVATIONS,
                                                    PERCEPTRON_ACTIVATIONS, SWISH, DenseSpec)

DTYPES = ("float32", "float64")
_batch = st.integers(1, 6)
_width = st.integers(1, 8)
_layers = st.integers(1, 4)
_seed = st.integers(0, 2**16)
_dtype = st.sampled_from(DTYPES)
# A LayerNorm over few elements is ill-conditioned: its gradient passes through 1 / sqrt(var + eps), and
# two or three values drawn close together make that 1 / sqrt(eps) (its rounding then dominates any
# bound stated in the terms' size). SwishLayerNorm normalizes over four elements at least in the draws.
SWISH_SMALLEST = 4


@st.composite
def _mlp(draw: st.DrawFn, kind: str = "mlp") -> DenseSpec:
    activation = draw(st.sampled_from(MLP_ACTIVATIONS))
    # MLP("swish_layernorm") ignores its dtype (a known issue): float32 only in the draws.
    dtype = "float32" if activation == SWISH else draw(_dtype)
    smallest = SWISH_SMALLEST if activation == SWISH else 1
    sizes = tuple(draw(st.lists(st.integers(smallest, 8), min_size=1, max_size=3)))
    return DenseSpec(kind, draw(_batch), draw(_width), sizes, activation, draw(st.booleans()), draw(st.booleans()),
                     dtype=dtype, seed=draw(_seed))


@st.composite
def _perceptron(draw: st.DrawFn) -> DenseSpec:
    activation = draw(st.sampled_from(PERCEPTRON_ACTIVATIONS))
    out = draw(st.integers(SWISH_SMALLEST if activation == "SwishLayerNorm(out)" else 1, 8))
    return DenseSpec("perceptron", draw(_batch), draw(_width), (out,), activation, draw(st.booleans()), dtype=draw(_dtype),
                     seed=draw(_seed))


@st.composite
def _swish(draw: st.DrawFn) -> DenseSpec:
    norm_dims = draw(st.sampled_from((1, 2)))
    last = draw(st.integers(SWISH_SMALLEST if norm_dims == 1 else 2, 6))
    shape = (draw(st.integers(1 if norm_dims == 1 else 2, 4)), last)
    return DenseSpec("swish_layer_norm", draw(_batch), dims=(shape,), norm_dims=norm_dims,
                     dtype=draw(_dtype), seed=draw(_seed))


@st.composite
def _cross(draw: st.DrawFn, kind: str) -> DenseSpec:
    rank = draw(st.integers(1, 4)) if kind in ("low_rank_cross_net", "mixture_cross_net") else 1
    experts = draw(st.integers(1, 4)) if kind == "mixture_cross_net" else 1
    activation = draw(st.sampled_from(MIXTURE_ACTIVATIONS)) if kind == "mixture_cross_net" else "torch.relu"
    return DenseSpec(kind, draw(_batch), draw(_width), layers=draw(_layers), rank=rank, experts=experts,
                     activation=activation, dtype=draw(_dtype), seed=draw(_seed))


_embeddings = st.lists(st.tuples(st.integers(1, 2), st.integers(1, 4)), min_size=1, max_size=3).map(tuple)


@st.composite
def _fm(draw: st.DrawFn) -> DenseSpec:
    return DenseSpec("factorization_machine", draw(_batch), dims=draw(_embeddings), dtype=draw(_dtype), seed=draw(_seed))


@st.composite
def _deep_fm(draw: st.DrawFn) -> DenseSpec:
    mlp = draw(_mlp("deep_fm"))
    return DenseSpec("deep_fm", mlp.batch, sizes=mlp.sizes, activation=mlp.activation, bias=mlp.bias,
                     activation_on_last=mlp.activation_on_last, dims=draw(_embeddings), dtype=mlp.dtype, seed=mlp.seed)


_layer_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
# (F, D): no sparse feature at all included (the archs return the dense output alone).
_features = st.tuples(st.integers(0, 4), st.integers(1, 4)).map(lambda fd: (fd,))


@st.composite
def _dlrm_arch(draw: st.DrawFn, kind: str) -> DenseSpec:
    batch, dtype, seed = draw(_batch), draw(_dtype), draw(_seed)
    if kind in ("dense_arch", "over_arch"):
        sizes = draw(_layer_sizes) if kind == "dense_arch" else draw(_layer_sizes) + (draw(st.integers(1, 3)),)
        return DenseSpec(kind, batch, draw(_width), sizes, dtype=dtype, seed=seed)
    dims = draw(_features)
    if kind == "interaction_arch":
        return DenseSpec(kind, batch, dims=dims, dtype=dtype, seed=seed)
    if kind == "interaction_dcn_arch":
        return DenseSpec(kind, batch, dims=dims, layers=draw(st.integers(1, 3)), rank=draw(st.integers(1, 3)),
                         dtype=dtype, seed=seed)
    return DenseSpec(kind, batch, sizes=(draw(st.integers(1, 3)), draw(st.integers(1, 3))), dims=dims, dtype=dtype, seed=seed)


@st.composite
def _dlrm_model(draw: st.DrawFn, kind: str) -> DenseSpec:
    tables = tuple(draw(st.lists(st.tuples(st.integers(1, 2), st.integers(2, 6)), min_size=1, max_size=3)))
    # float32 only: an EBC moved to float64 still returns float32 pools (its tables' config data_type).
    return DenseSpec(kind, draw(_batch), draw(st.integers(1, 5)), dims=tables, rank=draw(st.integers(1, 3)),
                     layers=draw(st.integers(1, 2)), seed=draw(_seed))


def strategies() -> dict[str, st.SearchStrategy[DenseSpec]]:
    """Module family -> its strategy, in gate order."""
    return {
        "perceptron": _perceptron(),
        "mlp": _mlp(),
        "swish_layer_norm": _swish(),
        "cross_net": _cross("cross_net"),
        "low_rank_cross_net": _cross("low_rank_cross_net"),
        "vector_cross_net": _cross("vector_cross_net"),
        "mixture_cross_net": _cross("mixture_cross_net"),
        "factorization_machine": _fm(),
        "deep_fm": _deep_fm(),
        **{kind: _dlrm_arch(kind) for kind in DLRM_ARCHS},
        **{kind: _dlrm_model(kind) for kind in DLRM_MODELS},
    }


PINNED: dict[str, tuple[DenseSpec, ...]] = {
    # bias=False pinned: a linear layer given a bias all the same shows (the reference takes none).
    "perceptron": (DenseSpec("perceptron", 3, 4, (3,), "SwishLayerNorm(out)"), DenseSpec("perceptron", 3, 4, (3,), "torch.relu", False)),
    "mlp": (DenseSpec("mlp", 4, 5, (4, 3), "torch.relu"), DenseSpec("mlp", 3, 5, (4, 2), SWISH), DenseSpec("mlp", 3, 5, (4, 4), SWISH, False),
            DenseSpec("mlp", 3, 4, (3, 2), "lambda: nn.Sigmoid()", activation_on_last=False, dtype="float64")),
    "swish_layer_norm": (DenseSpec("swish_layer_norm", 3, dims=((3, 4),), norm_dims=2),),
    "cross_net": (DenseSpec("cross_net", 3, 5, layers=2),),
    "low_rank_cross_net": (DenseSpec("low_rank_cross_net", 3, 6, layers=2, rank=2), DenseSpec("low_rank_cross_net", 3, 5, layers=2, defaults=True)),
    "vector_cross_net": (DenseSpec("vector_cross_net", 3, 5, layers=2),),
    "mixture_cross_net": (DenseSpec("mixture_cross_net", 4, 5, layers=2, rank=2, experts=3, activation="nn.Tanh()"),
                          DenseSpec("mixture_cross_net", 3, 5, layers=2, defaults=True),
                          # Two experts: the fewest that are gated (one skips the gates).
                          DenseSpec("mixture_cross_net", 3, 4, layers=1, rank=2, experts=2, activation="torch.sigmoid")),
    "factorization_machine": (DenseSpec("factorization_machine", 3, dims=((2, 3), (3, 3))),),
    "deep_fm": (DenseSpec("deep_fm", 3, sizes=(4, 1), dims=((2, 3), (1, 4))),),
    "dense_arch": (DenseSpec("dense_arch", 3, 4, (3, 2)),),
    "over_arch": (DenseSpec("over_arch", 3, 4, (3, 2, 1)),),
    # Three sparse features of two dims: the dense-sparse dots before the sparse pairs; and none at all.
    "interaction_arch": (DenseSpec("interaction_arch", 3, dims=((3, 2),)), DenseSpec("interaction_arch", 2, dims=((0, 3),))),
    "interaction_dcn_arch": (DenseSpec("interaction_dcn_arch", 3, dims=((2, 2),), layers=2, rank=2),),
    # F1 != F2, so that Y and Z reshaped the other way round do not fit the same product.
    "interaction_projection_arch": (DenseSpec("interaction_projection_arch", 3, sizes=(2, 3), dims=((2, 2),)),),
    # Two tables, one with two features: the KJT's keys come in reverse order of the EBC's.
    **{kind: (DenseSpec(kind, 3, 4, dims=((2, 5), (1, 4)), rank=2, layers=2),) for kind in DLRM_MODELS},
}
