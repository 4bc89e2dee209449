"""One inference case, against the meaning of a quantized table (quant_reference.py):

1. torchrec's quantizer: every stored row, read back by hand, lies within half a quantization step of
   the float row it came from (fp16: one rounding; fp32: exact), the step being the row's stored scale;
2. the unsharded quantized module (QuantEmbeddingBagCollection / QuantEmbeddingCollection), eager and
   traced by ``torchrec.fx.symbolic_trace``: every output equals the lookup by hand of the stored rows
   (pooled: summed or averaged, times the per-sample weights; sequence: the rows and the input's
   lengths), in the output dtype asked for;
3. the same module sharded for inference on CPU (table-, row-, column-wise): a sharded module, the same
   outputs; its state dict puts every stored entry, scale and bias of each shard where the unsharded
   table has it, in as many shards as the plan says, covering the table once; and that state dict
   loaded into the same plan sharded from other weights gives the same outputs again.
The bound of 2 and 3 is the rounding of a sum of the bag's terms in the output dtype
(``summation_tolerance``): a wrong row, a lost bias or scale, a misplaced column shard is off by
the values themselves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from paritykit.checks.inference import quant_modules, quant_reference
from paritykit.checks.inference.specs import QuantSpec, QuantTable
from paritykit.compare.bounds import summation_tolerance, unit_roundoff
from paritykit.errors import ParityError, expect

FP16_ROUNDOFF = unit_roundoff(torch.float16)


def _prefix(spec: QuantSpec) -> str:
    return "embedding_bags" if spec.pooled else "embeddings"


def stored_tables(spec: QuantSpec, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each table's values, read by hand from the quantized module's state dict (float64)."""
    tables = {}
    for table in spec.tables:
        key = f"{_prefix(spec)}.{table.name}.weight"
        expect(key in state, f"table {table.name}: the quantized module's state dict has no {key} (has {sorted(state)})")
        scale, bias = state.get(f"{key}_qscale"), state.get(f"{key}_qbias")
        if table.kind in quant_reference.BITS:
            expect(scale is not None and bias is not None, f"table {table.name} ({table.kind}): no {key}_qscale/_qbias in the state dict")
        tables[table.name] = quant_reference.dequantized(state[key], scale, bias, table.kind, table.dim)
    return tables


def _quantizer_bound(table: QuantTable, original: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Per entry: how far the stored value may lie from the float one. An integer code rounds to the
    nearest step (half a step); the step and the row's minimum are kept in fp16, which moves the top code
    by at most the row's range and the bottom one by the minimum, each one fp16 rounding."""
    if table.kind == "fp32":
        return torch.zeros_like(original)
    if table.kind == "fp16":
        return original.abs() * FP16_ROUNDOFF + 2.0**-24
    step = scale.reshape(-1, 1).to(torch.float64)
    low, high = original.min(dim=1, keepdim=True).values, original.max(dim=1, keepdim=True).values
    slack = ((high - low) + low.abs()) * 2 * FP16_ROUNDOFF
    return (step / 2 + slack + 1e-6 * original.abs().amax()).expand_as(original)


def check_quantizer(spec: QuantSpec, float_module: torch.nn.Module, state: dict[str, Any], stored: dict[str, torch.Tensor]) -> None:
    float_tables = float_module.embedding_bags if spec.pooled else float_module.embeddings
    for table in spec.tables:
        original = float_tables[table.name].weight.detach().to(torch.float64)
        scale = state.get(f"{_prefix(spec)}.{table.name}.weight_qscale")
        bound = _quantizer_bound(table, original, scale)
        error = (stored[table.name] - original).abs()
        over = error > bound
        if over.any():
            row, column = (int(i) for i in over.nonzero()[0])
            raise ParityError(
                f"quantizer: table {table.name} ({table.kind}) row {row} column {column}: stored value "
                f"{stored[table.name][row, column].item():.6g}, float weight {original[row, column].item():.6g}: off by "
                f"{error[row, column].item():.3g}, more than the {bound[row, column].item():.3g} a {table.kind} step allows"
                + ("" if scale is None else f" (the row's stored scale {float(scale.reshape(-1)[row]):.4g})"))


def expected_outputs(spec: QuantSpec, stored: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, float]]:
    """Per feature: the expected output (float64; pooled [batch, dim], sequence [ids, dim]) and the
    largest magnitude of one of its terms."""
    expected = {}
    feature_index = 0
    for table in spec.tables:
        values = stored[table.name]
        largest = float(values.abs().max()) if values.numel() else 0.0
        for feature in table.features:
            bags = spec.bags[feature_index]
            weights = spec.weights[feature_index] if spec.weights is not None else None
            if spec.pooled:
                out = torch.stack([quant_reference.pooled(values, list(bag), None if weights is None else list(weights[b]), table.mean)
                                   for b, bag in enumerate(bags)])
                weight_scale = max((abs(w) for ws in weights for w in ws), default=1.0) if weights is not None else 1.0
                expected[feature] = (out, largest * weight_scale)
            else:
                expected[feature] = (quant_reference.sequence(values, [i for bag in bags for i in bag]), largest)
            feature_index += 1
    return expected


def _bag_terms(spec: QuantSpec) -> int:
    return max((len(bag) for feature in spec.bags for bag in feature), default=0) + 2


def check_outputs(spec: QuantSpec, what: str, output: Any, expected: dict[str, tuple[torch.Tensor, float]]) -> None:
    dtype = getattr(torch, spec.output_dtype)
    if spec.pooled:
        got = output.to_dict()
    else:
        got = dict(output)
    expect(sorted(got) == sorted(spec.features), f"{what}: output features {sorted(got)}, the input has {sorted(spec.features)}")
    for feature_index, feature in enumerate(spec.features):
        want, magnitude = expected[feature]
        if spec.pooled:
            values = got[feature]
        else:
            jagged = got[feature]
            lengths = [len(bag) for bag in spec.bags[feature_index]]
            expect(jagged.lengths().tolist() == lengths,
                   f"{what}: feature {feature}: lengths {jagged.lengths().tolist()}, the input's are {lengths}")
            values = jagged.values()
        expect(values.dtype == dtype, f"{what}: feature {feature}: output dtype {values.dtype}, asked for {dtype}")
        expect(tuple(values.shape) == tuple(want.shape), f"{what}: feature {feature}: output shape {tuple(values.shape)}, expected {tuple(want.shape)}")
        rtol, atol = summation_tolerance(dtype, _bag_terms(spec) if spec.pooled else 2, magnitude)
        error = (values.to(torch.float64) - want).abs()
        over = error > atol + rtol * want.abs()
        if over.any():
            row, column = (int(i) for i in over.nonzero()[0])
            where = f"sample {row}" if spec.pooled else f"id {row} of the feature's values"
            raise ParityError(
                f"{what}: feature {feature} {where} column {column}: {values[row, column].item():.6g}, the stored rows give "
                f"{want[row, column].item():.6g} (off by {error[row, column].item():.3g}; bound {atol + rtol * abs(want[row, column].item()):.3g})")


def _pieces(entry: Any) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """A state-dict entry as (row offset, column offset) and tensor pieces: a ShardedTensor's local
    shards, a plain tensor whole, or a list of per-shard tensors (each the whole row range)."""
    if hasattr(entry, "local_shards"):
        return [((int(s.metadata.shard_offsets[0]), int(s.metadata.shard_offsets[1]) if len(s.metadata.shard_offsets) > 1 else 0),
                 s.tensor) for s in entry.local_shards()]
    if isinstance(entry, (list, tuple)):
        return [((0, 0), piece) for piece in entry]
    return [((0, 0), entry)]


def check_sharded_state(spec: QuantSpec, sharded_state: dict[str, Any], state: dict[str, Any]) -> None:
    for table in spec.tables:
        key = f"{_prefix(spec)}.{table.name}.weight"
        expect(key in sharded_state, f"sharded state dict: no {key} for table {table.name} ({table.placement})")
        whole = quant_reference.codes(state[key], table.kind, table.dim)
        covered = torch.zeros(table.rows, table.dim, dtype=torch.int64)
        pieces = _pieces(sharded_state[key])
        held, planned = sum(1 for _, piece in pieces if piece.numel() > 0), _expected_shards(table, spec.world_size)
        expect(held == planned, f"sharded state dict: table {table.name} ({table.placement}) is held in {held} non-empty "
                                f"shards, its plan places it in {planned}")
        for (row, column), piece in pieces:
            rows, columns = piece.shape[0], _logical_columns(piece, table)
            mine = quant_reference.codes(piece, table.kind, columns)
            want = whole[row:row + rows, column:column + columns]
            if mine.shape != want.shape or not torch.equal(mine.to(want.dtype), want):
                raise ParityError(f"sharded state dict: table {table.name} ({table.placement}): the shard at rows {row}+{rows}, "
                                  f"columns {column}+{columns} holds other entries than the unsharded table there")
            covered[row:row + rows, column:column + columns] += 1
        if not bool((covered == 1).all()):
            r, c = (int(i) for i in (covered != 1).nonzero()[0])
            raise ParityError(f"sharded state dict: table {table.name} ({table.placement}): entry ({r}, {c}) is in "
                              f"{int(covered[r, c])} shards, not exactly one")
        for suffix in ("_qscale", "_qbias"):
            if table.kind not in quant_reference.BITS:
                continue
            name = key + suffix
            expect(name in sharded_state, f"sharded state dict: no {name} for table {table.name} ({table.placement})")
            full = state[name]
            for (row, _), piece in _pieces(sharded_state[name]):
                want = full[row:row + piece.shape[0]]
                if not torch.equal(piece.reshape(want.shape), want):
                    raise ParityError(f"sharded state dict: table {table.name} ({table.placement}): {suffix[1:]} of rows "
                                      f"{row}+{piece.shape[0]} differs from the unsharded table's")


def _expected_shards(table: QuantTable, world_size: int) -> int:
    """How many non-empty shards the plan gives a table: one table-wise, one per listed rank column-wise,
    row-wise one per block of ceil(rows / world_size) rows, or one per rank given rows."""
    kind, _, ranks = table.placement.partition(":")
    if kind == "cw":
        return len(ranks.split(","))
    if kind == "rw" and ranks:
        return sum(1 for n in ranks.split(",") if int(n) > 0)
    if kind == "rw":
        block = -(-table.rows // world_size)
        return -(-table.rows // block)
    return 1


def _logical_columns(piece: torch.Tensor, table: QuantTable) -> int:
    """A shard's width in the table's entries (a packed shard's tensor may be narrower in bytes)."""
    if table.kind in quant_reference.FLOAT_KINDS and piece.dtype == torch.uint8:
        return piece.shape[1] * 8 // (16 if table.kind == "fp16" else 32)
    return piece.shape[1]


def _traced(module: torch.nn.Module) -> torch.nn.Module:
    """The module as torchrec.fx.symbolic_trace gives it, the way an inference model is packaged."""
    from torchrec.fx import symbolic_trace

    return symbolic_trace(module)


def run_quant_case(spec: QuantSpec) -> dict[str, Any]:
    float_module = quant_modules.float_module(spec)
    quant = quant_modules.quantized(spec, float_module)
    state = quant.state_dict()
    stored = stored_tables(spec, state)
    check_quantizer(spec, float_module, state, stored)
    expected = expected_outputs(spec, stored)
    batch = quant_modules.features(spec)
    check_outputs(spec, "unsharded quantized module", quant(batch), expected)
    if spec.traced:
        check_outputs(spec, "unsharded quantized module traced by torchrec.fx", _traced(quant)(batch), expected)
    if not spec.sharded:
        return {"tables": len(spec.tables), "features": len(spec.features), "world_size": 0}
    with quant_modules.devices_propagated():
        sharded = quant_modules.sharded(spec, quant)
        expect(type(sharded).__name__.startswith("Sharded"),
               f"shard_quant_model left the module a {type(sharded).__name__}: the plan names it, it should be sharded")
        check_outputs(spec, f"sharded on {spec.world_size} ranks", sharded(batch), expected)
        sharded_state = sharded.state_dict()
        check_sharded_state(spec, sharded_state, state)
        # The sharded state reloaded into the same plan (a module sharded from other weights): the same
        # outputs. That module runs a forward first: a sharded inference module creates its output dists,
        # whose buffers its state dict then holds, at its first forward.
        other = quant_modules.sharded(spec, quant_modules.quantized(spec, quant_modules.float_module(replace(spec, seed=spec.seed + 1))))
        other(batch)
        other.load_state_dict(sharded_state)
        check_outputs(spec, "sharded, reloaded from the sharded state dict", other(batch), expected)
    return {"tables": len(spec.tables), "features": len(spec.features), "world_size": spec.world_size}
