"""``TrainPipelinePT2``'s compile step, on a dense model in the caller: the pipeline runs the model
eagerly until ``compile_on_iter``, then calls ``pre_compile_fn``, compiles the model in place
(``nn.Module.compile`` with the configured backend) and calls ``post_compile_fn`` before that
iteration's forward. The oracle: each hook called once, at that iteration, pre before post; dynamo
compiling its first graph in that iteration (a backend that records when it is asked, then runs
the graph as traced, as dynamo's ``eager`` backend does); and
every step's prediction (what ``progress`` returns) and the final weights those of the plain loop (zero_grad, forward,
backward, step) over the same batches, bit for bit (the traced graph runs the same operations). On the sharded models dynamo cannot compile torchrec's modules on CPU
(docs/pipeline.md), so the gate's sharded runs keep the eager path.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from paritykit.errors import ParityError

CASE_ID = "dense/pt2-compile-schedule"
COMPILE_ON_ITER = 2
STEPS = 5
# What TrainPipelinePT2 sets in dynamo's global config when it compiles: restored afterwards.
DYNAMO_FLAGS = ("capture_scalar_outputs", "capture_dynamic_output_shape_ops",
                "force_unspec_int_unbacked_size_like_on_torchrec_kjt", "skip_torchrec")


def _batch_type() -> type:
    from torchrec.streamable import Pipelineable

    class DenseBatch(Pipelineable):
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

        def to(self, device: torch.device, non_blocking: bool = False) -> "DenseBatch":
            return DenseBatch(self.x.to(device, non_blocking=non_blocking), self.y.to(device, non_blocking=non_blocking))

        def record_stream(self, stream: Any) -> None:
            pass

    return DenseBatch


class _Regression(torch.nn.Module):
    """(loss, prediction), the pipelines' model contract."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        prediction = self.out(torch.relu(self.hidden(batch.x))).squeeze(-1)
        return ((prediction - batch.y) ** 2).mean(), prediction


def run_pt2_compile_case(seed: int = 0) -> dict[str, Any]:
    import torch._dynamo
    from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig, TrainPipelinePT2

    generator = torch.Generator().manual_seed(seed)
    batch_type = _batch_type()
    batches = [batch_type(torch.randn(6, 4, generator=generator), torch.randn(6, generator=generator)) for _ in range(STEPS)]
    torch.manual_seed(seed)
    plain_model = _Regression()
    piped_model = copy.deepcopy(plain_model)

    plain_optimizer = torch.optim.SGD(plain_model.parameters(), lr=0.05)
    expected = []
    for batch in batches:
        plain_optimizer.zero_grad()
        loss, prediction = plain_model(batch)
        loss.backward()
        plain_optimizer.step()
        expected.append(prediction.detach())

    done, calls, graphs = [0], [], []

    def recording(graph: Any, example_inputs: Any) -> Any:
        graphs.append(done[0])
        return graph.forward

    saved = {flag: getattr(torch._dynamo.config, flag) for flag in DYNAMO_FLAGS if hasattr(torch._dynamo.config, flag)}
    try:
        pipeline = TrainPipelinePT2(piped_model, torch.optim.SGD(piped_model.parameters(), lr=0.05), torch.device("cpu"),
                                    compile_configs=TorchCompileConfig(compile_on_iter=COMPILE_ON_ITER, backend=recording),
                                    pre_compile_fn=lambda model: calls.append(("pre_compile_fn", done[0])),
                                    post_compile_fn=lambda model: calls.append(("post_compile_fn", done[0])))
        data, got = iter(batches), []
        for _ in range(STEPS):
            got.append(pipeline.progress(data).detach())
            done[0] += 1
    finally:
        for flag, value in saved.items():
            setattr(torch._dynamo.config, flag, value)
    wanted = [("pre_compile_fn", COMPILE_ON_ITER), ("post_compile_fn", COMPILE_ON_ITER)]
    if calls != wanted:
        raise ParityError(f"{CASE_ID}: TrainPipelinePT2(compile_on_iter={COMPILE_ON_ITER}) called its hooks as {calls} "
                          f"(hook, steps done before it); expected {wanted}")
    if graphs[:1] != [COMPILE_ON_ITER]:
        raise ParityError(f"{CASE_ID}: dynamo compiled graphs after steps {graphs}; TrainPipelinePT2(compile_on_iter="
                          f"{COMPILE_ON_ITER}) is to compile the model in that step")
    for step, (prediction, want) in enumerate(zip(got, expected)):
        if not torch.equal(prediction, want):
            raise ParityError(f"{CASE_ID}: step {step} ({'compiled' if step >= COMPILE_ON_ITER else 'eager'}): prediction "
                              f"{prediction.tolist()} vs the plain loop's {want.tolist()}")
    for (name, param), want in zip(piped_model.named_parameters(), plain_model.parameters()):
        if not torch.equal(param.detach(), want.detach()):
            raise ParityError(f"{CASE_ID}: after {STEPS} steps {name} differs from the plain loop's")
    return {"steps": STEPS, "compiled_at": COMPILE_ON_ITER, "graphs": len(graphs)}
