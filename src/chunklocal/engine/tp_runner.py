"""The two halves of a tensor-parallel step.

The caller's process (the engine core's loop thread) runs :class:`RemoteRunner`, whose
:class:`~chunklocal.engine.input_builder.InputBuilder` prepares the step's inputs, block
tables and slot mappings once; it sends the same :class:`DeviceStep` to every rank
(engine/workers.py).  Every rank runs :func:`execute`: the forward over its slice of the
model and the logits (a collective); rank 0 then samples with its own
:class:`~chunklocal.engine.sampler.Sampler` (seeded with the engine's seed, on cuda:0 as
with one rank), so temperature, top-k/p, min-p, penalties, logprobs and seeds behave as
with one rank.  A seeded request's generator state travels with the step (host ->
rank 0 -> host), so it lives as long as its request, wherever the request is scheduled.

Not supported: ``async_scheduling`` (launch with a ``prev`` step): the ranks run one
step at a time, the LLM refuses the flag under N > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunklocal.engine.input_builder import InputBuilder, StepInputs
from chunklocal.engine.model_runner import LaunchedStep, ModelRunner, StepRunner
from chunklocal.engine.sampler import FREQ, PRES, REP, SEEDED, SampleResult, to_device


@dataclass
class SeqView:
    """What rank 0's Sampler reads of one request (picklable)."""

    sampling_row: np.ndarray
    token_ids: list             # prompt + output, only when the request is penalised
    num_prompt_tokens: int
    seed: int | None
    generator: object = None    # host: a generator state (ByteTensor); rank 0: a Generator

    @property
    def params(self):  # request_generator reads seq.params.seed
        return self


def seq_view(seq) -> SeqView:
    row = seq.sampling_row
    penalised = row[REP] != 1 or row[PRES] != 0 or row[FREQ] != 0
    seeded = row[SEEDED] > 0
    return SeqView(row, list(seq.token_ids) if penalised else [], seq.num_prompt_tokens,
                   seq.params.seed if seeded else None, seq.generator if seeded else None)


@dataclass
class DeviceStep:
    """Everything a rank needs to run one step: numpy only (the ranks get it pickled).
    Attention metadata is not in it: each rank builds its own."""

    inputs: StepInputs
    tables: list            # [N, W] int32 block table per KV group
    slots: list             # [T] int64 flat cache row of each token, per KV group
    seqs: list              # SeqView per request
    capture_rows: np.ndarray | None  # token rows whose float32 logits execute() returns


@dataclass
class StepResult:
    """Rank 0's answer to one step."""

    sample: SampleResult
    logits: torch.Tensor | None     # float32 CPU logits of capture_rows
    graph_steps: int
    used_graph: bool
    generator_states: dict          # request index -> its seeded generator's state


@torch.inference_mode()
def execute(runner: ModelRunner, step: DeviceStep, sample: bool) -> StepResult | None:
    """Run ``step`` on this rank; ``sample`` (rank 0): sample and return the result."""
    inputs, dev = step.inputs, runner.device
    slots = [to_device(slot, dev) for slot in step.slots]
    layout = None
    if runner.graphs is not None and not runner.kv_calibration_pending:
        layout = runner.graphs.layout_for(np.diff(inputs.query_start_loc), inputs.num_drafts)
    hidden = runner.forward(inputs, step.tables, slots, to_device(inputs.input_ids, dev),
                            layout)
    logits = None
    if step.capture_rows is not None:
        logits = runner.logits(hidden[to_device(step.capture_rows, dev)]).cpu()
    row_logits = runner.logits(hidden[to_device(inputs.logit_rows, dev)])
    if not sample:
        return None
    for view in step.seqs:  # a seeded request's generator, as its last step left it
        if view.seed is not None and view.generator is not None:
            state = view.generator
            view.generator = torch.Generator(device=dev)
            view.generator.set_state(state)
    result = runner.sampler.launch(row_logits, step.seqs, inputs.logit_owner).result()
    states = {i: view.generator.get_state() for i, view in enumerate(step.seqs)
              if view.seed is not None and view.generator is not None}
    return StepResult(result, logits, runner.graph_steps, layout is not None, states)


class _Sampled:
    """A step's tokens, already on the host (LaunchedStep.sample)."""

    def __init__(self, result: SampleResult):
        self._result = result

    def result(self) -> SampleResult:
        return self._result


class RemoteRunner(StepRunner):
    """A tensor-parallel engine's runner in the caller's process: its InputBuilder prepares
    each step, the ranks run it."""

    def __init__(self, workers, block_manager, chunk_size):
        self.builder = InputBuilder(block_manager, chunk_size)
        self.workers = workers
        self.graph_steps = 0

    def host_step(self, batch) -> DeviceStep:
        host = self.builder.host_step(batch)
        return DeviceStep(host.inputs, host.tables, host.slots,
                          [seq_view(s) for s in batch.seqs], host.capture_rows)

    def launch(self, batch, prev: LaunchedStep | None = None) -> LaunchedStep:
        if prev is not None:
            raise ValueError("async_scheduling is not supported with tensor parallelism")
        step = self.host_step(batch)
        out = self.execute(step)
        if out.logits is not None:
            self.builder.store_captured(batch.seqs, step.inputs, step.capture_rows,
                                        out.logits)
        for i, state in out.generator_states.items():
            batch.seqs[i].generator = state
        bounds = step.inputs.row_bounds()
        return LaunchedStep(batch, _Sampled(out.sample), bounds, out.used_graph)

    def execute(self, step: DeviceStep) -> StepResult:
        out = self.workers.step(step)
        self.graph_steps = out.graph_steps
        return out


def run_device_step(runner: ModelRunner, step: DeviceStep) -> StepResult:
    """Run a hand-made step on any engine's runner (one rank or N; benchmarks)."""
    if isinstance(runner, RemoteRunner):
        return runner.execute(step)
    return execute(runner, step, sample=True)


def greedy_views(count: int) -> list[SeqView]:
    from chunklocal.engine.sampler import sampling_row
    from chunklocal.engine.sampling import SamplingParams

    row = sampling_row(SamplingParams(temperature=0.0))
    return [SeqView(row, [], 1, None) for _ in range(count)]
