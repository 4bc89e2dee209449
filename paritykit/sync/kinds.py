"""The one vocabulary of sync kinds, shared by the CPU proxy and the CUDA backend.

``SyncRecord.by_kind`` uses these names on either backend, so a budget's breakdown reads the same
on CPU CI and on a GPU runner.
"""

ITEM = "item"  # Tensor.item()
TOLIST = "tolist"  # Tensor.tolist()
SCALAR = "scalar"  # bool/int/float/index of a tensor, torch.equal/allclose
NUMPY = "numpy"  # Tensor.numpy()
D2H_COPY = "d2h-copy"  # a blocking device->host copy (.cpu(), copy_ into a host tensor)
H2D_COPY = "h2d-copy"  # a blocking host->device copy (.to(device), torch.tensor(data, device=...))
DATA_DEPENDENT = "data-dependent"  # an op whose output size needs the data (nonzero, unique, ...)
STREAM_SYNC = "stream-sync"  # an explicit stream/device/event synchronize (CUDA backend only)
UNCLASSIFIED = "unclassified"  # a CUDA sync whose source line names no known operation

ALL = (ITEM, TOLIST, SCALAR, NUMPY, D2H_COPY, H2D_COPY, DATA_DEPENDENT, STREAM_SYNC, UNCLASSIFIED)
