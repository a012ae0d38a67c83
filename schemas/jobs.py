"""Jobs: what a client asks for (`JobRequest`), where a job stands (`JobStatus`), and the record
stored in Redis (`Job`, one hash per job; field layout in `JobField` and `schemas.keys`)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from schemas.chunks import TokenId
from schemas.errors import ErrorBody, field_error
from schemas.pooling import PoolingParams
from schemas.results import JobResult, as_utc
from schemas.sampling import SamplingParams
from schemas.vectors import (
    PACKED_EMBEDDING_FIELD,
    PACKED_EMBEDDINGS_FIELD,
    pack_float32,
    unpack_float32,
)

MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000
MAX_MESSAGES = 1024
MAX_EMBEDDING_INPUTS = 2048  # inputs of one embedding job (OpenAI's limit for one request)
MAX_MODEL_NAME_CHARS = 256
MAX_IDEMPOTENCY_KEY_CHARS = 255
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_TIMEOUT_S = 7 * 24 * 3600.0

PRIORITY_INTERACTIVE = 0
"""The default: a person is waiting. Lower numbers run first (engine `Sequence.priority`)."""
PRIORITY_BULK = 5
"""Offline / batch work that may wait behind interactive jobs."""
MAX_PRIORITY = 9


class PriorityClass(StrEnum):
    """The two kinds of work a model serves, as the queues, metrics and dashboard split them:
    `batch` is priority PRIORITY_BULK or more (the bulk stream: the Batch API, offline work that
    waits on purpose), `interactive` everything else (a person is waiting)."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @classmethod
    def of(cls, priority: int) -> PriorityClass:
        return cls.BATCH if priority >= PRIORITY_BULK else cls.INTERACTIVE


JOB_ID_PREFIX = "job_"
_JOB_ID_RE = re.compile(r"^job_[A-Za-z0-9_-]{16,64}$")
# No whitespace or control characters: names travel in keys, logs and headers.
_NAME_RE = r"^[^\s\x00-\x1f\x7f]+$"


def new_job_id() -> str:
    """An unguessable job id: `job_` + 128 random bits, URL-safe (also safe inside Redis keys)."""
    return JOB_ID_PREFIX + secrets.token_urlsafe(16)


def is_valid_job_id(value: str) -> bool:
    """Whether `value` has the shape of a job id (lets the API answer 404 without a Redis call)."""
    return bool(_JOB_ID_RE.match(value))


def utc_now() -> datetime:
    return datetime.now(UTC)


def format_time(value: datetime) -> str:
    """The one string form of an instant in Redis hashes: ISO 8601 in UTC with microseconds."""
    if value.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return value.astimezone(UTC).isoformat(timespec="microseconds")


class RunState(StrEnum):
    """How far a job's latest start got, while it has not ended (see worker.crashes)."""

    STARTED = "started"  # a worker started it; no output yet
    PROGRESSED = "progressed"  # the engine produced output for it in this start


class JobStatus(StrEnum):
    """queued -> running -> succeeded | failed | cancelled | expired (see schemas.transitions)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


class JobKind(StrEnum):
    """What a job asks of a model; a worker serves the one kind its model supports."""

    GENERATION = "generation"
    EMBEDDING = "embedding"
    SCORE = "score"  # a cross-encoder's scores of a text pair (prompt, prompt_pair)


TERMINAL_STATUSES = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)
    name: str | None = Field(None, min_length=1, max_length=64, pattern=_NAME_RE)


# Every request without sampling fields shares one (frozen) SamplingParams: building one runs
# its validators, a good share of a small request's parse.
_DEFAULT_SAMPLING = SamplingParams()

EmbeddingInput = (
    Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
)
"""One input of a multi-input embedding job: a text or its token ids."""


class JobRequest(BaseModel):
    """A generation request, or an embedding request when `pooling` is given (one input: a
    `prompt` or `prompt_token_ids`, pooled into one vector; or several `inputs`, each pooled
    into its own vector). Give exactly one of `prompt`, `messages`, `prompt_token_ids`,
    `inputs`.

    `timeout_s` is an input convenience: validation turns it into the absolute `deadline`
    (now + timeout_s, UTC) and clears it, so a stored request always carries `deadline` only and
    re-validating it never moves the deadline."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS, pattern=_NAME_RE)
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    inputs: list[EmbeddingInput] | None = Field(
        None,
        min_length=1,
        max_length=MAX_EMBEDDING_INPUTS,
        description="an embedding job's several inputs (texts or token-id lists), each pooled "
        "into its own vector, in order: one job instead of one per input",
    )
    sampling: SamplingParams = Field(default_factory=lambda: _DEFAULT_SAMPLING)
    pooling: PoolingParams | None = Field(
        None, description="an embedding job: how its input is pooled into one vector"
    )
    prompt_pair: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PROMPT_CHARS,
        description="a score job: the second text a cross-encoder scores with `prompt`",
    )
    lora: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_MODEL_NAME_CHARS,
        pattern=_NAME_RE,
        description="the LoRA adapter `model`'s workers run it with (the API sets it when the "
        "request's model names an adapter: `model` is then the adapter's base model)",
    )
    stream: StrictBool = False
    priority: int = Field(PRIORITY_INTERACTIVE, ge=0, le=MAX_PRIORITY, strict=True)
    deadline: AwareDatetime | None = None
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    idempotency_key: str | None = Field(
        None, min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS, pattern=_NAME_RE
    )
    metadata: dict[
        Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ] = Field(default_factory=dict, max_length=MAX_METADATA_PAIRS)

    @field_validator("deadline")
    @classmethod
    def _deadline_utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @model_validator(mode="after")
    def _one_input_and_deadline(self) -> JobRequest:
        given = [
            name
            for name in ("prompt", "messages", "prompt_token_ids", "inputs")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            got = ", ".join(given) or "none"
            raise field_error(
                given[1] if len(given) > 1 else "prompt",
                "exactly one of prompt, messages, prompt_token_ids, inputs must be given "
                f"(got {got})",
            )
        if self.pooling is not None and self.messages is not None:
            raise field_error(
                "messages", "an embedding job takes prompt, prompt_token_ids or inputs"
            )
        if self.inputs is not None and (self.pooling is None or self.prompt_pair is not None):
            raise field_error("inputs", "several inputs make an embedding job: give pooling")
        if self.lora is not None and self.pooling is not None:
            raise field_error("lora", "an embedding job runs without a LoRA adapter")
        if self.prompt_pair is not None and (self.pooling is None or self.prompt is None):
            raise field_error("prompt_pair", "a text pair needs pooling and a prompt")
        if self.timeout_s is not None:
            if self.deadline is not None:
                raise field_error("timeout_s", "give deadline or timeout_s, not both")
            self.deadline = utc_now() + timedelta(seconds=self.timeout_s)
            self.timeout_s = None
        return self

    @property
    def kind(self) -> JobKind:
        if self.pooling is None:
            return JobKind.GENERATION
        return JobKind.EMBEDDING if self.prompt_pair is None else JobKind.SCORE

    @property
    def input_kind(self) -> Literal["prompt", "messages", "prompt_token_ids", "inputs"]:
        if self.prompt is not None:
            return "prompt"
        if self.inputs is not None:
            return "inputs"
        return "messages" if self.messages is not None else "prompt_token_ids"

    @property
    def input_count(self) -> int:
        """How many sequences the job runs: its inputs, or 1."""
        return 1 if self.inputs is None else len(self.inputs)

    def is_past_deadline(self, now: datetime | None = None) -> bool:
        return self.deadline is not None and (now or utc_now()) >= self.deadline

    def to_json(self) -> str:
        """Compact JSON as stored in the job hash: unset optional inputs are left out."""
        return self.model_dump_json(exclude_none=True)


class JobField(StrEnum):
    """Field names of the job hash `{p}:job:{id}`. Every value is a string:

    id, status, model, owner, worker, entry_id: plain strings;
    priority, attempts, crash_resumes: decimal integers; run_state: a RunState;
    created_at, started_at, finished_at: ISO 8601 UTC (`format_time`);
    request, result, error: compact JSON of JobRequest, JobResult, ErrorBody.
    A field whose value is None is absent from the hash. `model` and `priority` repeat the
    request's values so workers and operators can read them without parsing JSON."""

    ID = "id"
    STATUS = "status"
    MODEL = "model"
    PRIORITY = "priority"
    OWNER = "owner"  # who enqueued (API key owner); None for anonymous
    REQUEST = "request"
    CREATED_AT = "created_at"
    STARTED_AT = "started_at"
    FINISHED_AT = "finished_at"
    ATTEMPTS = "attempts"  # how many times a worker started it (less starts handed back)
    # starts cut off by a worker's death that are not held against the job (it made progress
    # in them, or the worker did not die in its first step); `attempts - crash_resumes` is what
    # `max_attempts` limits (see worker.crashes)
    CRASH_RESUMES = "crash_resumes"
    # how far the latest start got (a RunState); present while a start has not ended (cleared
    # by a graceful hand-back), so whoever takes the job over after its worker died can tell
    # whether the job made progress in that start
    RUN_STATE = "run_state"
    WORKER = "worker"  # name of the worker that runs / ran it
    ENTRY_ID = "entry_id"  # its entry id in the model's jobs stream
    ERROR = "error"
    RESULT = "result"


_DERIVED_FIELDS = frozenset({JobField.MODEL, JobField.PRIORITY})
_JSON_FIELDS = frozenset({JobField.REQUEST, JobField.RESULT, JobField.ERROR})


def encode_hash_value(value: object) -> str:
    """How one job-hash value is written: the single place that decides the string forms."""
    if isinstance(value, JobResult) and value.embedding is not None:
        return _result_json(value)
    if isinstance(value, JobResult) and value.embeddings is not None:
        return _results_json(value)
    if isinstance(value, BaseModel):
        return value.model_dump_json(exclude_none=True)
    if isinstance(value, datetime):
        return format_time(value)
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, bool):
        raise TypeError("job hash holds no booleans")
    if isinstance(value, int | str):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} in a job hash")


class Job(BaseModel):
    """A job as stored in Redis."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=_JOB_ID_RE.pattern)
    request: JobRequest
    status: JobStatus = JobStatus.QUEUED
    owner: str | None = Field(None, min_length=1, max_length=256)
    created_at: AwareDatetime
    started_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None
    attempts: int = Field(0, ge=0)
    crash_resumes: int = Field(0, ge=0)
    run_state: RunState | None = None
    worker: str | None = None
    entry_id: str | None = None
    error: ErrorBody | None = None
    result: JobResult | None = None

    @field_validator("created_at", "started_at", "finished_at")
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @classmethod
    def new(cls, request: JobRequest, *, owner: str | None = None) -> Job:
        """A fresh queued job with a new unguessable id."""
        return cls(id=new_job_id(), request=request, owner=owner, created_at=utc_now())

    @property
    def model(self) -> str:
        return self.request.model

    def to_redis_hash(self) -> dict[str, str]:
        """The flat hash stored at `{p}:job:{id}` (None fields left out)."""
        return hash_fields(**dict(self), model=self.request.model, priority=self.request.priority)

    @classmethod
    def from_redis_hash(cls, data: Mapping[str, str] | Mapping[bytes, bytes]) -> Job:
        """Parse a hash read with HGETALL (bytes or str); raises pydantic.ValidationError when a
        field is missing or malformed (a worker treats that as an unparseable job)."""
        values = {
            name: _decoded(name, raw)
            for name, raw in decode_hash(data).items()
            if name not in _DERIVED_FIELDS
        }
        return cls.model_validate(values)


def hash_fields(**changes: object) -> dict[str, str]:
    """Encode a partial update of a job hash, e.g. for the worker:
    `hash_fields(status=JobStatus.RUNNING, started_at=utc_now(), worker="w1")`.
    None values are dropped (to clear a field, HDEL it). Unknown names raise ValueError."""
    encoded = {}
    for name, value in changes.items():
        if name not in JobField.__members__.values():
            raise ValueError(f"{name!r} is not a job hash field")
        if value is not None:
            encoded[name] = encode_hash_value(value)
    return encoded


def as_text(value: str | bytes) -> str:
    """A Redis reply read with or without `decode_responses`, as text."""
    return value.decode() if isinstance(value, bytes) else value


def decode_hash(data: Mapping[str, str] | Mapping[bytes, bytes]) -> dict[str, str]:
    """A hash read with HGETALL, with or without `decode_responses`, as text."""
    return {as_text(k): as_text(v) for k, v in data.items()}


def _result_json(result: JobResult) -> str:
    """A result with a vector, the vector packed where float32 holds it (schemas.vectors)."""
    assert result.embedding is not None
    packed = pack_float32(result.embedding)
    if packed is None:
        return result.model_dump_json(exclude_none=True)
    rest = result.model_dump_json(exclude_none=True, exclude={"embedding"})
    # `rest` is a JSON object with fields (choices is never empty): the vector joins before "}"
    return f'{rest[:-1]},"{PACKED_EMBEDDING_FIELD}":"{packed}"}}'


def _results_json(result: JobResult) -> str:
    """A result with one vector per input, each packed (all or none: schemas.vectors)."""
    assert result.embeddings is not None
    packed = [pack_float32(vector) for vector in result.embeddings]
    if any(p is None for p in packed):
        return result.model_dump_json(exclude_none=True)
    rest = result.model_dump_json(exclude_none=True, exclude={"embeddings"})
    return f'{rest[:-1]},"{PACKED_EMBEDDINGS_FIELD}":{json.dumps(packed)}}}'


def _decoded(name: str, raw: str) -> object:
    if name == JobField.RESULT:
        return _stored_result(raw)
    return _loads_or_raw(raw) if name in _JSON_FIELDS else raw


def _stored_result(raw: str) -> object:
    """A stored result's JSON, its packed vector unpacked into `embedding`. A packing that does
    not decode is left under its own name, so validation names the field."""
    result = _loads_or_raw(raw)
    if isinstance(result, dict) and isinstance(result.get(PACKED_EMBEDDING_FIELD), str):
        vector = unpack_float32(result[PACKED_EMBEDDING_FIELD])
        if vector is not None:
            del result[PACKED_EMBEDDING_FIELD]
            result["embedding"] = vector
    if isinstance(result, dict) and isinstance(result.get(PACKED_EMBEDDINGS_FIELD), list):
        texts = result[PACKED_EMBEDDINGS_FIELD]
        vectors = [unpack_float32(t) if isinstance(t, str) else None for t in texts]
        if all(v is not None for v in vectors):
            del result[PACKED_EMBEDDINGS_FIELD]
            result["embeddings"] = vectors
    return result


def _loads_or_raw(raw: str) -> object:
    # Bad JSON is handed on as the raw string so pydantic reports it under the field's name.
    try:
        return json.loads(raw)
    except ValueError:
        return raw
