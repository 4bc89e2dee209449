"""Inputs that torchrec gets wrong, by name: kept out of the draws wherever a known issue lists them
(paritykit/checks/known_issues.toml, ``draws = { rule = NAME }``) and not fixed, and run on purpose
by the known-broken cases (known_broken.py). Each predicate says which drawn input is such a case.
"""

from __future__ import annotations

from paritykit.checks.known_issues import rule_kept_out
from paritykit.checks.sparse_ops.specs import JTSpec, KJTSpec

# KeyedJaggedTensor.to_dict of a KJT with keys and no samples: IndexError (torchrec 1.8).
TO_DICT_ZERO_BATCH = "kjt-to-dict-zero-batch"
# A KJT given only offsets (no lengths, no length_per_key) with no samples: length_per_key fails.
OFFSETS_ZERO_BATCH = "kjt-offsets-zero-batch"
# JaggedTensor.to_padded_dense / _weights of a JT with no rows and no desired_length fails.
PADDED_DENSE_NO_ROWS = "jt-to-padded-dense-no-rows"
# KeyedTensor.regroup of key_dim-0 KeyedTensors, every key once: joined along dim 1.
REGROUP_KEY_DIM_0 = "kt-regroup-key-dim-0"
# The gradient of the weights through KJT.permute with a key taken twice or left out.
PERMUTE_GRAD_NOT_BIJECTIVE = "kjt-permute-weights-grad-not-bijective"
# The gradient of the weights through a VBE KJT's permute.
VBE_PERMUTE_NO_GRAD = "vbe-kjt-permute-weights-no-grad"
# The gradient of a key left out of every group, through fbgemm's permute_multi_embedding
# (KTRegroupAsDict, permute_multi_embedding, regroup_kts).
MULTI_EMBEDDING_UNUSED_KEY_GRAD = "kt-multi-embedding-unused-key-grad"
# validate_keyed_jagged_tensor accepts a KJT with a negative row length (lengths summing right, or
# offsets that decrease between a right first and last one).
VALIDATOR_NEGATIVE_ROW = "kjt-validator-negative-row-length"
# validate_keyed_jagged_tensor accepts a fixed batch whose explicit stride disagrees with its lengths.
VALIDATOR_STRIDE_MISMATCH = "kjt-validator-stride-mismatch"
# validate_keyed_jagged_tensor returns True for an invalid variable-batch KJT (it only logs a warning).
VALIDATOR_VBE_VERDICT = "kjt-validator-vbe-verdict-dropped"
# construct_jagged_tensors (the sharded EC's output builder) of features with a batch of no samples.
CONSTRUCT_ZERO_BATCH = "construct-jagged-tensors-zero-batch"
# kjt_is_equal / jt_is_equal compare integer ids with torch.allclose: ids within 1e-5 of their size match.
IS_EQUAL_IDS_TOLERANCE = "kjt-is-equal-ids-within-tolerance"
# KeyedJaggedTensor.copy_ into a KJT whose offsets (lengths) were computed, from one without them: kept stale.
COPY_KEEPS_STALE_LAYOUT = "kjt-copy-keeps-stale-offsets"
# The smallest id at which torch.allclose's default rtol (1e-5) calls ids one apart equal.
ALLCLOSE_ID_THRESHOLD = 99_999

RULES = (TO_DICT_ZERO_BATCH, OFFSETS_ZERO_BATCH, PADDED_DENSE_NO_ROWS, REGROUP_KEY_DIM_0,
         PERMUTE_GRAD_NOT_BIJECTIVE, VBE_PERMUTE_NO_GRAD, MULTI_EMBEDDING_UNUSED_KEY_GRAD, VALIDATOR_NEGATIVE_ROW,
         VALIDATOR_STRIDE_MISMATCH, VALIDATOR_VBE_VERDICT, CONSTRUCT_ZERO_BATCH, IS_EQUAL_IDS_TOLERANCE, COPY_KEEPS_STALE_LAYOUT)


def kept_out(rule: str) -> bool:
    return rule_kept_out(rule) is not None


def zero_batch(spec: KJTSpec) -> bool:
    """A fixed batch of no samples with keys."""
    return bool(spec.keys) and spec.strides is None and spec.batch_size == 0


def offsets_only_zero_batch(spec: KJTSpec) -> bool:
    return zero_batch(spec) and spec.form == "offsets" and not spec.metadata


def kjt_drawable(spec: KJTSpec, *, to_dict: bool = False) -> bool:
    """Whether a drawn KJT may run on this stack: not a combination a standing known issue lists."""
    if offsets_only_zero_batch(spec) and kept_out(OFFSETS_ZERO_BATCH):
        return False
    return not (to_dict and zero_batch(spec) and kept_out(TO_DICT_ZERO_BATCH))


def jt_padding_drawable(spec: JTSpec, desired_length: int | None) -> bool:
    return not (not spec.lengths and desired_length is None and kept_out(PADDED_DENSE_NO_ROWS))


def permute_grad_drawable(indices: tuple[int, ...], keys: int, variable: bool) -> bool:
    if variable and kept_out(VBE_PERMUTE_NO_GRAD):
        return False
    return sorted(indices) == list(range(keys)) or not kept_out(PERMUTE_GRAD_NOT_BIJECTIVE)


def ids_comparable(ids: list[int]) -> bool:
    """Whether kjt_is_equal tells these integer ids from ids one apart on this stack."""
    return all(abs(i) < ALLCLOSE_ID_THRESHOLD for i in ids) or not kept_out(IS_EQUAL_IDS_TOLERANCE)
