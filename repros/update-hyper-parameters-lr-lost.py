"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue update-hyper-parameters-lr-lost (listed for torchrec >=1.8,<1.10).

update_hyper_parameters({'lr': ...}) through torchrec's wrappers sets the learning rate of fbgemm's
TBE but not the fused optimizer's param groups; its zero_grad() and step() then hand the TBE the
param groups' lr again (EmbeddingFusedOptimizer.zero_grad/step call
set_learning_rate(param_groups[0]['lr'])): the fused tables train bit for bit as if the call had not
been made.

What to do instead: change a fused optimizer's learning rate through its param groups
(for group in optimizer.param_groups: group["lr"] = new_lr).

The script shards an EmbeddingBagCollection of one table (12 x 4, SUM) with
DistributedModelParallel on one rank (gloo, CPU; the table table-wise with the fused kernel, SGD lr
0.1 applied in backward) and trains it for 3 steps with the usual loop: fused_optimizer.zero_grad(),
forward, backward (the fused update), fused_optimizer.step(). After step 0 it sets the lr to 0.02
through DMP's fused optimizer. Its oracle is the unsharded EBC (same initial weights and batches)
trained by torch.optim.SGD, lr 0.1 for step 0 and 0.02 after. The table is compared after every
step (|a - b| <= 8 units of float32 roundoff x (|b| + max|b|): one SGD update of the same numbers,
fbgemm holding the lr in float32).

    python this_script.py            lr changed by fused_optimizer.update_hyper_parameters({"lr": 0.02})
    python this_script.py --control  lr changed through fused_optimizer.param_groups

    exit 0: the sharded table trains like the unsharded one
    exit 1: it does not, or torchrec raised (the message says where)
    exit 2: the script itself could not run
"""

import argparse
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

LR, NEW_LR, CHANGE_AFTER = 0.1, 0.02, 0
ROWS, DIM, STEPS = 12, 4, 3
UNITS_OF_ROUNDOFF = 8


def build_ebc():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    config = EmbeddingBagConfig(name="t0", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f0"], pooling=PoolingType.SUM)
    ebc = EmbeddingBagCollection(tables=[config], device=torch.device("cpu"))
    with torch.no_grad():
        ebc.embedding_bags["t0"].weight.copy_(initial_weight())
    return ebc


def initial_weight() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


def batch(step: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=["f0"], values=values, lengths=lengths)


def loss_of(pooled: torch.Tensor) -> torch.Tensor:
    return (pooled * torch.randn(pooled.shape, generator=torch.Generator().manual_seed(3))).sum()


def oracle_run() -> list:
    ebc = build_ebc()
    sgd = torch.optim.SGD(ebc.parameters(), lr=LR)
    record = []
    for step in range(STEPS):
        sgd.zero_grad()
        loss_of(ebc(batch(step))["f0"]).backward()
        sgd.step()
        record.append(ebc.embedding_bags["t0"].weight.detach().clone())
        if step == CHANGE_AFTER:
            sgd.param_groups[0]["lr"] = NEW_LR
    return record


def sharded_run(through_param_groups: bool) -> list:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, get_default_sharders, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ebc = build_ebc()
    apply_optimizer_in_backward(torch.optim.SGD, list(ebc.parameters()), {"lr": LR})
    plan = ShardingPlan({"": construct_module_sharding_plan(ebc, {"t0": table_wise(rank=0, compute_kernel="fused")},
                                                             local_size=1, world_size=1, device_type="cpu")})
    model = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                     plan=plan, sharders=get_default_sharders())
    table = model.state_dict()["embedding_bags.t0.weight"].local_shards()[0].tensor
    with torch.no_grad():
        table.copy_(initial_weight())
    optimizer = model.fused_optimizer
    record = []
    for step in range(STEPS):
        optimizer.zero_grad()
        output = model(batch(step))
        output = output.wait() if hasattr(output, "wait") else output  # a LazyAwaitable of the KeyedTensor
        loss_of(output["f0"]).backward()
        optimizer.step()
        record.append(table.detach().clone())
        if step == CHANGE_AFTER:
            if through_param_groups:
                for group in optimizer.param_groups:
                    group["lr"] = NEW_LR
            else:
                optimizer.update_hyper_parameters({"lr": NEW_LR})
    return record


def torchrec_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torchrec{os.sep}" in f.filename
              or f"{os.sep}fbgemm_gpu{os.sep}" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""


def first_difference(actual: list, expected: list) -> str:
    for step, (weight, oracle) in enumerate(zip(actual, expected)):
        bound = UNITS_OF_ROUNDOFF * torch.finfo(torch.float32).eps / 2 * (oracle.abs() + oracle.abs().max())
        bad = (weight - oracle).abs() > bound
        if bool(bad.any()):
            i = tuple(int(x) for x in bad.nonzero()[0])
            return (f"step {step}: table t0{list(i)} after the step {weight[i].item():.8g} vs the unsharded SGD's "
                    f"{oracle[i].item():.8g} ({int(bad.sum())} of {bad.numel()} elements differ)")
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--control", action="store_true", help="run the nearest configuration torchrec computes right")
    control = parser.parse_args().control
    how = "fused_optimizer.param_groups" if control else f"fused_optimizer.update_hyper_parameters({{'lr': {NEW_LR}}})"
    torch.set_num_threads(1)
    try:
        expected = oracle_run()
    except Exception as exc:
        print(f"CANNOT RUN: the unsharded oracle failed: {type(exc).__name__}: {exc}")
        return 2
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        try:
            dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
        except Exception as exc:
            print(f"CANNOT RUN: the process group: {type(exc).__name__}: {exc}")
            return 2
        try:
            actual = sharded_run(control)
        except Exception as exc:
            where = torchrec_frame(exc)
            print(f"REPRODUCED: torchrec raised {type(exc).__name__}: {exc}, in {where}" if where else
                  f"CANNOT RUN: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return 1 if where else 2
        finally:
            dist.destroy_process_group()
    difference = first_difference(actual, expected)
    if difference:
        print(f"REPRODUCED: lr {LR} -> {NEW_LR} after step {CHANGE_AFTER} through {how} is lost: "
              f"{difference}")
        return 1
    print(f"OK: the fused table trains like the unsharded one with torch SGD over {STEPS} steps, lr {LR} -> {NEW_LR} "
          f"after step {CHANGE_AFTER} through {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
