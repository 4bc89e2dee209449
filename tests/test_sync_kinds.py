"""One vocabulary of sync kinds for both backends: how the CUDA backend names a sync from its source
line (pure Python, tested on CPU), and that every kind either backend reports is in
paritykit.sync.kinds."""

from __future__ import annotations

import pytest
import torch

from paritykit.sync import count_syncs, kinds
from paritykit.sync.cuda import TORCHREC_COPY_HELPER, classify_source_line, classify_sync

SOURCE_LINES = [
    ("    n = x.sum().item()", kinds.ITEM),
    ("    return _cuda_to_cpu_safe(tensor).tolist()", kinds.TOLIST),
    ("    host = x.cpu()", kinds.D2H_COPY),
    ("    indices_tensor = torch.tensor(", kinds.H2D_COPY),
    ("    return tensor.to(device=device)", kinds.H2D_COPY),
    ("        output = torch.ops.fbgemm.keyed_jagged_index_select_dim1(", kinds.DATA_DEPENDENT),
    ("    idx = torch.nonzero(mask)", kinds.DATA_DEPENDENT),
    ("    torch.cuda.current_stream(src.device).synchronize()", kinds.STREAM_SYNC),
    ("    if (ids >= n).any():", kinds.SCALAR),
    ("    y = f(x)", kinds.UNCLASSIFIED),
]


@pytest.mark.parametrize("line,kind", SOURCE_LINES, ids=[k + ":" + l.strip()[:30] for l, k in SOURCE_LINES])
def test_classify_source_line_names_the_kind_of_the_call_on_the_line(line, kind):
    assert classify_source_line(line) == kind


def test_sync_inside_torchrecs_copy_helper_is_named_for_what_its_caller_does_with_the_copy():
    stream_sync = "    torch.cuda.current_stream(src.device).synchronize()"
    # _safe_tolist and _safe_tolist_2d: `_cuda_to_cpu_safe(tensor).tolist()`, as the CPU proxy names it.
    assert classify_sync(stream_sync, TORCHREC_COPY_HELPER, "    return _cuda_to_cpu_safe(tensor).tolist()") == kinds.TOLIST
    # A caller that keeps the host tensor made a device->host copy.
    assert classify_sync(stream_sync, TORCHREC_COPY_HELPER, "    cpu_lengths = _cuda_to_cpu_safe(lengths)") == kinds.D2H_COPY
    # The same stream synchronize anywhere else is a stream sync.
    assert classify_sync(stream_sync, "wait_for_batch", "    x = wait_for_batch(batch)") == kinds.STREAM_SYNC


def test_every_kind_the_cuda_classifier_can_return_is_in_the_shared_vocabulary():
    returned = {kind for _line, kind in SOURCE_LINES}
    assert returned <= set(kinds.ALL)
    assert set(kinds.ALL) - returned == {kinds.NUMPY}  # the only kind left out of the lines above
    assert classify_source_line("    a = x.numpy()") == kinds.NUMPY


def test_every_kind_the_cpu_proxy_reports_is_in_the_shared_vocabulary():
    x = torch.tensor([0, 2, 1])
    with count_syncs(backend="cpu") as record:
        x[0].item()
        x.tolist()
        bool(x[0])
        x.numpy()
        x.cpu()
        torch.nonzero(x)
        torch.tensor([1, 2], device=torch.device("cpu"))
    assert set(record.by_kind) <= set(kinds.ALL)
    assert len(record.by_kind) == 7
