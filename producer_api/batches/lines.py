"""Batch input lines -> job requests, and finished jobs -> output / error file lines.

A line is `{"custom_id": ..., "method": "POST", "url": <endpoint>, "body": <OpenAI request>}`;
the body goes through the same conversion as the live OpenAI endpoints, so a batch line and a
live call with the same body run the same job. A line that cannot run becomes a `ParsedLine`
with an `error` (never an exception): it lands in the error file with that reason."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from producer_api.errors import ApiError
from producer_api.openai_embeddings import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_job,
    embeddings_body,
)
from producer_api.openai_jobs import (
    chat_job,
    chat_max_tokens,
    check_chat,
    check_completion,
    completion_job,
    completion_prompts,
)
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest
from producer_api.openai_responses import chat_body, completion_body
from schemas import (
    PRIORITY_BULK,
    BatchInputLine,
    ErrorBody,
    ErrorCode,
    Job,
    JobRequest,
    JobStatus,
)
from schemas.batches import BATCH_ID_METADATA, error_line, output_line
from schemas.errors import error_from_validation
from schemas.pooling import PoolingParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_PLACEHOLDER_TIMEOUT_S = 3600.0  # replaced by the batch's own deadline

OpenAIRequest = CompletionRequest | ChatCompletionRequest | EmbeddingRequest


@dataclass
class ParsedLine:
    """One non-blank input line; `request` and `openai` are set exactly when `error` is None."""

    number: int  # 1-based line number in the file
    custom_id: str | None
    request: JobRequest | None = None
    openai: OpenAIRequest | None = None
    error: ErrorBody | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_lines(text: str, endpoint: str | None, default_max_tokens: int) -> list[ParsedLine]:
    """Every non-blank line of an input file, validated (see iter_lines)."""
    return list(iter_lines(text.splitlines(), endpoint, default_max_tokens))


def iter_lines(
    raw_lines: Iterable[str], endpoint: str | None, default_max_tokens: int
) -> Iterator[ParsedLine]:
    """Each non-blank line of an input file (its lines, as `str.splitlines` gives them),
    validated one at a time, so a caller that keeps only what it needs holds one parsed line at
    a time. `endpoint`: the batch's endpoint, which every line's `url` must name (None: each
    line's own url, as at upload time). A repeated custom_id is an error on the later line."""
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        line = parse_line(number, raw, endpoint, default_max_tokens)
        if line.custom_id is not None and line.ok:
            if line.custom_id in seen:
                line = ParsedLine(
                    number,
                    line.custom_id,
                    error=_invalid(f"duplicate custom_id {line.custom_id!r}"),
                )
            seen.add(line.custom_id)
        yield line


def parse_line(number: int, raw: str, endpoint: str | None, default_max_tokens: int) -> ParsedLine:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return ParsedLine(number, None, error=_invalid(f"line {number} is not valid JSON: {exc}"))
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
    try:
        line = BatchInputLine.model_validate(data)
    except ValidationError as exc:
        return ParsedLine(number, custom_id, error=error_from_validation(exc))
    if endpoint is not None and line.url != endpoint:
        return ParsedLine(
            number,
            custom_id,
            error=_invalid(f"url {line.url!r} differs from the batch's {endpoint!r}", "url"),
        )
    try:
        openai, request = line_request(line.url, line.body, default_max_tokens)
    except ApiError as exc:
        return ParsedLine(number, custom_id, error=_with_body_param(exc.error))
    return ParsedLine(number, custom_id, request=request, openai=openai)


def line_request(
    endpoint: str, body: dict[str, Any], default_max_tokens: int
) -> tuple[OpenAIRequest, JobRequest]:
    """The OpenAI request and the job request of one line's body (ApiError when invalid)."""
    try:
        if endpoint == EMBEDDINGS:
            embedding = EmbeddingRequest.model_validate(body)
        elif endpoint == COMPLETIONS:
            completion = CompletionRequest.model_validate(body)
        else:
            chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = error_from_validation(exc)
        raise ApiError(error.code, error.message, error.param) from exc
    if endpoint == EMBEDDINGS:
        ((item, param),) = embedding_inputs(embedding, limit=1)  # a line: one input, one job
        pooling = PoolingParams(dimensions=embedding.dimensions)
        # no deadline until the batch's own (computing a placeholder costs a good share of
        # a line's parse, and a large batch parses each line twice)
        return embedding, embedding_job(embedding.model, item, pooling, None, param)
    if endpoint == COMPLETIONS:
        _no_stream(completion.stream)
        check_completion(completion)
        prompts = completion_prompts(completion)
        if len(prompts) != 1:
            raise ApiError(
                ErrorCode.INVALID_REQUEST, "prompt: a batch line takes one prompt", "prompt"
            )
        max_tokens = completion.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        request = completion_job(completion, prompts[0], max_tokens, _PLACEHOLDER_TIMEOUT_S)
        return completion, request
    _no_stream(chat.stream)
    check_chat(chat)
    requested, _ = chat_max_tokens(chat)
    request = chat_job(chat, requested or default_max_tokens, _PLACEHOLDER_TIMEOUT_S)
    return chat, request


def batch_job_request(
    request: JobRequest, *, batch_id: str, line: ParsedLine, deadline: datetime
) -> JobRequest:
    """The job a batch line runs as: bulk priority (its own stream, scheduled after interactive
    work), the batch's deadline, and an idempotency key per line, so a controller that runs a
    line twice (after a crash) gets the same job back instead of a second one."""
    return request.model_copy(
        update={
            "priority": max(request.priority, PRIORITY_BULK),
            "deadline": deadline,
            "idempotency_key": f"{batch_id}:{line.number}",
            "metadata": {BATCH_ID_METADATA: batch_id, "custom_id": line.custom_id or ""},
        }
    )


def prompt_param(line: ParsedLine) -> str:
    """Where a line's prompt is, as the error file names fields."""
    if isinstance(line.openai, EmbeddingRequest):
        return "body.input"
    return "body.prompt" if isinstance(line.openai, CompletionRequest) else "body.messages"


def response_body(openai: OpenAIRequest, job: Job) -> dict[str, Any]:
    if isinstance(openai, EmbeddingRequest):
        return embeddings_body(openai, [job])
    if isinstance(openai, CompletionRequest):
        return completion_body(openai, [job])
    return chat_body(openai, job)


def line_of_result(line: ParsedLine, job: Job) -> tuple[bool, str]:
    """(succeeded, the output or error line) for a job that reached a terminal status."""
    assert line.custom_id is not None and line.openai is not None
    if job.result is not None and job.status is JobStatus.SUCCEEDED:
        return True, output_line(line.custom_id, job.id, response_body(line.openai, job))
    error = job.error or ErrorBody.of(ErrorCode.INTERNAL_ERROR, f"the job ended {job.status.value}")
    status = 400 if error.code.http_status == 422 else error.code.http_status
    return False, error_line(
        line.custom_id, error.code.value, error.message, job_id=job.id, status_code=status
    )


def line_of_error(line: ParsedLine) -> str:
    """The error-file line of an input line that never became a job."""
    assert line.error is not None
    return error_line(line.custom_id, line.error.code.value, line.error.message, line=line.number)


def line_not_run(line: ParsedLine, code: str, message: str) -> str:
    """The error-file line of a valid line the batch did not finish (refused at enqueue,
    cancelled or expired)."""
    return error_line(line.custom_id, code, message, line=line.number)


def _no_stream(stream: bool) -> None:
    if stream:
        raise ApiError(ErrorCode.INVALID_REQUEST, "stream: batch requests cannot stream", "stream")


def _invalid(message: str, param: str | None = None) -> ErrorBody:
    return ErrorBody.of(ErrorCode.INVALID_REQUEST, message, param)


def _with_body_param(error: ErrorBody) -> ErrorBody:
    param = f"body.{error.param}" if error.param else "body"
    return ErrorBody.of(error.code, f"body: {error.message}", param)
