"""What a forward quantized-communication codec means, as an oracle of its own: with FP16 on the
forward wire every embedding a rank receives through the output all-to-all (pooled, variable-batch,
sequence) or reduce-scatter was sent as float16 and decoded, so

- it comes back in the table's dtype (float32, what the unsharded module returns): a decode that is
  skipped hands the model float16;
- each value is a float16 number (x == float(half(x))): a path that sends float32 although the user
  asked for FP16 (a codec not handed to its output dist) returns values float16 cannot hold, and
  is closer to the unsharded module than the codec's bound asks, so the bound alone would not see it.

Only where every value crosses the wire and nothing is computed after it: no data-parallel table
(never communicated) and no MEAN pooling in an EBC (the row-wise MEAN divisor is applied after the
reduce-scatter). On CPU torchrec sends BF16 as FP16 (gloo has no BF16; fbgemm_qcomm_codec says so),
so the check applies to an FP16 forward only.
"""

from __future__ import annotations

from typing import Any

import torch


def codec_applies(module: str, tables: Any, plan: dict[str, tuple], forward: str) -> bool:
    if forward != "fp16":
        return False
    if any(entry[0] == "data_parallel" for entry in plan.values()):
        return False
    return module == "ec" or all(table.pooling == "SUM" for table in tables)


def _values(value: Any) -> torch.Tensor:
    """A pooled embedding as it is; an EC's JaggedTensor as its values."""
    return value if isinstance(value, torch.Tensor) else value.values()


def codec_problem(embeddings: list[list[dict[str, Any]]], expected_dtype: torch.dtype = torch.float32) -> tuple[str | None, int]:
    """(the first embedding that did not come through an FP16 wire, or None; how many values were checked).
    ``embeddings[step][rank]`` as a TrainingRecord holds them: {module fqn: {"by_key": {key: tensor}}}."""
    checked = 0
    for step, per_rank in enumerate(embeddings):
        for rank, modules in enumerate(per_rank):
            for fqn, recorded in modules.items():
                for key, value in recorded["by_key"].items():
                    tensor = _values(value)
                    where = f"step {step}, rank {rank}, module {fqn!r}, key {key!r}"
                    if tensor.dtype != expected_dtype:
                        return f"{where}: returned {tensor.dtype}, the unsharded module returns {expected_dtype} (FP16 codec not decoded?)", checked
                    wire = tensor.to(torch.float16).to(tensor.dtype)
                    off = (wire != tensor).nonzero()
                    if len(off):
                        index = tuple(int(i) for i in off[0])
                        return (f"{where}: element {list(index)} is {float(tensor[index])!r}, which float16 cannot hold: it did not "
                                "cross the wire as float16 (the FP16 forward codec was not applied)"), checked
                    checked += tensor.numel()
    return None, checked
