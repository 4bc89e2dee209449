"""Optimizers named once, for the sharded model (torchrec's fused TBE optimizers, set through
``apply_optimizer_in_backward``, and torch optimizers for dense parameters) and for the unsharded
reference (torch's optimizer where fbgemm's rule is torch's, else a reference of fbgemm's rule).

- ``spec``: ``OptimizerSpec``; ``validation``: a spec checked as an embedding or a dense optimizer;
- ``catalog``: every optimizer by name, with the hyper-parameters fbgemm's kernel reads;
- ``fbgemm``: what torchrec is given for a spec, and which fused optimizers the installed fbgemm trains;
- ``references``: fbgemm's row-wise optimizers written out (per column shard, sparse, with fbgemm's counter);
- ``oracle``: the reference optimizer of a spec and its state in torchrec's names.
"""

from paritykit.harness.optimizers.catalog import DENSE, FUSED, KNOWN
from paritykit.harness.optimizers.fbgemm import apply_in_backward, in_backward_arguments, supported_fused_optimizers
from paritykit.harness.optimizers.references import BlockRowWiseAdagrad, EmaRowWiseAdagrad, RowWiseRMSpropAR
from paritykit.harness.optimizers.spec import OptimizerSpec
from paritykit.harness.optimizers.validation import require_dense_optimizer, require_embedding_optimizer

EMBEDDING_OPTIMIZERS = tuple(FUSED)
DENSE_OPTIMIZERS = tuple(DENSE)

__all__ = [
    "BlockRowWiseAdagrad",
    "DENSE",
    "DENSE_OPTIMIZERS",
    "EMBEDDING_OPTIMIZERS",
    "EmaRowWiseAdagrad",
    "FUSED",
    "KNOWN",
    "OptimizerSpec",
    "RowWiseRMSpropAR",
    "apply_in_backward",
    "in_backward_arguments",
    "require_dense_optimizer",
    "require_embedding_optimizer",
    "supported_fused_optimizers",
]
