"""Fan-out: the next lines of a batch into the model's bulk stream as jobs (a group of
embedding lines as one job: producer_api.batches.groups), as far as the stream's backlog and
the batch's in-flight cap leave room. Lines the model's workers would refuse go to the error
file instead; every line enqueued is recorded with its job in one MULTI with the new resume
point, so a run killed at any moment and run again enqueues nothing twice."""

from __future__ import annotations

from datetime import UTC, datetime

from redis.asyncio import Redis

from producer_api import queue
from producer_api.batches.enqueue_all import enqueue_all
from producer_api.batches.files import FileStore
from producer_api.batches.groups import LineGroup, carried_lines, group_request, groups_of
from producer_api.batches.input_lines import InputLines
from producer_api.batches.lines import ParsedLine, batch_job_request, line_not_run, prompt_param
from producer_api.batches.settings import BatchControllerSettings
from producer_api.batches.store import BatchStore
from producer_api.errors import ApiError
from producer_api.lora import on_base_model
from producer_api.prompt_check import PromptLimits, check_prompt, prompt_limits
from producer_api.prompt_tokens import TokenizerCache
from producer_api.workers import ServedModel, WorkerDirectory
from redis_io.clients import pipeline
from schemas import BatchField, JobRequest, RedisKeys


class BatchRun:
    """What one controller run knows of its batch: the input, the lines out as jobs, and where
    fan-out stands. The run's phases (producer_api.batches.fan_out, .collect, .runner) build
    on it."""

    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        settings: BatchControllerSettings,
        batch_id: str,
        tokenizers: TokenizerCache | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.batch_id = batch_id
        self.store = BatchStore(redis, keys)
        self.workers = WorkerDirectory(redis, keys)
        self.tokenizers = tokenizers or TokenizerCache()
        self.files = FileStore(redis, keys)
        self.outstanding: dict[int, str] = {}  # line number -> job id, not yet collected
        self.lines_of: dict[str, list[int]] = {}  # job id -> its line numbers, outstanding jobs
        self.group_lines = 1  # embedding lines per job, as the batch fixed it
        self._next_sweep = 0.0  # monotonic time every outstanding job's status is read next
        self.owner: str | None = None  # the batch's owner, whose jobs these are
        self.expires_at = 0  # unix seconds: the batch's deadline
        self.input = InputLines([], "", settings.default_max_tokens)
        self.submitted = 0  # valid lines fanned out (an index into `input.valid`)


class FanOut(BatchRun):
    """Fan-out of a controller run (see the module's docstring)."""

    async def _fan_out(self) -> bool:
        """Enqueue the next chunk of lines, as far as the backlog and in-flight caps leave room;
        False when there was none (or no line left)."""
        valid = self.input.valid
        if self.submitted >= len(valid):
            return False
        room = min(
            self.settings.batch_chunk_lines,
            self.settings.batch_max_in_flight - len(self.outstanding),
        )
        if room <= 0:
            return False
        first = self.input.line(valid[self.submitted])
        assert first.request is not None
        backlog = await queue.queue_length(self.redis, self.keys, first.request.model, bulk=True)
        room = min(room, (self.settings.batch_max_backlog - backlog) * self.group_lines)
        if room <= 0:
            return False
        end = self._chunk_end(room)
        if end == self.submitted:
            return False
        chunk = [first, *map(self.input.line, valid[self.submitted + 1 : end])]
        served = await self.workers.models()
        refused = await self._refusals(chunk, served)
        runnable = [line for line in chunk if line.number not in refused]
        on_base = self._on_base_models(runnable, refused, served)
        if self.group_lines > 1:
            groups = list(groups_of(chunk, self.submitted, self.group_lines, set(on_base)))
        else:
            groups = [LineGroup.alone(line) for line in runnable if line.number in on_base]
        enqueued = await self._enqueue(groups, on_base, refused, {ln.number for ln in chunk})
        async with pipeline(self.redis, atomic=True) as pipe:
            if enqueued:
                pipe.hset(self.keys.batch_lines(self.batch_id), mapping=enqueued)
            if refused:
                pipe.hset(self.keys.batch_errors(self.batch_id), mapping=refused)
            pipe.hset(self.keys.batch(self.batch_id), BatchField.SUBMITTED, end)
            await pipe.execute()
        self.submitted = end
        for line in chunk:  # kept while in flight; a line refused is done with
            if line.number in enqueued:
                self.input.parsed[line.number] = line
            else:
                self.input.parsed.pop(line.number, None)
        self._track(enqueued)
        return True

    def _chunk_end(self, room: int) -> int:
        """Where a chunk of up to `room` lines from `submitted` ends: at a group's end, so a
        group is never split between fan-out rounds. A group larger than the room waits for
        the lines in flight to end (then goes alone, past the room: never a deadlock)."""
        valid, size = len(self.input.valid), self.group_lines
        end = min(self.submitted + room, valid)
        if size == 1 or end == valid:
            return end
        aligned = end - end % size
        if aligned > self.submitted:
            return aligned
        if self.outstanding:
            return self.submitted
        return min(self.submitted - self.submitted % size + size, valid)

    def _track(self, enqueued: dict[int, str]) -> None:
        """Note lines now out as the jobs `enqueued` names (line number -> job id)."""
        self.outstanding.update(enqueued)
        for number, job_id in sorted(enqueued.items()):
            self.lines_of.setdefault(job_id, []).append(number)

    async def _enqueue(
        self,
        groups: list[LineGroup],
        requests: dict[int, JobRequest],
        refused: dict[int, str],
        ours: set[int],
    ) -> dict[int, str]:
        """Enqueue each group as one job (a single line: the line's own job); the job
        of each line (line number -> job id). A group's job enqueued by an earlier run is what
        it names: it carries the lines it names (whatever this run refused), and lines of the
        group it does not carry run one job each. Lines refused at enqueue join `refused`."""
        deadline = datetime.fromtimestamp(self.expires_at, UTC)
        enqueued: dict[int, str] = {}
        while groups:
            calls = [self._group_request(g, requests, deadline) for g in groups]
            results = await enqueue_all(
                self.redis,
                self.keys,
                calls,
                owner=self.owner,
                replicas=self.settings.replica_wait(),
            )
            leftovers: list[LineGroup] = []
            for group, result in zip(groups, results, strict=True):
                if isinstance(result, queue.QueueError):
                    code, message = result.code.value, result.error.message
                    refused.update(
                        (ln.number, line_not_run(ln, code, message)) for ln in group.lines
                    )
                elif isinstance(result, BaseException):
                    raise result  # Redis trouble: arq retries the run; enqueued lines dedupe
                else:
                    carried = carried_lines(result)
                    if carried is None:
                        enqueued[group.lines[0].number] = result.id
                        continue
                    for number in carried:
                        if number in ours:
                            enqueued[number] = result.id
                            refused.pop(number, None)
                    leftovers += [
                        LineGroup.alone(ln) for ln in group.lines if ln.number not in enqueued
                    ]
            groups = leftovers
        return enqueued

    def _group_request(
        self, group: LineGroup, requests: dict[int, JobRequest], deadline: datetime
    ) -> JobRequest:
        """The job of a group: several lines' inputs in one embedding job, or one line's job
        (the single-line path: a batch of generation lines, or a group's line run alone)."""
        if group.single:
            line = group.lines[0]
            return batch_job_request(
                requests[line.number], batch_id=self.batch_id, line=line, deadline=deadline
            )
        return group_request(
            group,
            [requests[line.number] for line in group.lines],
            batch_id=self.batch_id,
            deadline=deadline,
        )

    def _on_base_models(
        self, lines: list[ParsedLine], refused: dict[int, str], served: dict[str, ServedModel]
    ) -> dict[int, JobRequest]:
        """Each line's job request as queued: a LoRA adapter's runs on its base model
        (producer_api.lora); a line naming an adapter no live worker serves joins `refused`."""
        out: dict[int, JobRequest] = {}
        for line in lines:
            assert line.request is not None
            try:
                out[line.number] = on_base_model(line.request, served, "body.model")
            except ApiError as exc:
                refused[line.number] = line_not_run(line, exc.error.code.value, exc.error.message)
        return out

    async def _refusals(
        self, lines: list[ParsedLine], served: dict[str, ServedModel]
    ) -> dict[int, str]:
        """Error lines of the lines whose prompt the model's workers (`served`) would refuse (a
        token id outside its vocabulary, too long for its context): they are never queued."""
        limits: dict[str, PromptLimits] = {}
        refused: dict[int, str] = {}
        for line in lines:
            request = line.request
            assert request is not None
            model = served.get(request.model)
            if request.model not in limits:
                context = model.max_model_len if model is not None else None
                limits[request.model] = await prompt_limits(model, context, self.tokenizers)
            try:
                await check_prompt(
                    request, limits[request.model], prompt_param(line), sampling_prefix="body."
                )
            except ApiError as exc:
                refused[line.number] = line_not_run(line, exc.error.code.value, exc.error.message)
        return refused
