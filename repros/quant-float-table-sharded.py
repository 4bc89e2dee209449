"""A standalone reproduction of a TorchRec defect. It needs torch and torchrec only.

Known torchrec issue quant-float-table-sharded (listed for torchrec >=1.8,<1.10).

A quantized module with an fp16 or fp32 table and its scale and bias split out of the state dict
(quant_state_dict_split_scale_bias) cannot be sharded for inference:
ShardedQuantEmbeddingModuleState._initialize_torch_state reads the shape of the table's qscale,
which a float table does not have (AttributeError, table- and row-wise), and sizes its column shards
in bytes against offsets in columns (shards overlap, column-wise).

What to do instead: quantize every table of a module you shard with split scale and bias to an
integer type (int8, int4, int2).

The script quantizes an EmbeddingBagCollection of one table (4 rows, width 8, weights 0.25 * (row +
column)) with its scale and bias split out, shards it table-wise on one CPU rank with
torchrec.inference.modules.shard_quant_model, loads the quantized module's state dict into it and
looks up one bag of rows 1 and 2. Its oracle: the table's stored values, read from the state dict by
hand (fp16: the values themselves; int8: code * scale + bias per row), summed.

    python this_script.py            an fp16 table: must shard and look up the stored rows' sum
    python this_script.py --control  the same table quantized to int8: it does

    exit 0: the sharded module looks up the stored rows' sum
    exit 1: torchrec raises while sharding (or looks up something else)
    exit 2: the script itself could not run
"""

# --- paritykit repro prelude (generated from paritykit/gate/repro_prelude.py; do not edit) ---
# Plumbing shared by paritykit's hand-written reproductions; the script's own story follows the prelude.
import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXIT_OK, EXIT_REPRODUCED, EXIT_CANNOT_RUN = 0, 1, 2
TORCHREC = ("torchrec", "fbgemm_gpu")  # a raise inside these is torchrec's; elsewhere the script failed
COLLECTIVE_TIMEOUT_S = 60  # a rank waiting on a collective gives up after this
DEADLINE_S = 240  # the parent ends every rank after this


def ok(message: str) -> int:
    print(f"OK: {message}")
    return EXIT_OK


def reproduced(message: str) -> int:
    print(f"REPRODUCED: {message}")
    return EXIT_REPRODUCED


def cannot_run(message: str) -> int:
    print(f"CANNOT RUN: {message}")
    return EXIT_CANNOT_RUN


def run_script(main) -> None:
    """Exits with ``main()``'s code; an exception that escapes it is this script's failure (exit 2), never
    Python's exit 1, which would read as a reproduction."""
    try:
        code = main()
    except Exception:  # noqa: BLE001 - whatever the script itself failed on
        code = cannot_run(f"the script itself failed:\n{traceback.format_exc()}")
    sys.exit(code)


def control_requested(help_text: str) -> bool:
    """Whether the script runs its --control: the nearest configuration torchrec computes right."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--control", action="store_true", help=help_text)
    return parser.parse_args().control


def library_frame(exc: BaseException, places: tuple = TORCHREC) -> str:
    """The innermost frame in one of ``places`` (folders such as "torchrec" or "torch/distributed") of the
    exception's traceback, as "file:line (function: code)"; "" when the exception did not come from there."""
    marks = [os.sep + os.path.join(*place.split("/")) + os.sep for place in places]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if any(mark in f.filename for mark in marks)]
    return f"{frames[-1].filename}:{frames[-1].lineno} ({frames[-1].name}: {frames[-1].line})" if frames else ""


def first_lines(text: str, count: int = 3) -> str:
    """The reason on an exception's first lines (DCP's exception repeats every rank's traceback)."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith((" ", "Traceback"))]
    return " | ".join(lines[:count])


def verdict_of_raise(exc: BaseException, what: str, places: tuple = TORCHREC) -> int:
    """A raise out of ``what``: torchrec's is a reproduction (its type, message and frame); else CANNOT RUN."""
    where = library_frame(exc, places)
    if not where:
        return cannot_run(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    return reproduced(f"{what} raised {type(exc).__name__}: {exc} (in {where})".replace("\n", " "))


def roundoff_bound(expected: torch.Tensor, units: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``units`` units of roundoff of ``dtype`` x (|expected| + max|expected|): a few roundings per operation
    summed in another order stay inside; a wrong row, state or step is off by O(1)."""
    scale = expected.abs().max() if expected.numel() else 0.0
    return units * torch.finfo(dtype).eps / 2 * (expected.abs() + scale)


def first_difference(actual: torch.Tensor, expected: torch.Tensor, bound, origin: tuple = (), oracle: str = "oracle") -> str:
    """"" when ``actual`` is within ``bound`` of ``expected`` everywhere; else the shapes, or how many elements
    differ and the first (its index in the full tensor: ``origin`` added) with both values. NaN differs."""
    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {tuple(actual.shape)} vs {oracle} {tuple(expected.shape)}"
    bad = ~((actual - expected).abs() <= bound)
    if not bool(bad.any()):
        return ""
    index = tuple(int(i) for i in bad.nonzero()[0])
    at = [o + i for o, i in zip(origin, index)] if origin else list(index)
    return (f"{int(bad.sum())} of {bad.numel()} elements differ, first at {at}: "
            f"{actual[index].item():.6g} vs {oracle} {expected[index].item():.6g}")


def start_process_group(rank: int, world_size: int, scratch: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """gloo on the CPU, a file:// rendezvous in ``scratch``, collectives that give up after ``timeout_s``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


class OneRank:
    """A process group of this process alone (gloo, world size 1) for a with-block: DMP needs one."""

    def __enter__(self) -> "OneRank":
        self.scratch = tempfile.TemporaryDirectory(prefix="torchrec-repro-")
        start_process_group(0, 1, self.scratch.name)
        return self

    def __exit__(self, *raised) -> bool:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.scratch.cleanup()
        return False  # an exception goes on to the script's verdict


def finish_rank(scratch: str, result: dict, failed: bool) -> None:
    """Hands this rank's result (a JSON dict with its "rank") to the parent. A failed rank exits at once (another
    may wait in a collective: torch.multiprocessing ends it); the others leave the process group together."""
    with open(os.path.join(scratch, f"rank{result['rank']}.json"), "w") as file:
        json.dump(result, file)
    if failed:
        sys.exit(1)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(run_rank, args: tuple, world_size: int, deadline_s: float = DEADLINE_S) -> list:
    """Runs ``run_rank(rank, scratch, *args)`` in ``world_size`` processes (torch.multiprocessing "spawn"),
    ends them all after ``deadline_s``, and returns each rank's result. A rank that crashed, hung or wrote no
    result gets {"rank": rank, "error": why}: the script could not run, never a reproduction."""
    with tempfile.TemporaryDirectory(prefix="torchrec-repro-") as scratch:
        context = mp.start_processes(run_rank, args=(scratch, *args), nprocs=world_size, join=False, start_method="spawn")
        deadline, ended = datetime.datetime.now() + datetime.timedelta(seconds=deadline_s), ""
        try:
            while not context.join(timeout=1):
                if datetime.datetime.now() > deadline:
                    ended = f"it did not finish within {deadline_s} s"
                    break
        except Exception as exc:  # a rank exited early (it wrote why); torch.multiprocessing ended the others
            ended = f"a rank exited early ({type(exc).__name__}: {first_lines(str(exc), 1)})"
        results = [read_result(scratch, rank, ended) for rank in range(world_size)]
        for result, process in zip(results, context.processes):
            if process.is_alive():  # hung past the deadline, whatever it wrote
                process.kill()
                process.join()
                result["error"] = ended
        return results


def read_result(scratch: str, rank: int, ended: str) -> dict:
    try:
        with open(os.path.join(scratch, f"rank{rank}.json")) as file:
            return json.load(file)
    except (OSError, ValueError):
        return {"rank": rank, "error": f"it wrote no result ({ended or 'it ended without one'})"}
# --- end prelude ---


def main() -> int:
    from torch.ao import quantization as quant
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
    from torchrec.distributed.global_settings import set_propogate_device
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.inference.modules import shard_quant_model
    from torchrec.quant import embedding_modules as qmodules

    control = control_requested("the same table quantized to int8: sharded, it looks up the stored rows")
    weight_dtype = torch.qint8 if control else torch.float16
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=4, feature_names=["f0"])])
    with torch.no_grad():
        ebc.embedding_bags["t0"].weight.copy_(0.25 * (torch.arange(4.0)[:, None] + torch.arange(8.0)))
    qmodules.quant_prep_enable_quant_state_dict_split_scale_bias_for_types(ebc, [EmbeddingBagCollection])
    ebc.qconfig = qmodules.QuantConfig(activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
                                       weight=quant.PlaceholderObserver.with_args(dtype=weight_dtype))
    quantized = qmodules.EmbeddingBagCollection.from_float(ebc)
    state = quantized.state_dict()
    stored = state["embedding_bags.t0.weight"]
    if control:
        values = stored.to(torch.float32) * state["embedding_bags.t0.weight_qscale"].float() + state["embedding_bags.t0.weight_qbias"].float()
    else:
        values = stored.view(torch.float16).float()
    expected = (values[1] + values[2])[None, :]
    holder = torch.nn.Module()
    holder.ebc = qmodules.EmbeddingBagCollection.from_float(ebc)  # a second copy to shard (the same quantization)
    sharder = QuantEmbeddingBagCollectionSharder(fused_params={FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True})
    plan = ShardingPlan({"ebc": construct_module_sharding_plan(quantized, per_param_sharding={"t0": table_wise(rank=0)},
                                                               local_size=1, world_size=1, device_type="cpu", sharder=sharder)})
    set_propogate_device(True)  # inference lookups on the sharding's device type (CPU), not "cuda"
    batch = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))
    try:
        sharded, _ = shard_quant_model(holder, world_size=1, compute_device="cpu", sharding_device="cpu",
                                       sharders=[sharder], sharding_plan=plan)
        sharded.ebc.load_state_dict(state)
        actual = sharded.ebc(batch).to_dict()["f0"]
    except Exception as exc:  # torchrec raised: the defect shows
        return verdict_of_raise(exc, f"sharding a quantized EBC with a {weight_dtype} table, scale and bias split out")
    difference = first_difference(actual, expected, roundoff_bound(expected), oracle="the stored rows' sum")
    if difference:
        return reproduced(f"the sharded {weight_dtype} table looks up other values than its stored rows: {difference}")
    return ok(f"the sharded {weight_dtype} table looks up its stored rows' sum")


if __name__ == "__main__":
    run_script(main)
