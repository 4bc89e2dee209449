"""torchrec's KJT validator (``torchrec.sparse.jagged_tensor_validator``) against the reference of
when a KJT means a batch (reference_validity.py).

``kjt.validate``: a drawn valid KJT (fixed batch or one rank's variable batch, weights or none,
empty keys and rows, a batch of no samples, built from lengths, offsets or both), or the same KJT
with ONE corruption (CORRUPTIONS), optionally with tables (``EmbeddingBagConfig``) whose
``num_embeddings`` leaves some ids out of range. torchrec's verdict must be the reference's: a KJT
that breaks a rule is rejected (``ValueError``, or the validator's documented soft verdict: a
warning logged, ``False`` returned); a valid one passes without a warning and returns whether every
id is inside its table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import torch_dtype
from paritykit.checks.sparse_ops.cases import OpCase
from paritykit.checks.sparse_ops.kjt_cases import PINNED_FIXED, PINNED_VBE
from paritykit.checks.sparse_ops.reference import cumsum
from paritykit.checks.sparse_ops.reference_validity import RawKJT, ids_per_key, kjt_problems, out_of_range, rows
from paritykit.checks.sparse_ops.rules import (
    VALIDATOR_NEGATIVE_ROW,
    VALIDATOR_STRIDE_MISMATCH,
    VALIDATOR_VBE_VERDICT,
    kept_out,
    kjt_drawable,
)
from paritykit.checks.sparse_ops.specs import KJTSpec, kjt_specs
from paritykit.errors import HarnessError, ParityError

LOGGER = "torchrec.sparse.jagged_tensor_validator"
# The corruptions torchrec's validator misses (known issues), by the rule that lists them.
MISSED_BY_RULE = {"negative-length": VALIDATOR_NEGATIVE_ROW, "offsets-decreasing": VALIDATOR_NEGATIVE_ROW,
                  "stride-mismatch": VALIDATOR_STRIDE_MISMATCH}


@dataclass(frozen=True)
class ValidateSpec:
    kjt: KJTSpec  # value dtype an integer (ids)
    corruption: str | None = None
    # Per key, a table's num_embeddings less (the key's largest id + 1): negative puts an id out of
    # range. None: no tables given.
    slack: tuple[int, ...] | None = None


def raw_of(spec: KJTSpec) -> RawKJT:
    ref = spec.reference()
    lengths = ref.flat_lengths()
    return RawKJT(ref.keys, ref.flat_values(), lengths if "lengths" in spec.form else None,
                  tuple(cumsum(lengths)) if "offsets" in spec.form else None,
                  len(ref.flat_values()) if ref.weights is not None else None,
                  None if ref.variable else ref.batch_size, ref.strides)


def _moved(lengths: tuple[int, ...], source: int, target: int, count: int) -> tuple[int, ...]:
    out = list(lengths)
    out[source] -= count
    out[target] += count
    return tuple(out)


def _jagged_corruptions(raw: RawKJT) -> dict[str, Any]:
    """Corruptions of the lengths and offsets: name -> the changes (applicable to ``raw`` only)."""
    lengths, offsets = raw.lengths, raw.offsets
    rows = len(lengths) if lengths is not None else len(offsets) - 1
    out: dict[str, Any] = {}
    if lengths is not None:
        out["lengths-sum"] = {"lengths": (lengths[0] + 1,) + lengths[1:]} if lengths else None
        if offsets is None and rows >= 2:  # the sum kept: only the sign shows it
            out["negative-length"] = {"lengths": _moved(lengths, 0, 1, lengths[0] + 1)}
    if offsets is not None:
        out["offsets-start"] = {"offsets": (1,) + offsets[1:]} if rows else None
        out["offsets-end"] = {"offsets": offsets[:-1] + (offsets[-1] + 1,)}
        if lengths is None and rows >= 2:  # first and last kept
            out["offsets-decreasing"] = {"offsets": (0, offsets[-1] + 1) + offsets[2:]}
    if lengths is not None and offsets is not None:
        out["offsets-count"] = {"offsets": offsets + (offsets[-1],)}
        source = next((i for i, n in enumerate(lengths) if n), None)
        if rows >= 2 and source is not None:  # an id moved to the next row in the lengths only
            out["lengths-offsets-mismatch"] = {"lengths": _moved(lengths, source, (source + 1) % rows, 1)}
    return {name: change for name, change in out.items() if change is not None}


def _batch_corruptions(raw: RawKJT) -> dict[str, Any]:
    keys, strides = raw.keys, raw.strides
    out: dict[str, Any] = {}
    if len(keys) >= 2:
        out["duplicate-key"] = {"keys": (keys[0],) + keys[1:-1] + (keys[0],)}
    if keys and rows(raw):
        out["no-keys"] = {"keys": (), "strides": None, "stride": None}
    if raw.weights is not None:
        out["weights-count"] = {"weights": raw.weights + 1}
    if strides is None and keys:
        out["stride-mismatch"] = {"stride": raw.stride + 1}
        if len(keys) >= 2:  # one more (empty) row
            out["rows-not-divisible"] = {"lengths": None if raw.lengths is None else raw.lengths + (0,),
                                         "offsets": None if raw.offsets is None else raw.offsets + (raw.offsets[-1],)}
    if strides is not None:
        out["vbe-strides-sum"] = {"strides": ((strides[0][0] + 1,),) + strides[1:]}
        out["vbe-more-features"] = {"strides": strides + ((0,),)}
        out["vbe-several-ranks"] = {"strides": tuple((s[0], 0) for s in strides)}
        if len(keys) >= 2:  # two keys' samples given as one: the sum kept, only the shape shows it
            out["vbe-fewer-features"] = {"strides": ((strides[0][0] + strides[1][0],),) + strides[2:]}
    return out


def corruptions(raw: RawKJT) -> dict[str, Any]:
    """Every single corruption applicable to ``raw``, minus those a standing known issue keeps out."""
    out = {**_jagged_corruptions(raw), **_batch_corruptions(raw)}
    return {name: change for name, change in out.items() if not (name in MISSED_BY_RULE and kept_out(MISSED_BY_RULE[name]))}


def corrupted(spec: ValidateSpec) -> RawKJT:
    raw = raw_of(spec.kjt)
    if spec.corruption is None:
        return raw
    changes = {**_jagged_corruptions(raw), **_batch_corruptions(raw)}.get(spec.corruption)
    if changes is None:
        raise HarnessError(f"corruption {spec.corruption!r} does not apply to {spec.kjt!r}")
    return replace(raw, **changes)


def build_raw(raw: RawKJT, spec: KJTSpec) -> Any:
    """torchrec's KJT holding exactly ``raw`` (the constructor does not check; the validator does)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    index = torch_dtype(spec.lengths_dtype)
    parts: dict[str, Any] = {}
    if raw.lengths is not None:
        parts["lengths"] = torch.tensor(list(raw.lengths), dtype=index)
    if raw.offsets is not None:
        parts["offsets"] = torch.tensor(list(raw.offsets), dtype=index)
    if raw.weights is not None:
        parts["weights"] = torch.arange(raw.weights, dtype=torch_dtype(spec.weight_dtype)) / 8
    if raw.strides is not None:
        parts["stride_per_key_per_rank"] = [list(s) for s in raw.strides]
    elif raw.stride is not None:
        parts["stride"] = raw.stride
    return KeyedJaggedTensor(keys=list(raw.keys), values=torch.tensor(list(raw.values), dtype=torch_dtype(spec.value_dtype)), **parts)


def tables(raw: RawKJT, slack: tuple[int, ...]) -> dict[str, int]:
    """num_embeddings per key: the key's largest id + 1 + its slack (at least one row)."""
    ids = ids_per_key(raw)
    return {key: max(max(ids[key], default=0) + 1 + s, 1) for key, s in zip(raw.keys, slack)}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def verdict(kjt: Any, num_embeddings: dict[str, int] | None) -> tuple[str | None, Any, list[str]]:
    """torchrec's verdict: (the ValueError's words or None, what it returned, the warnings it logged)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

    configs = None if num_embeddings is None else [
        EmbeddingBagConfig(name=f"t_{key}", embedding_dim=4, num_embeddings=n, feature_names=[key]) for key, n in num_embeddings.items()]
    handler, logger = _Warnings(), logging.getLogger(LOGGER)
    # The warnings are the validator's soft verdict: heard whatever quieted torchrec's logs
    # (paritykit.harness.noise, logging.disable), recorded here and not printed.
    level, propagate, disabled = logger.level, logger.propagate, logging.root.manager.disable
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    logging.disable(logging.NOTSET)
    try:
        returned = validate_keyed_jagged_tensor(kjt, configs)
    except ValueError as exc:
        return str(exc), None, handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        logging.disable(disabled)
    return None, returned, handler.messages


def _validate(spec: ValidateSpec) -> dict[str, Any]:
    raw = corrupted(spec)
    problems = kjt_problems(raw)
    if spec.corruption is not None and not problems:
        raise HarnessError(f"corruption {spec.corruption!r} of {spec.kjt!r} left a valid KJT")
    num_embeddings = None if spec.slack is None or problems else tables(raw, spec.slack)
    error, returned, warned = verdict(build_raw(raw, spec.kjt), num_embeddings)
    what = f"validate_keyed_jagged_tensor(KJT with {spec.corruption or 'no corruption'})"
    if problems:
        if error is None and returned is not False and not warned:
            raise ParityError(f"{what} accepted it (returned {returned!r}, no warning); the reference: {'; '.join(problems)}")
        return {"rejected": problems[0]}
    outside = out_of_range(raw, num_embeddings or {})
    if error is not None or returned is not (not outside) or (bool(warned) != bool(outside)):
        said = f"raised ValueError: {error}" if error is not None else f"returned {returned!r}, warnings {warned}"
        raise ParityError(f"{what} {said}; the reference: a valid KJT, ids out of range: {outside or 'none'}")
    return {"accepted": True, "out_of_range": len(outside)}


@st.composite
def validate_specs(draw: st.DrawFn) -> ValidateSpec:
    kjt = draw(kjt_specs(ranks=1, inverse=False, value_dtypes=("int32", "int64"), weight_dtypes=("float32",)).filter(kjt_drawable))
    names = sorted(corruptions(raw_of(kjt)))
    corruption = draw(st.one_of(st.none(), st.sampled_from(names))) if names else None
    slack = None
    if corruption is None and draw(st.booleans()):
        slack = tuple(draw(st.lists(st.sampled_from((-1, 0, 3)), min_size=len(kjt.keys), max_size=len(kjt.keys))))
    return ValidateSpec(kjt, corruption, slack)


ONE_RANK_VBE = replace(PINNED_VBE, strides=((3,), (5,), (2,)), inverse_batch=None, form="lengths+offsets")
# The KJT each corruption is pinned on: the first of these that it applies to, the plainest form, so
# that no other of the validator's tests (the lengths against the offsets first) speaks for it.
PINNED_BASES = (PINNED_FIXED, replace(PINNED_FIXED, form="offsets"), replace(PINNED_FIXED, form="lengths+offsets"), ONE_RANK_VBE)


def pinned_validations() -> tuple[ValidateSpec, ...]:
    """Four valid KJTs (tables given: every id in range, none starting at 0; then ids out of range, a
    key's largest id its table's size and one beyond; a variable batch), then every corruption once (those a standing known issue lists are left to
    known_broken.py). One key out of range makes the verdict False whatever the others say, so the
    in-range tables come alone."""
    corrupted_once: dict[str, ValidateSpec] = {}
    for base in PINNED_BASES:
        for name in sorted(corruptions(raw_of(base))):
            corrupted_once.setdefault(name, ValidateSpec(base, name))
    # Out of range by its last row (== the table's rows) and beyond it.
    return (ValidateSpec(PINNED_BASES[2], None, (0, 3, 0)), ValidateSpec(PINNED_BASES[2], None, (0, 3, -1)),
            ValidateSpec(PINNED_BASES[2], None, (0, 3, -2)), ValidateSpec(ONE_RANK_VBE)) + tuple(corrupted_once.values())


def validator_cases() -> list[OpCase]:
    return [OpCase("kjt.validate", validate_specs(), _validate, pinned_validations())]


# --- what torchrec's validator gets wrong (known issues; run by known_broken.py) -------------------


def _negative_row() -> None:
    """A row of length -1, given by lengths (summing right) and by offsets (first and last right)."""
    for form, corruption in (("lengths", "negative-length"), ("offsets", "offsets-decreasing")):
        _validate(ValidateSpec(replace(PINNED_FIXED, form=form), corruption))


def _stride_mismatch() -> None:
    _validate(ValidateSpec(PINNED_FIXED, "stride-mismatch"))


def _vbe_verdict() -> None:
    """The verdict itself: an invalid variable batch must raise or return False, as the docstring says."""
    for corruption in ("vbe-strides-sum", "vbe-fewer-features"):
        spec = ValidateSpec(ONE_RANK_VBE, corruption)
        raw = corrupted(spec)
        error, returned, _ = verdict(build_raw(raw, spec.kjt), None)
        if error is None and returned is not False:
            raise ParityError(f"validate_keyed_jagged_tensor(VBE KJT with {corruption}) returned {returned!r}; "
                              f"the reference: invalid ({'; '.join(kjt_problems(raw))})")


KNOWN_BROKEN_VALIDATOR = {
    VALIDATOR_NEGATIVE_ROW: ("validate_keyed_jagged_tensor of a KJT with a row of length -1", _negative_row),
    VALIDATOR_STRIDE_MISMATCH: ("validate_keyed_jagged_tensor of a fixed batch whose stride disagrees with its lengths", _stride_mismatch),
    VALIDATOR_VBE_VERDICT: ("validate_keyed_jagged_tensor's return value for an invalid VBE KJT", _vbe_verdict),
}
