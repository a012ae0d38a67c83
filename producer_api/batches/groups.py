"""Embedding lines packed into jobs of several inputs, one input per line: a queue job costs
the controller, Redis and the worker about the same whether it embeds one text or sixty-four,
so a batch of embedding lines runs as few jobs as it can.

Groups are fixed by the valid lines' order, so a run killed at any moment and run again forms
the same groups: the valid lines split into slots of `group_lines` (by their index among the
valid lines), a slot into runs of consecutive lines with the same model and pooling options.
Each run is one job (its runnable lines' inputs, in order), keyed `{batch_id}:g{first line of
the run}`, and the job names the lines it carries (`BATCH_LINES_METADATA`): whoever collects it
writes each of those lines from its own input's vector, whatever grouping it made itself."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

from producer_api.batches.lines import ParsedLine
from producer_api.openai_embeddings import EmbeddingRequest, vectors_body
from schemas import PRIORITY_BULK, Job, JobRequest, JobStatus
from schemas.batches import (
    BATCH_ID_METADATA,
    BATCH_LINES_METADATA,
    format_line_numbers,
    output_line,
    parse_line_numbers,
)
from schemas.jobs import EmbeddingInput
from schemas.pooling import PoolingParams


@dataclass
class LineGroup:
    """One run of a slot: the line naming its key, and its lines that may run, in order; or
    (`single`) one line that runs as its own job, keyed by its line alone."""

    key_line: int
    lines: list[ParsedLine]
    single: bool = False

    @classmethod
    def alone(cls, line: ParsedLine) -> LineGroup:
        return cls(line.number, [line], single=True)


def groups_of(
    chunk: list[ParsedLine], first_index: int, group_lines: int, runnable: set[int]
) -> Iterator[LineGroup]:
    """The groups of `chunk` (valid lines, the first the `first_index`-th valid line): runs
    of consecutive lines of one model and pooling inside each slot of `group_lines`, cut by
    the lines' content alone; each with those of its lines in `runnable` (none: skipped)."""
    run: list[ParsedLine] = []
    run_slot = -1
    for index, line in enumerate(chunk, start=first_index):
        slot = index // group_lines
        if run and (slot != run_slot or _kind(line) != _kind(run[0])):
            yield from _runnable(run, runnable)
            run = []
        run_slot = slot
        run.append(line)
    yield from _runnable(run, runnable)


def _runnable(run: list[ParsedLine], runnable: set[int]) -> Iterator[LineGroup]:
    lines = [line for line in run if line.number in runnable]
    if lines:
        yield LineGroup(run[0].number, lines)


def _kind(line: ParsedLine) -> tuple[str, PoolingParams | None]:
    assert line.request is not None
    return line.request.model, line.request.pooling


def group_request(
    group: LineGroup, requests: list[JobRequest], *, batch_id: str, deadline: datetime
) -> JobRequest:
    """The job of a group whose lines' job requests are `requests` (one input each): bulk
    priority, the batch's deadline, an idempotency key per group, and the lines it carries."""
    first = requests[0]
    return JobRequest(
        model=first.model,
        inputs=[_input(request) for request in requests],
        pooling=first.pooling,
        priority=max(first.priority, PRIORITY_BULK),
        deadline=deadline,
        idempotency_key=f"{batch_id}:g{group.key_line}",
        metadata={
            BATCH_ID_METADATA: batch_id,
            BATCH_LINES_METADATA: format_line_numbers([line.number for line in group.lines]),
        },
    )


def _input(request: JobRequest) -> EmbeddingInput:
    if request.prompt is not None:
        return request.prompt
    assert request.prompt_token_ids is not None
    return request.prompt_token_ids


def carried_lines(job: Job) -> list[int] | None:
    """The batch lines a group's job carries, in input order; None for a job of one line
    (or lines it does not name readably, which its collector then treats as its own)."""
    text = job.request.metadata.get(BATCH_LINES_METADATA)
    if text is None:
        return None
    try:
        numbers = parse_line_numbers(text)
    except ValueError:
        return None
    if len(numbers) != job.request.input_count:
        return None
    return numbers


def group_output_lines(lines: list[ParsedLine], job: Job) -> list[str] | None:
    """Each line's output line, from its own input's vector and token count, when the job
    succeeded with one vector per line; None otherwise."""
    result = job.result
    if job.status is not JobStatus.SUCCEEDED or result is None:
        return None
    vectors, tokens = result.embeddings, result.input_tokens
    if vectors is None or tokens is None or len(vectors) != len(lines):
        return None
    out = []
    for index, (line, vector, count) in enumerate(zip(lines, vectors, tokens, strict=True)):
        assert line.custom_id is not None and isinstance(line.openai, EmbeddingRequest)
        body = vectors_body(line.openai, [vector], count)
        out.append(output_line(line.custom_id, job.id, body, index))
    return out
