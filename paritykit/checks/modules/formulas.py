"""The documented formula of each dense torchrec module, written out in plain torch ops.

Nothing here calls torchrec, nor a torch module or functional that would do the module's job for
it (no nn.Linear, nn.LayerNorm, F.layer_norm, F.softmax): each function is the formula of the
module's docstring (or of the paper the docstring cites), applied to parameter tensors passed in by
the caller. torchrec's modules are (B, N) -> (B, N) maps; ``x0`` is their input.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Tensor = torch.Tensor
# torch.nn.LayerNorm's default eps: SwishLayerNorm builds its LayerNorm with the default.
LAYER_NORM_EPS = 1e-5


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b (weight is (out, in), as torch stores it)."""
    y = x @ weight.transpose(0, 1)
    return y if bias is None else y + bias


def relu(x: Tensor) -> Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def sigmoid(x: Tensor) -> Tensor:
    return 1 / (1 + torch.exp(-x))


def tanh(x: Tensor) -> Tensor:
    # 1 - 2 / (exp(2x) + 1) stays finite for large |x| (exp overflows to inf, 2 / inf = 0).
    return 1 - 2 / (torch.exp(2 * x) + 1)


def softmax(z: Tensor, dim: int) -> Tensor:
    shifted = torch.exp(z - z.amax(dim=dim, keepdim=True))
    return shifted / shifted.sum(dim=dim, keepdim=True)


def layer_norm(x: Tensor, normalized_dims: int, weight: Tensor, bias: Tensor, eps: float = LAYER_NORM_EPS) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias, mean and (biased) variance over the last
    ``normalized_dims`` dimensions of x."""
    dims = tuple(range(x.dim() - normalized_dims, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def swish_layer_norm(x: Tensor, normalized_dims: int, weight: Tensor, bias: Tensor) -> Tensor:
    """SwishLayerNorm's docstring: Y = X * Sigmoid(LayerNorm(X))."""
    return x * sigmoid(layer_norm(x, normalized_dims, weight, bias))


def mlp(x: Tensor, layers: Sequence[tuple[Tensor, Tensor | None, Callable[[Tensor], Tensor]]]) -> Tensor:
    """A stack of perceptrons: x <- activation(x W^T + b), layer after layer (the last one's
    activation included unless the caller passes the identity)."""
    for weight, bias, activation in layers:
        x = activation(linear(x, weight, bias))
    return x


def cross_net(x0: Tensor, kernels: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """CrossNet: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, W_l (N x N)."""
    x = x0
    for kernel, bias in zip(kernels, biases):
        x = x0 * (x @ kernel.transpose(0, 1) + bias) + x
    return x


def low_rank_cross_net(x0: Tensor, w_kernels: Sequence[Tensor], v_kernels: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """LowRankCrossNet: x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l, W_l (N x r), V_l (r x N)."""
    x = x0
    for w, v, bias in zip(w_kernels, v_kernels, biases):
        x = x0 * ((x @ v.transpose(0, 1)) @ w.transpose(0, 1) + bias) + x
    return x


def vector_cross_net(x0: Tensor, kernels: Sequence[Tensor], biases: Sequence[Tensor]) -> Tensor:
    """VectorCrossNet is DCN-V1 (its docstring cites it): x_{l+1} = x_0 (x_l . w_l) + b_l + x_l, w_l (N).

    The bias is added outside the product, as in the paper (eq. 3); the docstring's
    ``x_0 * (W_l . x_l + b_l)`` puts it inside, which the paper does not (docs/modules.md)."""
    x = x0
    for w, bias in zip(kernels, biases):
        x = x0 * (x * w).sum(dim=1, keepdim=True) + bias + x
    return x


def mixture_cross_net(x0: Tensor, layers: Sequence[dict[str, Tensor]], gates: Sequence[Tensor] | None,
                      g: Callable[[Tensor], Tensor]) -> Tensor:
    """LowRankMixtureCrossNet (DCN-V2's mixture of low-rank experts):
    expert_i = x_0 * (U_i g(C_i g(V_i x_l)) + b_l), U_i (N x r), C_i (r x r), V_i (r x N);
    x_{l+1} = sum_i softmax_i(gate_i . x_l) expert_i + x_l, or expert_0 + x_l with one expert (no gate).
    Each layer is {"U": (K, N, r), "C": (K, r, r), "V": (K, r, N), "b": (N)}; gates[i] is (N)."""
    x = x0
    for layer in layers:
        experts = [x0 * (g(g(x @ v.transpose(0, 1)) @ c.transpose(0, 1)) @ u.transpose(0, 1) + layer["b"])
                   for u, c, v in zip(layer["U"], layer["C"], layer["V"])]
        if gates is None:
            x = experts[0] + x
            continue
        scores = torch.stack([(x * gate).sum(dim=1) for gate in gates], dim=1)  # (B, K)
        weights = softmax(scores, dim=1)  # over the experts, per sample
        x = sum(weights[:, i:i + 1] * expert for i, expert in enumerate(experts)) + x
    return x


def flatten_concat(embeddings: Sequence[Tensor]) -> Tensor:
    """DeepFM's and FactorizationMachine's input: each (B, N_k, D_k) flattened to (B, N_k D_k), concatenated."""
    return torch.cat([e.reshape(e.shape[0], -1) for e in embeddings], dim=1)


def factorization_machine(embeddings: Sequence[Tensor]) -> Tensor:
    """FactorizationMachine on the flattened, concatenated input x (its docstring): the sum of the
    pairwise products sum_{i<j} x_i x_j per sample, (B, 1), computed pair by pair (not through torchrec's
    0.5 * ((sum x)^2 - sum x^2) identity)."""
    x = flatten_concat(embeddings)
    pairs = x.unsqueeze(2) * x.unsqueeze(1)  # (B, M, M)
    upper = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(diagonal=1)
    return (pairs * upper).sum(dim=(1, 2)).unsqueeze(1)


def dlrm_interaction(dense: Tensor, sparse: Tensor) -> Tensor:
    """DLRM's dot interaction (InteractionArch's docstring; the DLRM paper): with the dense output as
    feature 0 before the F sparse ones, the dot product of every pair i < j, in row-major order
    (dense with each sparse feature, then the sparse pairs), after the dense output itself:
    (B, D + F + F choose 2). No sparse features: the dense output alone."""
    features = [dense] + [sparse[:, k] for k in range(sparse.shape[1])]
    dots = [(features[i] * features[j]).sum(dim=1, keepdim=True)
            for i in range(len(features)) for j in range(i + 1, len(features))]
    return torch.cat([dense] + dots, dim=1)


def dlrm_projection_interaction(dense: Tensor, branch1: Tensor, branch2: Tensor) -> Tensor:
    """InteractionProjectionArch's docstring: Y (B, F1, D) and Z (B, D, F2), the branches' outputs
    reshaped; Y Z per sample, flattened, after the dense output: (B, D + F1 F2)."""
    batch, d = dense.shape
    y, z = branch1.reshape(batch, -1, d), branch2.reshape(batch, d, -1)
    products = (y.unsqueeze(3) * z.unsqueeze(1)).sum(dim=2)  # (B, F1, F2): sum over D of y[b, i, :] z[b, :, j]
    return torch.cat([dense, products.reshape(batch, -1)], dim=1)
