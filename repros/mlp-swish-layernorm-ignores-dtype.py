"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue mlp-swish-layernorm-ignores-dtype (listed for torchrec >=1.8,<1.10).

MLP(activation="swish_layernorm", dtype=...) builds its Perceptrons and SwishLayerNorms without the
dtype (the swish_layernorm branch of MLP.__init__ does not pass it on), so its parameters are float32
whatever dtype asks for, and a float64 input fails in the first linear layer.

What to do instead: build the MLP, then move it with .to(dtype).

The script builds torchrec.modules.mlp.MLP(4, [4, 5], activation="swish_layernorm",
dtype=torch.float64), checks that every parameter is float64, and runs it on a seeded float64 batch
of 3 samples. Its oracle is the MLP's documented formula written out by hand in float64 on the same
parameters: per layer y = x W^T + b, then y * sigmoid((y - mean) / sqrt(var + 1e-5) * gamma + beta)
(SwishLayerNorm's Y = X * Sigmoid(LayerNorm(X))), mean and biased variance over the layer's features. The outputs must agree within 64 units of float64 roundoff times (|expected| + max|expected|)
(the same sums in another order).

    python this_script.py            activation="swish_layernorm", dtype=torch.float64
    python this_script.py --control  activation="relu", dtype=torch.float64 (the same MLP, whose
                                     other branch passes the dtype on), against relu(x W^T + b)

    exit 0: the MLP is float64 and computes the formula
    exit 1: it is not, or torchrec raised (the message says where)
    exit 2: the script itself could not run
"""

import argparse
import sys
import traceback

import torch

UNITS = 64


def formula(x, params, swish):
    """The MLP's documented output, by hand, from its state dict (names: _mlp.<i>._linear.weight, ...)."""
    layer = 0
    while f"_mlp.{layer}._linear.weight" in params:
        at = f"_mlp.{layer}."
        y = x @ params[at + "_linear.weight"].T + params[at + "_linear.bias"]
        if swish:
            mean = y.mean(dim=-1, keepdim=True)
            var = ((y - mean) ** 2).mean(dim=-1, keepdim=True)
            norm = (y - mean) / torch.sqrt(var + 1e-5) * params[at + "_activation_fn.norm.0.weight"] + params[at + "_activation_fn.norm.0.bias"]
            x = y * (1 / (1 + torch.exp(-norm)))
        else:
            x = torch.where(y > 0, y, torch.zeros_like(y))
        layer += 1
    return x


def run(control):
    from torchrec.modules.mlp import MLP

    torch.manual_seed(0)
    activation = "relu" if control else "swish_layernorm"
    mlp = MLP(4, [4, 5], activation=activation, dtype=torch.float64)
    wrong = [(name, p.dtype) for name, p in mlp.named_parameters() if p.dtype != torch.float64]
    if wrong:
        return 1, (f"REPRODUCED: MLP(activation={activation!r}, dtype=torch.float64) has {len(wrong)} parameter(s) "
                   f"not in float64, first {wrong[0][0]} in {wrong[0][1]}")
    x = torch.randn(3, 4, dtype=torch.float64)
    try:
        actual = mlp(x)
    except Exception as exc:  # torchrec raised: the defect shows
        return 1, f"REPRODUCED: MLP(activation={activation!r}) forward raised {type(exc).__name__}: {exc}"
    params = {name: p.detach() for name, p in mlp.named_parameters()}
    expected = formula(x, params, swish=not control)
    u = torch.finfo(torch.float64).eps / 2
    bound = UNITS * u * (expected.abs() + expected.abs().max())
    diff = (actual.detach() - expected).abs()
    if actual.dtype != torch.float64 or bool((diff > bound).any()):
        index = int((diff - bound).argmax())
        return 1, f"REPRODUCED: output {actual.dtype} differs from the formula at flat index {index}: {diff.max().item():.3g}"
    return 0, f"OK: MLP(activation={activation!r}, dtype=torch.float64) is float64 and matches its formula (max diff {diff.max().item():.3g})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", action="store_true", help="activation='relu': the branch that passes the dtype on")
    args = parser.parse_args()
    try:
        code, line = run(args.control)
    except Exception:
        print("CANNOT RUN: " + traceback.format_exc().strip().splitlines()[-1])
        return 2
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
