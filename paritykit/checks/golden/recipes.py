"""The golden recipes: each builds its inputs and weights from a seed and computes the reference
numbers with the plain, unsharded module (outputs, gradients, or a few training steps)."""

from __future__ import annotations

from typing import Any, Callable

import torch

Recipe = Callable[[], tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]]
RECIPES: dict[str, Recipe] = {}


def recipe(name: str) -> Callable[[Recipe], Recipe]:
    def decorator(fn: Recipe) -> Recipe:
        RECIPES[name] = fn
        return fn

    return decorator


def _tables(weighted: bool = False):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    # Per-sample weights are defined for SUM pooling only.
    second_pooling = PoolingType.SUM if weighted else PoolingType.MEAN
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"], pooling=PoolingType.SUM),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=7, feature_names=["f2"], pooling=second_pooling),
    ]


def _batch(generator: torch.Generator, weighted: bool) -> dict[str, torch.Tensor]:
    lengths = torch.randint(0, 4, (3 * 4,), generator=generator)
    # f0, f1 index t0 (10 rows), f2 indexes t1 (7 rows).
    limits = torch.tensor([10] * 8 + [7] * 4).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=generator) * limits).long()
    batch = {"lengths": lengths, "values": values}
    if weighted:
        batch["weights"] = torch.rand(values.numel(), generator=generator)
    return batch


def _kjt(batch: dict[str, torch.Tensor]):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], batch["values"], batch["lengths"], weights=batch.get("weights"))


def _ebc_recipe(weighted: bool) -> Recipe:
    def build():
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        generator = torch.Generator().manual_seed(1234 + weighted)
        ebc = EmbeddingBagCollection(tables=_tables(weighted), is_weighted=weighted)
        weights = {k: torch.randn(v.shape, generator=generator) for k, v in ebc.state_dict().items()}
        inputs = {"weights": weights, "batch": _batch(generator, weighted)}

        def compute(stored: dict[str, Any]):
            module = EmbeddingBagCollection(tables=_tables(weighted), is_weighted=weighted)
            module.load_state_dict(stored["weights"])
            output = module(_kjt(stored["batch"]))
            output.values().sum().backward()
            grads = {name: p.grad for name, p in module.named_parameters()}
            return {"pooled": output.to_dict(), "grads": grads}

        return inputs, compute

    return build


recipe("ebc-unweighted")(_ebc_recipe(weighted=False))
recipe("ebc-weighted")(_ebc_recipe(weighted=True))


@recipe("ec-sequence")
def _ec_recipe():
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    def tables():
        return [
            EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"]),
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=7, feature_names=["f2"]),
        ]

    generator = torch.Generator().manual_seed(99)
    ec = EmbeddingCollection(tables=tables())
    inputs = {"weights": {k: torch.randn(v.shape, generator=generator) for k, v in ec.state_dict().items()}, "batch": _batch(generator, False)}

    def compute(stored):
        module = EmbeddingCollection(tables=tables())
        module.load_state_dict(stored["weights"])
        output = module(_kjt(stored["batch"]))
        return {key: {"values": jt.values(), "lengths": jt.lengths()} for key, jt in output.items()}

    return inputs, compute


@recipe("train-loop-sgd")
def _train_recipe():
    """Three steps of a plain training loop: EBC + linear head, SGD, the losses and the final weights."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def model():
        torch.manual_seed(7)
        return torch.nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=_tables()), "head": torch.nn.Linear(16, 1)})

    generator = torch.Generator().manual_seed(5)
    inputs = {
        "init": {k: v.clone() for k, v in model().state_dict().items()},
        "batches": [_batch(generator, False) for _ in range(3)],
        "labels": [torch.rand(4, generator=generator) for _ in range(3)],
    }

    def compute(stored):
        net = model()
        net.load_state_dict(stored["init"])
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        losses = []
        for batch, label in zip(stored["batches"], stored["labels"]):
            optimizer.zero_grad()
            logits = net["head"](net["ebc"](_kjt(batch)).values()).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, label)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return {"losses": losses, "final": net.state_dict()}

    return inputs, compute
