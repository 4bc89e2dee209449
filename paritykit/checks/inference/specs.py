"""The inference check's cases: quantized tables, a batch, and where each table's shards go.

A case is one module (``ebc``, ``weighted-ebc`` or ``ec``) of a few tables, each with its own weight
kind (int8, int4, int2, fp16, fp32) and placement on ``world_size`` ranks of one inference host:
``tw:R`` (table-wise on rank R), ``rw`` (row-wise over every rank in torchrec's even blocks),
``rw:N,N,..`` (row-wise, that many rows on each rank in rank order, for inference) or ``cw:R,R,..`` (column-wise
shards on those ranks, in any order, repeats allowed; pooled modules only: torchrec shards an
inference EC on CPU table- or row-wise). Inference sharding keeps every rank in the one process, so
the world sizes are drawn here, not taken from the gate's pools.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from paritykit.checks.known_issues import rule_kept_out

# A known torchrec defect: a float table (fp16, fp32) of a quantized module cannot be sharded for
# inference with its scale and bias split out (known_broken.py reproduces it).
FLOAT_TABLE_SHARDED = "quant-float-table-sharded"
FLOAT_KINDS = ("fp16", "fp32")
# Another: a row-wise MEAN table of a sharded quantized EBC averages each shard's ids on its own and
# sums the averages.
ROW_WISE_MEAN = "quant-ebc-row-wise-mean-per-shard"
# And: an int4 or int2 table sharded row-wise with one shard holding every row (a table of one row,
# or uneven sizes giving one rank them all) cannot be loaded from the unsharded state dict.
PACKED_ONE_ROW = "quant-packed-one-row-table-row-wise"
PACKED_KINDS = ("int4", "int2")

WEIGHT_KINDS = ("int8", "int4", "int2", "fp16", "fp32")
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
MODULES = ("ebc", "weighted-ebc", "ec")
MAX_WORLD_SIZE = 4


@dataclass(frozen=True)
class QuantTable:
    name: str
    rows: int
    dim: int
    kind: str  # one of WEIGHT_KINDS
    features: tuple[str, ...]
    placement: str  # "tw:R", "rw", "rw:N,N,.." or "cw:R,R,.."
    mean: bool = False  # pooled modules: MEAN pooling rather than SUM

    def label(self) -> str:
        pooling = " mean" if self.mean else ""
        return f"{self.name}[{self.rows}x{self.dim} {self.kind} {'+'.join(self.features)} {self.placement}{pooling}]"


@dataclass(frozen=True)
class QuantSpec:
    module: str  # one of MODULES
    tables: tuple[QuantTable, ...]
    world_size: int
    # Per feature (in table order, then each table's features), per sample: the ids of the bag.
    bags: tuple[tuple[tuple[int, ...], ...], ...]
    # Per feature, per sample, per id: its weight (weighted-ebc only).
    weights: tuple[tuple[tuple[float, ...], ...], ...] | None
    output_dtype: str = "float32"
    seed: int = 0
    # Whether the case shards the module too (not where a known torchrec defect keeps a table kind out).
    sharded: bool = True
    # Whether the unsharded module is also traced by torchrec.fx (a quarter of the draws: tracing costs
    # more than the rest of a case).
    traced: bool = False

    @property
    def features(self) -> tuple[str, ...]:
        return tuple(f for table in self.tables for f in table.features)

    @property
    def pooled(self) -> bool:
        return self.module != "ec"

    def case_id(self) -> str:
        tables = " ".join(t.label() for t in self.tables)
        bags = "; ".join(f"{f}={[list(b) for b in bags]}" for f, bags in zip(self.features, self.bags))
        weights = "" if self.weights is None else f" weights={[[list(w) for w in ws] for ws in self.weights]}"
        where = (f"world_size={self.world_size}" if self.sharded else "unsharded only") + (" traced" if self.traced else "")
        return (f"{self.module} {where} out={self.output_dtype} {tables} "
                f"bags: {bags}{weights} seed={self.seed}")


def _one_shard_holds_all(table: QuantTable) -> bool:
    sizes = table.placement.partition(":")[2]
    return table.rows == 1 or (bool(sizes) and str(table.rows) in sizes.split(","))


def widths(kind: str) -> tuple[int, ...]:
    """The widths fbgemm stores a table of ``kind`` in: a packed row must fill whole fp16 words (2 bytes),
    so int2 rows are a multiple of 8 entries, int4 rows of 4 (its refusal otherwise: "ncols needs to be
    multiple of 2 Bytes"). Column shards are held to the same."""
    return (8, 16) if kind == "int2" else (4, 8, 12, 16)


@st.composite
def _placement(draw: st.DrawFn, world_size: int, pooled: bool, dim: int, shard_dims: tuple[int, ...], rows: int) -> str:
    choices = ["tw", "rw"] + (["cw"] if pooled and shard_dims else [])
    kind = draw(st.sampled_from(choices))
    if kind == "tw":
        return f"tw:{draw(st.integers(0, world_size - 1))}"
    if kind == "rw":
        if not draw(st.booleans()):
            return "rw"  # torchrec's even blocks
        cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=world_size - 1, max_size=world_size - 1)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
        return "rw:" + ",".join(map(str, sizes))  # the rows of each rank, in rank order (some may hold none)
    shards = dim // draw(st.sampled_from(shard_dims))
    ranks = draw(st.lists(st.integers(0, world_size - 1), min_size=shards, max_size=shards))
    return "cw:" + ",".join(map(str, ranks))


@st.composite
def quant_specs(draw: st.DrawFn, module: str) -> QuantSpec:
    pooled = module != "ec"
    world_size = draw(st.integers(1, MAX_WORLD_SIZE))
    count = draw(st.integers(1, 3))
    ec_dim = draw(st.sampled_from((4, 8, 12, 16)))  # an EC's tables share one width
    tables = []
    feature_number = 0
    for index in range(count):
        kinds = WEIGHT_KINDS if pooled else tuple(k for k in WEIGHT_KINDS if ec_dim in widths(k))
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.sampled_from(widths(kind))) if pooled else ec_dim
        least = min(widths(kind))
        shard_dims = tuple(d for d in (least, 2 * least) if dim % d == 0 and dim // d > 1) or (dim,)
        features = tuple(f"f{feature_number + k}" for k in range(draw(st.integers(1, 2))))
        feature_number += len(features)
        rows = draw(st.integers(1, 12))
        tables.append(QuantTable(
            name=f"t{index}", rows=rows, dim=dim, kind=kind,
            features=features, placement=draw(_placement(world_size, pooled, dim, shard_dims, rows)),
            mean=pooled and draw(st.booleans())))
        if tables[-1].placement.startswith("rw"):
            if tables[-1].mean and rule_kept_out(ROW_WISE_MEAN) is not None:
                tables[-1] = replace(tables[-1], mean=False)
            if kind in PACKED_KINDS and _one_shard_holds_all(tables[-1]) and rule_kept_out(PACKED_ONE_ROW) is not None:
                tables[-1] = replace(tables[-1], placement="tw:0")
    batch = draw(st.integers(1, 4))
    bags = []
    for table in tables:
        for _ in table.features:
            bags.append(tuple(tuple(draw(st.lists(st.integers(0, table.rows - 1), max_size=4))) for _ in range(batch)))
    weights = None
    if module == "weighted-ebc":
        weight = st.sampled_from((-2.0, -0.5, 0.25, 1.0, 1.5, 3.0))
        weights = tuple(tuple(tuple(draw(st.lists(weight, min_size=len(bag), max_size=len(bag)))) for bag in feature)
                        for feature in bags)
    floats = any(t.kind in FLOAT_KINDS for t in tables)
    return QuantSpec(module, tuple(tables), world_size, tuple(bags), weights,
                     output_dtype=draw(st.sampled_from(OUTPUT_DTYPES)), seed=draw(st.integers(0, 2**16)),
                     sharded=not (floats and rule_kept_out(FLOAT_TABLE_SHARDED) is not None),
                     traced=draw(st.sampled_from((False, False, False, True))))


def _t(name: str, rows: int, dim: int, kind: str, features: tuple[str, ...], placement: str, mean: bool = False) -> QuantTable:
    return QuantTable(name, rows, dim, kind, features, placement, mean)


# Always run: column-wise shards out of rank order and on a repeated rank, every weight kind, a table
# with fewer rows than ranks row-wise, empty bags under MEAN, weights, half-precision outputs; the
# float kinds unsharded and MEAN off the row-wise tables (there they are the known defects').
PINNED: dict[str, tuple[QuantSpec, ...]] = {
    "ebc": (
        QuantSpec("ebc", (_t("t0", 6, 12, "int8", ("f0",), "cw:1,0,1"), _t("t1", 5, 8, "int4", ("f1", "f2"), "tw:0", True)), 2,
                  (((1, 5), (0,)), ((), (4, 4, 1)), ((2,), ())), None, traced=True),
        QuantSpec("ebc", (_t("t0", 3, 8, "int2", ("f0",), "rw"), _t("t1", 9, 16, "int4", ("f1",), "cw:2,0,1,0"),
                          _t("t2", 4, 4, "int8", ("f2",), "tw:2")), 4,
                  (((0, 2), (1,), ()), ((8, 0, 3), (), (5,)), ((3,), (0, 1), (2, 2))), None, output_dtype="float16", seed=1),
        QuantSpec("ebc", (_t("t0", 4, 8, "fp16", ("f0",), "tw:0", True), _t("t1", 3, 4, "fp32", ("f1",), "tw:0")), 1,
                  (((3, 1), ()), ((2,), (0, 0, 1))), None, output_dtype="bfloat16", seed=5, sharded=False),
    ),
    "weighted-ebc": (
        QuantSpec("weighted-ebc", (_t("t0", 7, 8, "int8", ("f0", "f1"), "rw"), _t("t1", 4, 8, "int4", ("f2",), "cw:1,0")), 3,
                  (((6, 0), (3,)), ((), (1, 2, 5)), ((3, 3), (0,))),
                  (((1.5, -2.0), (0.25,)), ((), (1.0, 3.0, -0.5)), ((-0.5, 1.0), (3.0,))), seed=2),
    ),
    "ec": (
        QuantSpec("ec", (_t("t0", 5, 8, "int4", ("f0",), "rw"), _t("t1", 3, 8, "int8", ("f1", "f2"), "tw:1")), 2,
                  (((4, 0, 2), ()), ((1,), (2, 0)), ((), (1,))), None, seed=3, traced=True),
        QuantSpec("ec", (_t("t0", 2, 8, "int2", ("f0",), "rw"), _t("t1", 6, 8, "int8", ("f1",), "tw:0")), 3,
                  (((1, 0), (1,)), ((5,), ())), None, output_dtype="bfloat16", seed=4),
        QuantSpec("ec", (_t("t0", 3, 4, "fp16", ("f0",), "tw:0"),), 1, (((2, 0, 2), ()),), None, output_dtype="float16",
                  seed=6, sharded=False),
    ),
}
