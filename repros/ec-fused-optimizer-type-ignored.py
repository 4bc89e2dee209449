"""Known torchrec issue ec-fused-optimizer-type-ignored (listed for torchrec >=1.8,<1.10).

A sharded EmbeddingCollection trains with the fused optimizer of the class given to
apply_optimizer_in_backward even when its keyword arguments name another (optimizer=EmbOptimType...:
EMA in-place row-wise Adagrad, row-wise RMSprop); the EmbeddingBagCollection sharder honours it.
Cause: EmbeddingCollectionSharder (torchrec/distributed/embedding.py, create_sharding_infos_by_sharding)
always overwrites optimizer_params["optimizer"] with optimizer_type_to_emb_opt_type(class); the EBC
sharder does so only when "optimizer" is not already set.

The script builds one table t0 (6 x 4, seeded torch.randn) read by feature f0, marks it with
apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ..., {"optimizer": EMAINPLACE_ROWWISE_ADAGRAD,
"emainplace_mode": step_ema=1, step_start=0, step_ema_coef=0.5, "lr": 0.1, "eps": 1e-3}), shards it
table-wise on one gloo rank with DistributedModelParallel (fused kernel) and runs one training step.
The oracle is the unsharded module under a hand computation of fbgemm's EMA in-place row-wise
Adagrad: at the forward of iteration 1 (1 % step_ema == 0, >= step_start), before the lookup, the
second half of the columns of every row moves toward the first half (slow += coef * (fast - slow));
then each looked-up row r steps s_r = mean(g_r^2), w_r -= lr * g_r / (sqrt(s_r) + eps). The module's
output and the table after the step are compared within |sharded - oracle| <= 1e-5 * (1 + |oracle|):
a correct float32 computation of these few operations on values of order 1 is off by a few units of
roundoff (~1e-7), while the missing EMA moves columns 2-3 by half the gap to columns 0-1 (order 1).

    python this_script.py            the EmbeddingCollection: exit 1 (REPRODUCED) when it differs
    python this_script.py --control  the same table, optimizer and oracle in an EmbeddingBagCollection
                                     (SUM pooling), whose sharder honours the type: exit 0 (OK)
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

ROWS, DIM, LR, EPS, STEP_EMA, STEP_START, COEF = 6, 4, 0.1, 1e-3, 1, 0, 0.5
IDS = [[0, 1], [2], [1, 4]]  # f0, one list per sample; rows 3 and 5 are not read


def fbgemm_config(argument: str):
    """fbgemm's class for one argument of its TBE, read from the annotation of the TBE class torchrec
    imports (fbgemm_gpu comes with torchrec; the script imports torch and torchrec only)."""
    from torchrec.distributed.batched_embedding_kernel import SplitTableBatchedEmbeddingBagsCodegen

    annotation = SplitTableBatchedEmbeddingBagsCodegen.__init__.__annotations__[argument]
    return next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))


def build(kind: str):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    if kind == "ec":
        module = EmbeddingCollection(tables=[EmbeddingConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"])])
    else:
        module = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM,
                                                                   feature_names=["f0"], pooling=PoolingType.SUM)])
    with torch.no_grad():
        next(iter(module.parameters())).copy_(initial_weight())
    return module


def initial_weight() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


def batch():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f0"], values=torch.tensor([i for row in IDS for i in row]),
                             lengths=torch.tensor([len(row) for row in IDS]))


def output_of(kind: str, out) -> torch.Tensor:
    return out["f0"].values() if kind == "ec" else out.to_dict()["f0"]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(11))).sum()


def oracle(kind: str):
    """(output, table after the step): the unsharded module under a hand EMA in-place row-wise Adagrad."""
    module = build(kind)
    weight = next(iter(module.parameters()))
    with torch.no_grad():  # iteration 1: the EMA, before the lookup
        half = DIM // 2
        if 1 % STEP_EMA == 0 and 1 >= STEP_START:
            weight[:, half:] += COEF * (weight[:, :half] - weight[:, half:])
    output = output_of(kind, module(batch()))
    loss_of(output).backward()
    with torch.no_grad():
        for row in sorted({i for r in IDS for i in r}):
            g = weight.grad[row]
            s = (g * g).mean()
            weight[row] -= LR * g / (s.sqrt() + EPS)
    return output.detach(), weight.detach().clone()


def sharded_run(kind: str):
    from torchrec.distributed.batched_embedding_kernel import OptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    module = build(kind)
    ema = fbgemm_config("emainplace_mode")(step_ema=STEP_EMA, step_start=STEP_START, step_ema_coef=COEF)
    apply_optimizer_in_backward(RowWiseAdagrad, list(module.parameters()),
                                {"lr": LR, "eps": EPS, "optimizer": OptimType.EMAINPLACE_ROWWISE_ADAGRAD, "emainplace_mode": ema})
    plan = construct_module_sharding_plan(module, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                          local_size=1, world_size=1, device_type="cpu")
    sharded = DistributedModelParallel(module, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                       plan=ShardingPlan({"": plan}), sharders=get_default_sharders())
    with torch.no_grad():
        next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor.copy_(initial_weight())
    output = output_of(kind, sharded(batch()).wait() if kind == "ec" else sharded(batch()))
    loss_of(output).backward()
    table = next(v for k, v in sharded.state_dict().items() if k.endswith("t0.weight")).local_shards()[0].tensor
    return output.detach(), table.detach().clone()


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
    parser.add_argument("--control", action="store_true", help="the EmbeddingBagCollection, which torchrec trains right")
    kind = "ebc" if parser.parse_args().control else "ec"
    name = {"ec": "EmbeddingCollection", "ebc": "EmbeddingBagCollection"}[kind]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            expected = oracle(kind)
        except Exception as exc:
            print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 2
        try:
            actual = sharded_run(kind)
        except Exception as exc:
            if not raised_in_torchrec(exc):
                print(f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return 2
            print(f"REPRODUCED: the sharded {name} raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}")
            return 1
        finally:
            dist.destroy_process_group()
    problems = [p for p in (first_difference("step 0, output of feature f0", actual[0], expected[0]),
                            first_difference("step 0, table t0 after the step", actual[1], expected[1])) if p]
    if problems:
        print(f"REPRODUCED: the sharded {name} did not train with EMA in-place row-wise Adagrad; " + "; ".join(problems))
        return 1
    print(f"OK: the sharded {name} matches the unsharded one under a hand EMA in-place row-wise Adagrad "
          f"(output and table, {expected[0].numel() + expected[1].numel()} elements)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
