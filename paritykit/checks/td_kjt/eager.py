"""The td-kjt check unsharded: EBC/EC fed a batch as a TensorDict (via torchrec's own route or via
``paritykit.convert.td_to_kjt``) give the outputs and weight gradients of the same batch as a KJT.

Routes for the TensorDict form:
- "torchrec": the module is fed the TensorDict itself (torchrec converts it with maybe_td_to_kjt);
- "paritykit": the module is fed ``paritykit.convert.td_to_kjt(td)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from paritykit.checks.td_kjt.assertion import ROUTES, assert_td_kjt_parity
from paritykit.harness.tables import TableSpec, build_ebc, build_ec
from paritykit.strategies import CONTIGUOUS_FORMS, SparseBatch, sparse_batches

NUM_EMBEDDINGS = 20


@dataclass(frozen=True)
class EagerCase:
    module: str  # "ebc" or "ec"
    pooling: str  # "SUM"/"MEAN" (EBC only)
    route: str
    form: str
    batch: SparseBatch


def _tables(keys: tuple[str, ...], pooling: str):
    # Two features share table t0 so that shared-table gradients are covered.
    groups = [keys[:2], *[(k,) for k in keys[2:]]]
    return tuple(
        TableSpec(f"t{i}", num_embeddings=NUM_EMBEDDINGS, embedding_dim=4, feature_names=group, pooling=pooling)
        for i, group in enumerate(groups)
    )



@st.composite
def eager_cases(draw: st.DrawFn) -> EagerCase:
    module = draw(st.sampled_from(("ebc", "ec")))
    route = draw(st.sampled_from(ROUTES))
    # torchrec's own route is only defined for unweighted, fixed-batch, contiguous input (docs/td-kjt.md).
    torchrec_route = route == "torchrec"
    batch = draw(
        sparse_batches(
            max_keys=4,
            id_bounds=NUM_EMBEDDINGS,
            weighted=False if (torchrec_route or module == "ec") else None,
            # Unsharded EBC needs inverse indices for a variable batch; EC takes it as is.
            variable_batch=None if (module == "ec" and not torchrec_route) else False,
        )
    )
    form = draw(st.sampled_from(CONTIGUOUS_FORMS if torchrec_route else CONTIGUOUS_FORMS + ("narrow",)))
    # torch's embedding_bag takes per-sample weights only with SUM pooling.
    pooling = draw(st.sampled_from(("SUM", "MEAN"))) if module == "ebc" and not batch.weighted else "SUM"
    return EagerCase(module, pooling, route, form, batch)


def run_eager_case(case: EagerCase, device: str) -> dict[str, Any]:
    tables = _tables(case.batch.keys, case.pooling)
    if case.module == "ebc":
        module = build_ebc(tables, seed=case.batch.seed % 1000, is_weighted=case.batch.weighted, device=device)
    else:
        module = build_ec(tables, seed=case.batch.seed % 1000, device=device)
    return assert_td_kjt_parity(module, case.batch, form=case.form, route=case.route)



def pinned_eager_cases() -> tuple[EagerCase, ...]:
    """Cases every run covers before the random draws: a weighted EBC, a MEAN-pooled EBC with an
    empty row and an empty feature, and an EC with a variable batch size, all through paritykit's
    conversion (random draws at a few examples may miss each of them)."""
    rows = ((2, 0, 1), (1, 3, 0), (0, 0, 0))
    weighted = SparseBatch(keys=("f0", "f1", "f2"), lengths=rows, id_bounds=(NUM_EMBEDDINGS,) * 3, seed=11, weighted=True)
    unweighted = SparseBatch(keys=("f0", "f1", "f2"), lengths=rows, id_bounds=(NUM_EMBEDDINGS,) * 3, seed=12)
    variable = SparseBatch(keys=("f0", "f1"), lengths=((1, 2), (0, 3, 1)), id_bounds=(NUM_EMBEDDINGS,) * 2, seed=13)
    return (
        EagerCase("ebc", "SUM", "paritykit", "from_jagged_offsets", weighted),
        EagerCase("ebc", "MEAN", "paritykit", "nested_tensor", unweighted),
        EagerCase("ec", "SUM", "paritykit", "from_jagged_lengths", variable),
    )



def eager_case_id(case: EagerCase) -> str:
    b = case.batch
    return (f"eager {case.module} {case.pooling} via {case.route} {case.form} keys={len(b.keys)} "
            f"weighted={b.weighted} vbe={b.variable_batch} {b!r}")
