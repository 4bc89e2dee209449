"""KeyedTensor ops against the reference: regrouping pooled embeddings that come from several
KeyedTensors (several EBCs) into the groups a model's interaction layer reads.

``kt.accessors+getitem+to_dict``, ``kt.from_tensor_list``, ``kt.regroup`` (every key once: the
fbgemm ``permute_pooled_embs`` path; keys repeated or left out: the cat/split path; key_dim 1, and
key_dim 0 on the second path), ``kt.regroup_as_dict``, ``kt.KTRegroupAsDict`` (the module, called
twice to use its cached layout; key_dim 1 and 0; ``emb_dtype``), ``kt.permute_multi_embedding`` and
``kt.regroup_kts`` (the public fbgemm-backed functions), ``kt.to+pytree``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from paritykit.checks.sparse_ops.build import build_kt, tensor
from paritykit.checks.sparse_ops.cases import OpCase, refused_dtype
from paritykit.checks.sparse_ops.expect import expect_array, expect_value
from paritykit.checks.sparse_ops.reference import Array
from paritykit.checks.sparse_ops.reference_keyed import RefKT, kt_from_blocks, kt_getitem, kt_regroup, kt_regroup_as_dict, kt_to_dict
from paritykit.checks.sparse_ops.rules import REGROUP_KEY_DIM_0, kept_out
from paritykit.checks.sparse_ops.specs import KTSpec, groups_of, kt_lists
from paritykit.checks.sparse_ops.values import FLOAT_DTYPES, round_to

# fbgemm's CPU permute_multi_embedding (KTRegroupAsDict, permute_multi_embedding, regroup_kts) has no
# float64 version: pinned cases show it (unsupported while it lasts).
MULTI_EMBEDDING_DTYPES = ("float16", "float32")

PINNED_KTS = (KTSpec(("f0", "f1"), (2, 3), 3, "float32", 31), KTSpec(("f2", "f3", "f4"), (1, 4, 2), 3, "float32", 32))
# Keys of the second KeyedTensor first, in another order, split over groups; then keys repeated.
PINNED_GROUPS = ((("f4", "f2", "f0"), ("f3", "f1")), (("f2", "f0", "f2"), ("f4",), ("f3", "f0")))


@dataclass(frozen=True)
class Regroup:
    kts: tuple[KTSpec, ...]
    groups: tuple[tuple[str, ...], ...]

    def uses_every_key_once(self) -> bool:
        flat = sorted(key for group in self.groups for key in group)
        return flat == sorted(key for kt in self.kts for key in kt.keys)


@st.composite
def regroups(draw: st.DrawFn, dtypes: tuple[str, ...] = FLOAT_DTYPES, key_dims: tuple[int, ...] = (1, 0)) -> Regroup:
    kts = draw(kt_lists(dtypes=dtypes, key_dims=key_dims))
    return Regroup(kts, draw(groups_of(tuple(key for kt in kts for key in kt.keys))))


def regroup_drawable(spec: Regroup) -> bool:
    return not (spec.kts[0].key_dim == 0 and spec.uses_every_key_once() and kept_out(REGROUP_KEY_DIM_0))


def _accessors(specs: tuple[KTSpec, ...]) -> None:
    for i, spec in enumerate(specs):
        ref = spec.reference()
        kt = build_kt(ref)
        where = f"kts[{i}]"
        expect_value((kt.keys(), kt.length_per_key(), kt.key_dim()), (list(ref.keys), list(ref.dims), ref.key_dim), f"{where} keys, length_per_key, key_dim")
        expect_value(kt.offset_per_key(), ref.offset_per_key(), f"{where}.offset_per_key()")
        expect_value(kt.size_in_bytes(), len(ref.values_array().flat) * kt.values().element_size(), f"{where}.size_in_bytes()")
        expect_array(kt.values(), ref.values_array(), f"{where}.values()")
        for key in ref.keys:
            expect_array(kt[key], kt_getitem(ref, key), f"{where}[{key!r}]")
        as_dict = kt.to_dict()
        expect_value(list(as_dict), list(ref.keys), f"list({where}.to_dict())")
        for key, want in kt_to_dict(ref).items():
            expect_array(as_dict[key], want, f"{where}.to_dict()[{key!r}]")


def _from_tensor_list(specs: tuple[KTSpec, ...]) -> None:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    for i, spec in enumerate(specs):
        ref = spec.reference()
        blocks = [ref.block(key) for key in ref.keys]
        tensors = [tensor(kt_getitem(ref, key)) for key in ref.keys]
        kt = KeyedTensor.from_tensor_list(list(ref.keys), tensors, key_dim=ref.key_dim, cat_dim=ref.key_dim)
        want = kt_from_blocks(ref.keys, blocks, ref.dims, ref.batch, ref.key_dim, ref.dtype)
        expect_value((kt.keys(), kt.length_per_key()), (list(want.keys), list(want.dims)), f"from_tensor_list(kts[{i}]) keys, length_per_key")
        expect_array(kt.values(), want.values_array(), f"KeyedTensor.from_tensor_list(kts[{i}] blocks).values()")


def _expect_groups(actual: list, expected: list[Array], where: str) -> None:
    expect_value(len(actual), len(expected), f"len({where})")
    for g, (tensor_, want) in enumerate(zip(actual, expected)):
        expect_array(tensor_, want, f"{where}[{g}]")


def _regroup(spec: Regroup) -> None:
    from torchrec.sparse.jagged_tensor import KeyedTensor

    refs = [kt.reference() for kt in spec.kts]
    groups = [list(g) for g in spec.groups]
    actual = refused_dtype(lambda: KeyedTensor.regroup([build_kt(r) for r in refs], groups), f"KeyedTensor.regroup of {refs[0].dtype}")
    _expect_groups(actual, kt_regroup(refs, groups), f"KeyedTensor.regroup(kts, {groups})")
    if hasattr(KeyedTensor, "regroup_as_dict"):
        names = [f"group{g}" for g in range(len(groups))]
        as_dict = KeyedTensor.regroup_as_dict([build_kt(r) for r in refs], groups, names)
        expected = kt_regroup_as_dict(refs, groups, names)
        expect_value(list(as_dict), names, "list(KeyedTensor.regroup_as_dict(...))")
        for name in names:
            expect_array(as_dict[name], expected[name], f"KeyedTensor.regroup_as_dict(kts, {groups}, ...)[{name!r}]")
        if len(groups) > 1:
            _expect_refused_names(refs, groups, names[:-1])


def _expect_refused_names(refs: list[RefKT], groups: list[list[str]], names: list[str]) -> None:
    """A name short for its groups is refused ("Groups and keys should have same length"), never a
    dict that silently leaves the last group out."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    try:
        got = KeyedTensor.regroup_as_dict([build_kt(r) for r in refs], groups, names)
    except (AssertionError, ValueError, RuntimeError):
        return
    expect_value(sorted(got), "an error", f"KeyedTensor.regroup_as_dict(kts, {len(groups)} groups, {len(names)} names)")


@dataclass(frozen=True)
class RegroupModule:
    regroup: Regroup
    emb_dtype: str | None  # KTRegroupAsDict(emb_dtype=...) casts what it returns


def _regroup_module(spec: RegroupModule) -> None:
    """The module caches its layout at the first call: a second batch (same layout, other numbers) too."""
    from torchrec.modules.regroup import KTRegroupAsDict
    from torchrec.types import DataType

    groups = [list(g) for g in spec.regroup.groups]
    names = [f"group{g}" for g in range(len(groups))]
    emb_dtype = None if spec.emb_dtype is None else {"float16": DataType.FP16, "float32": DataType.FP32}[spec.emb_dtype]
    module = KTRegroupAsDict(groups, names, emb_dtype=emb_dtype)
    for batch in range(2):
        refs = [replace(kt, seed=kt.seed + batch).reference() for kt in spec.regroup.kts]
        out = refused_dtype(lambda: module([build_kt(r) for r in refs]), f"KTRegroupAsDict of {refs[0].dtype}")
        expected = kt_regroup_as_dict(refs, groups, names)
        expect_value(list(out), names, f"list(KTRegroupAsDict(...) call {batch})")
        for name in names:
            want = expected[name]
            if spec.emb_dtype is not None:
                want = Array(want.shape, tuple(round_to(spec.emb_dtype, x) for x in want.flat), spec.emb_dtype)
            expect_array(out[name], want, f"KTRegroupAsDict({groups}, emb_dtype={spec.emb_dtype}) call {batch}[{name!r}]")


def _fbgemm_functions(spec: Regroup) -> None:
    import torchrec.sparse.jagged_tensor as jagged_tensor

    refs = [kt.reference() for kt in spec.kts]
    groups = [list(g) for g in spec.groups]
    for name in ("permute_multi_embedding", "regroup_kts"):
        function = getattr(jagged_tensor, name, None)
        if function is None:
            continue  # this torchrec has no such function (detected, not assumed)
        actual = refused_dtype(lambda: function([build_kt(r) for r in refs], groups), f"{name} of {refs[0].dtype}")
        _expect_groups(actual, kt_regroup(refs, groups), f"{name}(kts, {groups})")


def _move_pytree(specs: tuple[KTSpec, ...]) -> None:
    from torch.utils import _pytree as pytree

    for i, spec in enumerate(specs):
        ref: RefKT = spec.reference()
        kt = build_kt(ref)
        moved = kt.to(kt.device(), non_blocking=True)
        expect_value((moved.keys(), moved.length_per_key(), moved.key_dim()), (list(ref.keys), list(ref.dims), ref.key_dim), f"kts[{i}].to(device)")
        expect_array(moved.values(), ref.values_array(), f"kts[{i}].to(device).values()")
        leaves, tree = pytree.tree_flatten(build_kt(ref))
        rebuilt = pytree.tree_unflatten(leaves, tree)
        expect_value((rebuilt.keys(), rebuilt.length_per_key()), (list(ref.keys), list(ref.dims)), f"tree_unflatten(tree_flatten(kts[{i}]))")
        expect_array(rebuilt.values(), ref.values_array(), f"tree_unflatten(tree_flatten(kts[{i}])).values()")


def kt_cases() -> list[OpCase]:
    lists = kt_lists(dtypes=FLOAT_DTYPES, key_dims=(1, 0))
    key_dim_1 = regroups(dtypes=MULTI_EMBEDDING_DTYPES, key_dims=(1,))
    pinned = tuple(Regroup(PINNED_KTS, groups) for groups in PINNED_GROUPS)
    float64 = Regroup(tuple(replace(kt, dtype="float64") for kt in PINNED_KTS), PINNED_GROUPS[0])
    key_dim_0 = Regroup(tuple(replace(kt, key_dim=0) for kt in PINNED_KTS), PINNED_GROUPS[1])
    modules = st.builds(RegroupModule, regroups(dtypes=MULTI_EMBEDDING_DTYPES), st.sampled_from((None, "float16", "float32")))
    return [
        OpCase("kt.accessors+getitem+to_dict", lists, _accessors, (PINNED_KTS,)),
        OpCase("kt.from_tensor_list", lists, _from_tensor_list, (PINNED_KTS,)),
        OpCase("kt.regroup+regroup_as_dict", regroups().filter(regroup_drawable), _regroup, pinned + (float64, key_dim_0)),
        OpCase("kt.KTRegroupAsDict", modules, _regroup_module,
               tuple(RegroupModule(p, None) for p in pinned) + (RegroupModule(key_dim_0, "float16"), RegroupModule(float64, None))),
        OpCase("kt.permute_multi_embedding+regroup_kts", key_dim_1, _fbgemm_functions, pinned + (float64,)),
        OpCase("kt.to+pytree", lists, _move_pytree, (PINNED_KTS,)),
    ]
