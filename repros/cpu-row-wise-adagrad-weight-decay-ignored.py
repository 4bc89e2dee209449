"""Known torchrec issue cpu-row-wise-adagrad-weight-decay-ignored (listed for fbgemm-gpu-cpu >=1.8,<1.10).

fbgemm's CPU row-wise Adagrad kernel applies no weight decay in modes L2 and DECOUPLE (weights and
accumulator are those of weight_decay=0); the counter-based mode applies it. torchrec hands
weight_decay and weight_decay_mode to fbgemm's TBE as given; the CPU kernel then leaves them out.

The script builds an EmbeddingBagCollection with one table t0 (6 x 4, seeded torch.randn, SUM
pooling) read by feature f0, marks it with apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad,
..., {"lr": 0.1, "eps": 1e-3, "weight_decay": 0.1, "weight_decay_mode": L2, then DECOUPLE}), shards it
table-wise on one gloo rank with DistributedModelParallel (fused kernel) and runs one training step.
The oracle is the unsharded module under a hand computation of row-wise Adagrad with weight decay,
on each looked-up row r (gradient g, accumulator s from 0, m = lr / (sqrt(s) + eps)):
    L2:        s += mean((g + wd w)^2);  w = (1 - m wd) w - m g
    DECOUPLE:  s += mean(g^2);           w = (1 - lr wd) w - m g
The table after the step is compared within |sharded - oracle| <= 1e-5 * (1 + |oracle|): a correct
float32 computation of these few operations on values of order 1 is off by ~1e-7, while the decay
moves each looked-up weight by lr * wd * w (order 1e-2). A REPRODUCED line also says whether the
sharded table equals the same oracle with weight_decay=0.

    python this_script.py            modes L2 and DECOUPLE: exit 1 (REPRODUCED) when the decay is missing
    python this_script.py --control  the same decay through counter-based regularization (weight_decay_mode
                                     COUNTER, counter_weight_decay_mode L2 / DECOUPLE, counter_halflife 1:
                                     on a row's first touch its counter is 1, freq = halflife / counter = 1,
                                     the same update as above), which the CPU kernel applies: exit 0 (OK)
    exit 2 (CANNOT RUN): the script itself failed.
"""

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

ROWS, DIM, LR, EPS, WD = 6, 4, 0.1, 1e-3, 0.1
IDS = [[0, 1], [2], [1, 4]]  # f0, one list per sample; rows 3 and 5 are not read


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def optimizer_kwargs(mode: str, control: bool) -> dict:
    weight_decay_mode = fbgemm_config("weight_decay_mode")
    kwargs = {"lr": LR, "eps": EPS, "weight_decay": WD}
    if not control:
        return {**kwargs, "weight_decay_mode": weight_decay_mode[mode]}
    counter = fbgemm_config("counter_based_regularization")
    counter_mode = type(counter.__dataclass_fields__["counter_weight_decay_mode"].default)
    return {**kwargs, "weight_decay_mode": weight_decay_mode.COUNTER,
            "counter_based_regularization": counter(counter_weight_decay_mode=counter_mode[mode], counter_halflife=1)}


def build():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM,
                                                               feature_names=["f0"], pooling=PoolingType.SUM)])
    with torch.no_grad():
        next(iter(module.parameters())).copy_(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7)))
    return module


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i for row in IDS for i in row]),
                             lengths=torch.tensor([len(row) for row in IDS]))


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(11))).sum()


def oracle(mode: str, weight_decay: float) -> torch.Tensor:
    """The table after one step of the unsharded module under a hand row-wise Adagrad with decay."""
    module = build()
    weight = next(iter(module.parameters()))
    loss_of(module(batch()).to_dict()["f0"]).backward()
    with torch.no_grad():
        for row in sorted({i for r in IDS for i in r}):
            w, g = weight[row].clone(), weight.grad[row]
            effective = g + weight_decay * w if mode == "L2" else g
            m = LR / ((effective * effective).mean().sqrt() + EPS)
            keep = 1 - m * weight_decay if mode == "L2" else 1 - LR * weight_decay
            weight[row] = keep * w - m * g
    return weight.detach().clone()


def sharded_run(mode: str, control: bool) -> torch.Tensor:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = build()
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()), optimizer_kwargs(mode, control))
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=1, world_size=1, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    table = next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor
    with torch.no_grad():
        table.copy_(next(iter(build().parameters())))
    loss_of(sharded(batch()).to_dict()["f0"]).backward()
    return table.detach().clone()


def first_difference(what: str, actual: torch.Tensor, expected: torch.Tensor) -> str:
    bad = (actual - expected).abs() > 1e-5 * (1 + expected.abs())
    if not bool(bad.any()):
        return ""
    at = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at {list(at)}: "
            f"{actual[at].item():.6g} vs oracle {expected[at].item():.6g}")


def raised_in_torchrec(exc: BaseException) -> bool:
    """Whether the exception came out of torchrec or fbgemm (else this script itself failed)."""
    return any(f"{os.sep}torchrec{os.sep}" in f.filename or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename
               for f in traceback.extract_tb(exc.__traceback__)[1:])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--control", action="store_true", help="the same decay through counter-based regularization")
    control = parser.parse_args().control
    torch.set_num_threads(1)
    problems, compared = [], 0
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            expected = {mode: (oracle(mode, WD), oracle(mode, 0.0)) for mode in ("L2", "DECOUPLE")}
        except Exception as exc:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 2
        try:
            for mode, (decayed, undecayed) in expected.items():
                actual = sharded_run(mode, control)
                compared += actual.numel()
                problem = first_difference(f"step 0, table t0 after the step, weight decay mode {mode}", actual, decayed)
                if problem:
                    same = "equals" if not first_difference("", actual, undecayed) else "differs from"
                    problems.append(f"{problem} (the sharded table {same} the oracle with weight_decay=0)")
        except Exception as exc:
            if not raised_in_torchrec(exc):
                print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return 2
            print(f"REPRODUCED: the sharded EBC raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}")
            return 1
        finally:
            dist.destroy_process_group()
    how = "counter-based regularization (COUNTER, halflife 1)" if control else "weight_decay_mode L2 and DECOUPLE"
    if problems:
        print(f"REPRODUCED: row-wise Adagrad with {how} left out the weight decay; " + "; ".join(problems))
        return 1
    print(f"OK: the sharded EBC matches the unsharded one under a hand row-wise Adagrad with weight decay, "
          f"through {how} ({compared} elements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
