"""Asynchronous scheduling: the host schedules step N+1 while the device runs step N.

A step runs on a device thread (on CUDA its kernels, on the CPU the whole forward). Once it is
launched, the host updates the scheduler as if the step's sampled tokens were known: each
sampling sequence gets a placeholder token, so the next schedule gives it its decode slot, and
the next step's input id at that position is filled in on the device thread from the previous
step's sampled ids. Only then does the host wait for step N's tokens and process them (stop
checks, stop strings, detokenizing), while the device already runs step N+1. A sequence that
stops at step N wasted its row of step N+1; the row's result is dropped.

Rows whose next step needs their sampled token on the host make a step synchronous: beams
(logits rows), grammars and other logits processors, penalties (they read the output), drafts,
prompt logprobs, and a request whose choices are not forked yet (n > 1 forks after the first
token). Such a step is resolved before the next one is scheduled, exactly as the synchronous
engine does. A sequence whose next token surely ends it by length gets no placeholder, so it is
never scheduled past its end.

The device thread works on copies of the scheduled sequences, taken at launch, so the host may
change the originals while the step runs; the copies share each sequence's sampler state (its
seeded generator), which only the device thread touches while steps run. The runner's own
`.tolist()` of the picked tokens happens there too: the host thread only waits for a step's
tokens after it launched the next one. On CUDA every step goes through one stream, so the
next step's input fill, block copies and forward run after the previous step's.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta
from engine.runner_io import ModelRunnerOutput, RowMode, SamplingBatch, SamplingRow
from engine.sampling.penalties import uses_penalties
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence
from engine.step_inputs import StepInputs
from engine.stop import StopRules

PLACEHOLDER_TOKEN_ID = -1  # stands for a sampled token the host has not read yet


@dataclass
class _Fill:
    """Input ids of a step that are the previous step's sampled tokens: flat input positions
    and the previous step's pick rows holding them."""

    positions: list[int] = field(default_factory=list)
    pick_rows: list[int] = field(default_factory=list)


@dataclass
class _Step:
    sched: SchedulerOutput
    batch: SamplingBatch
    future: Future[ModelRunnerOutput]
    resolves_late: bool  # every sampling row may be read after the next step is scheduled
    pick_rows: dict[Sequence, int] = field(default_factory=dict)  # seq -> row of its pick
    placeholders: list[Sequence] = field(default_factory=list)


class AsyncScheduling:
    """Drives the scheduler, runner and output processor one step ahead of the host."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        outputs: OutputProcessor,
        stop_rules: StopRules,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.stop_rules = stop_rules
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inferq-device")
        self._in_flight: _Step | None = None
        # The last finished step's first picked token per pick row: read and written only on
        # the device thread (or the host while nothing runs there).
        self._last_sampled: torch.Tensor | None = None
        # Over the engine's life: steps left running while the host went on, and steps the
        # host waited for (their rows needed it).
        self.num_overlapped_steps = 0
        self.num_synchronous_steps = 0

    @property
    def busy(self) -> bool:
        """A launched step's outputs are still to be taken (one more step() gives them)."""
        return self._in_flight is not None

    def close(self) -> None:
        self._device.shutdown(wait=True)

    def step(self) -> list[RequestDelta]:
        """Schedule and launch the next step, then return the previous step's deltas."""
        previous, self._in_flight = self._in_flight, None
        deltas: list[RequestDelta] = []
        if previous is not None and not previous.resolves_late:
            deltas += self._resolve(previous)
            previous = None
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return deltas + (self._resolve(previous) if previous is not None else [])
        batch = self.outputs.plan(sched)
        inputs = self.runner.prepare_inputs(sched.scheduled)
        fill = _placeholder_fill(sched.scheduled, previous)
        late = all(self._may_resolve_late(entry) for entry in sched.scheduled)
        if not late and previous is not None:
            # This step's rows need the host's view of each sequence: take the previous
            # step's tokens first (the device is then idle), as the synchronous engine does.
            deltas += self._resolve(previous)
            previous = None
        current = self._launch(sched, batch, inputs, fill, late)
        if previous is not None:
            deltas += self._resolve(previous)
        self.scheduler.update_after_step(sched)
        if late:
            self.num_overlapped_steps += 1
            self._hold_places(current)
            self._in_flight = current
        else:
            self.num_synchronous_steps += 1
            deltas += self._resolve(current)
        return deltas

    # ------------------------------------------------------------------ launching

    def _launch(
        self,
        sched: SchedulerOutput,
        batch: SamplingBatch,
        inputs: StepInputs,
        fill: _Fill,
        late: bool,
    ) -> _Step:
        pick_rows = {
            row.entry.seq: index
            for index, row in enumerate(r for r in batch.rows if r.mode is not RowMode.LOGITS)
        }
        if late:
            detached_sched, detached_batch, originals = _detached(sched, batch)
            future = self._device.submit(
                self._run, detached_sched, detached_batch, inputs, fill, originals
            )
        else:  # nothing runs on the device thread now: run it here
            future = Future()
            future.set_result(self._run(sched, batch, inputs, fill, None))
        return _Step(sched, batch, future, late, pick_rows)

    def _may_resolve_late(self, entry: ScheduledSeq) -> bool:
        seq = entry.seq
        if seq.params.prompt_logprobs is not None:
            return False
        if not entry.samples:
            return True
        request = self.outputs.requests.get(seq.request_id)
        return (
            request is not None
            and request.forked
            and request.beam is None
            and not entry.draft_token_ids
            and not uses_penalties(seq)
            and not any(processor.applies_to(seq) for processor in self.outputs.processors)
        )

    def _run(
        self,
        sched: SchedulerOutput,
        batch: SamplingBatch,
        inputs: StepInputs,
        fill: _Fill,
        originals: dict[int, ScheduledSeq] | None,
    ) -> ModelRunnerOutput:
        """On the device thread: the previous step's tokens into the inputs, the step, and this
        step's tokens kept for the next one."""
        if fill.positions:
            assert self._last_sampled is not None
            device = inputs.input_ids.device
            positions = torch.tensor(fill.positions, dtype=torch.long, device=device)
            rows = torch.tensor(fill.pick_rows, dtype=torch.long, device=device)
            inputs.input_ids.index_copy_(0, positions, self._last_sampled.to(device)[rows])
        out = self.runner.execute(sched, batch, inputs)
        self._last_sampled = torch.tensor(
            [pick.token_ids[0] for _, pick in out.picks], dtype=torch.long
        )
        return out if originals is None else _reattached(out, originals)

    def _hold_places(self, step: _Step) -> None:
        """Give each sampling sequence of a launched step a placeholder for its token, unless
        that token surely ends it (by length): then it is not scheduled again."""
        max_model_len = self.stop_rules.max_model_len
        for row in step.batch.rows:
            seq = row.entry.seq
            if seq.is_finished or row.mode is RowMode.LOGITS:
                continue
            if (
                seq.num_output_tokens + 1 >= seq.params.max_tokens
                or seq.num_tokens + 1 >= max_model_len
            ):
                continue
            seq.append_token(PLACEHOLDER_TOKEN_ID)
            step.placeholders.append(seq)

    # ------------------------------------------------------------------ resolving

    def _resolve(self, step: _Step) -> list[RequestDelta]:
        """Wait for a step's tokens, put them where its placeholders were, and process them."""
        out = step.future.result()
        for seq in step.placeholders:
            assert seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID
            seq.token_ids.pop()
        live = ModelRunnerOutput(
            picks=[(e, p) for e, p in out.picks if self._is_live(e.seq)],
            logits=[(e, rows) for e, rows in out.logits if self._is_live(e.seq)],
            prompt_logprobs=out.prompt_logprobs,
        )
        return self.outputs.process(step.sched, live)

    def _is_live(self, seq: Sequence) -> bool:
        """Not finished (by an earlier token, a stop string, an abort) since it was scheduled."""
        return not seq.is_finished and seq.request_id in self.outputs.requests


def _placeholder_fill(scheduled: list[ScheduledSeq], previous: _Step | None) -> _Fill:
    fill = _Fill()
    if previous is None:
        return fill
    held = set(previous.placeholders)
    offset = 0
    for entry in scheduled:
        seq = entry.seq
        if seq in held:
            index = seq.num_tokens - 1 - seq.num_computed_tokens
            if 0 <= index < entry.num_new_tokens - len(entry.draft_token_ids):
                fill.positions.append(offset + index)
                fill.pick_rows.append(previous.pick_rows[seq])
        offset += entry.num_new_tokens
    return fill


def _detached(
    sched: SchedulerOutput, batch: SamplingBatch
) -> tuple[SchedulerOutput, SamplingBatch, dict[int, ScheduledSeq]]:
    """Copies of a step's entries and sequences for the device thread (sharing sampler
    state), and the originals by the copies' ids."""
    copies: dict[int, ScheduledSeq] = {}
    originals: dict[int, ScheduledSeq] = {}
    for entry in sched.scheduled:
        seq = copy.copy(entry.seq)
        seq.token_ids = list(seq.token_ids)
        detached = copy.copy(entry)
        detached.seq = seq
        copies[id(entry)] = detached
        originals[id(detached)] = entry
    detached_sched = SchedulerOutput(
        scheduled=[copies[id(e)] for e in sched.scheduled],
        block_copies=list(sched.block_copies),
        num_batched_tokens=sched.num_batched_tokens,
    )
    rows = [SamplingRow(copies[id(row.entry)], row.mode) for row in batch.rows]
    return detached_sched, SamplingBatch(rows, batch.processors), originals


def _reattached(out: ModelRunnerOutput, originals: dict[int, ScheduledSeq]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        picks=[(originals[id(e)], p) for e, p in out.picks],
        logits=[(originals[id(e)], rows) for e, rows in out.logits],
        prompt_logprobs=[(originals[id(e)], c) for e, c in out.prompt_logprobs],
    )
