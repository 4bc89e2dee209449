"""What a quantized table holds and what a lookup of it means, in plain torch (no torchrec, no fbgemm).

A table quantized with its scale and bias split out of the row (the state-dict form torchrec writes
with ``quant_state_dict_split_scale_bias``) holds, per row:
- ``int8``/``int4``/``int2``: ``dim`` unsigned codes of that many bits, packed low bits first
  (code ``j`` in byte ``j * bits // 8`` at bit ``(j % (8 // bits)) * bits``), and an fp16 scale and
  bias: the value is ``code * scale + bias``;
- ``fp16``/``fp32``: the row's values in that dtype, as bytes.
A pooled lookup sums (or averages) the values of a bag's rows, each times its per-sample weight; a
sequence lookup returns the rows themselves. Computed here in float64.
"""

from __future__ import annotations

import torch

BITS = {"int8": 8, "int4": 4, "int2": 2}
FLOAT_KINDS = {"fp16": torch.float16, "fp32": torch.float32}


def codes(weight: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """The stored row entries as a [rows, dim] tensor: integer codes (int64) or the float values."""
    data = getattr(weight, "elem", weight)  # torchrec wraps packed int4/int2 in a tensor subclass
    data = data.detach().contiguous()
    if kind in FLOAT_KINDS:
        values = data.view(torch.uint8).view(FLOAT_KINDS[kind]) if data.dtype == torch.uint8 else data
        return values[:, :dim]
    bits = BITS[kind]
    per_byte = 8 // bits
    packed = data.view(torch.uint8).to(torch.int64)  # [rows, bytes]
    columns = torch.arange(dim)
    return (packed[:, columns // per_byte] >> ((columns % per_byte) * bits)) & ((1 << bits) - 1)


def dequantized(weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, kind: str, dim: int) -> torch.Tensor:
    """The table's values, float64 [rows, dim]."""
    stored = codes(weight, kind, dim).to(torch.float64)
    if kind in FLOAT_KINDS:
        return stored
    if scale is None or bias is None:
        raise ValueError(f"a {kind} table needs its scale and bias")
    return stored * scale.reshape(-1, 1).to(torch.float64) + bias.reshape(-1, 1).to(torch.float64)


def pooled(table: torch.Tensor, ids: list[int], weights: list[float] | None, mean: bool) -> torch.Tensor:
    """One bag: the sum (or mean) of its rows, each times its weight; zeros for an empty bag."""
    out = torch.zeros(table.shape[1], dtype=torch.float64)
    for position, row in enumerate(ids):
        out += table[row] * (1.0 if weights is None else weights[position])
    return out / len(ids) if mean and ids else out


def sequence(table: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """One feature's sequence lookup: the rows at ``ids``, in order."""
    return table[torch.tensor(ids, dtype=torch.int64)] if ids else table.new_zeros((0, table.shape[1]))
