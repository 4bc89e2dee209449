"""inference: quantized embedding modules, unsharded and sharded for inference, against the stored rows.

quant_reference.py   what a quantized table holds and what a lookup of it means (plain torch)
specs.py             a case: tables (weight kind, width, placement), a batch; drawn and pinned
quant_modules.py     the float module, torchrec's quantization of it, and its inference sharding on CPU
cases.py             a case: the quantizer, the unsharded module and the sharded one against the reference
known_broken.py      configurations torchrec gets wrong, run on purpose
matrix.py            the gate entry
plants.py            planted bugs
"""

from paritykit.checks.inference.matrix import NAME, run_matrix
from paritykit.checks.runner import CheckEntry

CHECK = CheckEntry(NAME, plants="paritykit.checks.inference.plants", run=run_matrix,
                   oracle="the quantized tables' stored rows read by hand, pooled or gathered in plain torch")

__all__ = ["CHECK"]
