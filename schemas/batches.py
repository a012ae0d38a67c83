"""Bulk work in OpenAI's Batch API shapes: files, batches, their statuses, and the JSONL line
formats of input, output and error files (keyed by each request's `custom_id`).

A batch is stored as the hash `{p}:batch:{id}` (fields in `BatchField`, all strings; times are
unix seconds as OpenAI reports them) and shown to clients as `BatchObject`."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

BATCH_ID_PREFIX = "batch_"
FILE_ID_PREFIX = "file-"
BATCH_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
MAX_CUSTOM_ID_CHARS = 512
MAX_BATCH_METADATA_PAIRS = 16
# A batch line's job carries its batch id under this metadata key; the worker that ends the job
# announces the end on the batch's `ended` list, which the controller reads instead of polling.
BATCH_ID_METADATA = "batch_id"
# A job that runs several lines of a batch (an embedding job of several inputs, one per line)
# names their line numbers under this key, in input order (`format_line_numbers`): whoever
# collects the job writes each line from its own input's vector, whatever it grouped itself.
BATCH_LINES_METADATA = "batch_lines"
# The `ended` list outlives a stalled controller run for this long after the last announcement.
BATCH_ENDED_TTL_S = 7 * 24 * 3600

_ID_RE = re.compile(r"^(batch_|file-)[A-Za-z0-9_-]{16,64}$")
_WINDOW_RE = re.compile(r"^([1-9][0-9]{0,6})([smh])$")
_WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600}
MAX_COMPLETION_WINDOW_S = 7 * 24 * 3600

Endpoint = Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings"]


def format_line_numbers(numbers: list[int]) -> str:
    """Increasing line numbers as runs: [3, 4, 5, 9] -> "3-5,9" (at most 7 characters per
    number below 1,000,000, and one run for the consecutive lines of a group)."""
    parts: list[str] = []
    start = previous = numbers[0]
    for number in [*numbers[1:], None]:
        if number is not None and number == previous + 1:
            previous = number
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if number is not None:
            start = previous = number
    return ",".join(parts)


def parse_line_numbers(text: str) -> list[int]:
    """The numbers `format_line_numbers` wrote; ValueError for text it did not write."""
    numbers: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        start, end = int(first), int(last or first)
        if end < start or (numbers and start <= numbers[-1]):
            raise ValueError(f"line numbers {text!r} are not increasing runs")
        numbers.extend(range(start, end + 1))
    return numbers


def new_batch_id() -> str:
    return BATCH_ID_PREFIX + secrets.token_urlsafe(16)


def new_file_id() -> str:
    return FILE_ID_PREFIX + secrets.token_urlsafe(16)


def is_valid_batch_id(value: str) -> bool:
    return value.startswith(BATCH_ID_PREFIX) and bool(_ID_RE.match(value))


def is_valid_file_id(value: str) -> bool:
    return value.startswith(FILE_ID_PREFIX) and bool(_ID_RE.match(value))


def completion_window_seconds(window: str) -> int:
    """ "24h" -> 86400. OpenAI only knows "24h"; shorter windows ("30m", "90s") help tests and
    operators. Raises ValueError for anything else or more than 7 days."""
    match = _WINDOW_RE.match(window)
    if match is None:
        raise ValueError(f"completion_window {window!r} must look like '24h', '30m' or '90s'")
    seconds = int(match.group(1)) * _WINDOW_UNITS[match.group(2)]
    if seconds > MAX_COMPLETION_WINDOW_S:
        raise ValueError("completion_window may be at most 7 days")
    return seconds


class BatchStatus(StrEnum):
    """validating -> in_progress -> finalizing -> completed; or failed (input unusable),
    expired (completion_window passed), cancelling -> cancelled."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_BATCH_STATUSES


TERMINAL_BATCH_STATUSES = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class BatchField(StrEnum):
    """Fields of the batch hash. Times (`*_at`) are unix seconds; `metadata` and `errors` are
    JSON; total / completed / failed count requests; `submitted` counts input lines the
    controller has enqueued (its resume point); `invalid_lines` (JSON: the numbers of the
    input lines refused at validation) lets a resumed run skip them without parsing the file
    again; `group_lines` is how many embedding lines run as one job, fixed when the batch first
    fans out so every run forms the same groups; `owner` is absent for anonymous batches."""

    ID = "id"
    OWNER = "owner"
    ENDPOINT = "endpoint"
    INPUT_FILE_ID = "input_file_id"
    COMPLETION_WINDOW = "completion_window"
    STATUS = "status"
    OUTPUT_FILE_ID = "output_file_id"
    ERROR_FILE_ID = "error_file_id"
    CREATED_AT = "created_at"
    IN_PROGRESS_AT = "in_progress_at"
    EXPIRES_AT = "expires_at"
    FINALIZING_AT = "finalizing_at"
    COMPLETED_AT = "completed_at"
    FAILED_AT = "failed_at"
    EXPIRED_AT = "expired_at"
    CANCELLING_AT = "cancelling_at"
    CANCELLED_AT = "cancelled_at"
    TOTAL = "total"
    COMPLETED = "completed"
    FAILED = "failed"
    SUBMITTED = "submitted"
    METADATA = "metadata"
    ERRORS = "errors"
    INVALID_LINES = "invalid_lines"
    GROUP_LINES = "group_lines"


# The `*_at` field set when a batch enters each status (every status has one but the first).
STATUS_TIME_FIELD: dict[BatchStatus, BatchField] = {
    status: BatchField(f"{status}_at")
    for status in BatchStatus
    if status is not BatchStatus.VALIDATING
}


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchObject(BaseModel):
    """A batch as the API shows it (OpenAI's `batch` object)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict[str, Any] | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None

    @classmethod
    def from_redis_hash(cls, data: Mapping[str, str]) -> BatchObject:
        values: dict[str, Any] = {}
        for name in BatchObject.model_fields:
            raw = data.get(name)
            if raw is None or name in ("object", "request_counts"):
                continue
            if name in ("metadata", "errors"):
                values[name] = json.loads(raw)
            elif name.endswith("_at"):
                values[name] = int(raw)
            else:
                values[name] = raw
        # total / completed / failed: hash fields of the same names
        counts = {name: int(data.get(name, 0)) for name in RequestCounts.model_fields}
        values["request_counts"] = RequestCounts(**counts)
        return cls.model_validate(values)


class FileObject(BaseModel):
    """A stored file as the API shows it (OpenAI's `file` object)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class BatchInputLine(BaseModel):
    """One line of a batch input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]


def output_line(
    custom_id: str, job_id: str, body: dict[str, Any], input_index: int | None = None
) -> str:
    """A line of the output file: the request succeeded and `body` is its response.
    `input_index`: the line's input in a job that ran several lines (its id stays unique)."""
    suffix = "" if input_index is None else f"_{input_index}"
    return _line(
        {
            "id": f"batch_req_{job_id}{suffix}",
            "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": job_id, "body": body},
            "error": None,
        }
    )


def error_line(
    custom_id: str | None,
    code: str,
    message: str,
    *,
    job_id: str | None = None,
    status_code: int | None = None,
    line: int | None = None,
) -> str:
    """A line of the error file: the request could not run (bad line) or did not succeed.
    `line` is the 1-based input line number, given for lines that never became a job."""
    error: dict[str, Any] = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    response = None
    if status_code is not None:
        response = {
            "status_code": status_code,
            "request_id": job_id,
            "body": {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        }
    return _line(
        {
            "id": f"batch_req_{job_id or 'none'}",
            "custom_id": custom_id,
            "response": response,
            "error": error,
        }
    )


def _line(payload: dict[str, Any]) -> str:
    # pydantic's encoder writes floats ten times as fast as json.dumps (an embedding line has
    # hundreds), each as its shortest round-trip digits as json.dumps does (a small one as
    # 0.00001 where json.dumps writes 1e-05: the same value)
    return to_json(payload).decode()
