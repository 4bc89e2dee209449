"""Known torchrec issue staged-pipeline-next-epoch-returns-none (listed for torchrec >=1.8,<1.10).

StagedTrainPipeline handed a new iterator after the last one ran dry does not refill: progress()
returns None (its documented sign that the data is used up) while the new batches enter its stages,
so a training loop that stops at None trains nothing of the next epoch (and its first batches wait in
the stages for a later iterator).

What to do instead: call pipeline.flush_end() before handing it the next epoch's iterator (it refills
from the new iterator), or build a new StagedTrainPipeline per epoch.

The script builds a StagedTrainPipeline of two stages (a copy of the batch, then a function that
doubles it) on CPU streams, and runs two epochs of three batches each the way a training loop does:
`while (batch := pipeline.progress(iterator)) is not None`. The oracle is the data itself: the loop
must receive every batch of both epochs, doubled, in order (integers, compared exactly).
With --control it calls pipeline.flush_end() between the epochs, torchrec's way to refill.

    python this_script.py [--control]   exit 0: the loop got every batch of both epochs, in order
                                        exit 1: it did not (the message says which epoch and what came)
                                        exit 2: the script itself could not run
"""

import sys
import traceback

import torch

EPOCHS = ((1, 2, 3), (4, 5, 6))  # each batch holds a one-element tensor of this value
MAX_CALLS = 20  # a pipeline that never returns None is reported, not waited on


class Batch:
    """A pipelineable batch (torchrec's Pipelineable: record_stream) around one tensor."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def record_stream(self, stream) -> None:
        pass  # a CPU tensor has no device stream to record on


def run(control: bool) -> int:
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage
    from torchrec.distributed.train_pipeline.train_pipelines import StagedTrainPipeline

    # Generic CPU streams: torch.cpu.Stream has no .device, which the pipeline reads.
    stages = [
        PipelineStage("copy", lambda batch: Batch(batch.value.clone()), torch.Stream("cpu")),
        PipelineStage("double", lambda batch: Batch(batch.value * 2), torch.Stream("cpu")),
    ]
    pipeline = StagedTrainPipeline(stages, compute_stream=torch.Stream("cpu"))
    for epoch, values in enumerate(EPOCHS):
        if epoch and control:
            pipeline.flush_end()
        iterator = iter([Batch(torch.tensor([value])) for value in values])
        received = []
        for _ in range(MAX_CALLS):
            try:
                batch = pipeline.progress(iterator)
            except Exception:  # torchrec raising on this use is a defect too; the traceback says where
                print(f"REPRODUCED: epoch {epoch}: progress() raised\n{traceback.format_exc()}")
                return 1
            if batch is None:
                break
            received.append(int(batch.value.item()))
        expected = [2 * value for value in values]
        if received != expected:
            print(f"REPRODUCED: epoch {epoch}: the training loop got batches {received} before progress() returned None; "
                  f"the epoch's data doubled is {expected}")
            return 1
    print(f"OK: the training loop got every batch of {len(EPOCHS)} epochs, in order")
    return 0


def main() -> int:
    try:
        return run(control="--control" in sys.argv[1:])
    except Exception:  # building the pipeline failed: the script cannot show anything
        print(f"CANNOT RUN: {traceback.format_exc()}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
