"""Error codes and the error body every component reports: stable strings clients can branch on."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

MAX_ERROR_MESSAGE_CHARS = 4096


class ErrorCode(StrEnum):
    """Why a request was refused or a job did not succeed. Values never change once published."""

    # refused at the door (HTTP 4xx, nothing enqueued)
    INVALID_REQUEST = "invalid_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_TOKEN_ID = "invalid_token_id"  # a prompt token id outside the model's vocabulary
    MODEL_NOT_FOUND = "model_not_found"
    QUEUE_FULL = "queue_full"
    NOT_FOUND = "not_found"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limited"
    # a LoRA adapter that cannot serve: missing, for another base model, of too high a rank,
    # with bad tensors (a job fails with it; the worker and the other jobs go on)
    INVALID_LORA_ADAPTER = "invalid_lora_adapter"
    # a job that ended without a result (stored in the job hash's `error` field)
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # the deadline passed before a worker started the job
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the deadline passed while the job ran
    UNPARSEABLE_JOB = "unparseable_job"  # stream entry or job hash could not be read
    WORKER_LOST = "worker_lost"
    MAX_ATTEMPTS_EXCEEDED = "max_attempts_exceeded"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"
    UNAVAILABLE = "unavailable"  # Redis or the workers cannot be reached

    @property
    def http_status(self) -> int:
        """The HTTP status the API answers with when a request fails with this code."""
        return _HTTP_STATUS.get(self, 500)


_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 422,
    ErrorCode.INVALID_TOKEN_ID: 422,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.INVALID_LORA_ADAPTER: 422,
    ErrorCode.CANCELLED: 409,
    ErrorCode.EXPIRED: 408,
    ErrorCode.DEADLINE_EXCEEDED: 408,
    ErrorCode.UNAVAILABLE: 503,
}


class ErrorBody(BaseModel):
    """What went wrong: a stable `code`, a human `message`, and the offending field if any."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: ErrorCode
    message: str = Field(max_length=MAX_ERROR_MESSAGE_CHARS)
    param: str | None = Field(None, description="dotted path of the offending field")

    @classmethod
    def of(cls, code: ErrorCode, message: str, param: str | None = None) -> ErrorBody:
        """An error body whose message is cut to the allowed length instead of failing."""
        return cls(code=code, message=message[:MAX_ERROR_MESSAGE_CHARS], param=param)


FIELD_ERROR_TYPE = "invalid_field"


def field_error(field: str, message: str) -> PydanticCustomError:
    """The error a model validator raises about one of the model's fields. Pydantic reports
    model validator errors at the model itself, so the field rides in the error's context and
    `error_location` puts it back on the path: every validation error names a field."""
    return PydanticCustomError(FIELD_ERROR_TYPE, message, {"field": field})


def error_location(error: ErrorDetails) -> tuple[int | str, ...]:
    """Where a pydantic error is: its `loc`, plus the field a `field_error` names."""
    loc = tuple(error["loc"])
    ctx = error.get("ctx") or {}
    if error["type"] == FIELD_ERROR_TYPE and isinstance(ctx.get("field"), str):
        return (*loc, ctx["field"])
    return loc


def field_path(loc: tuple[int | str, ...]) -> str | None:
    """`("messages", 0, "role")` -> `"messages.0.role"`; the empty location -> None."""
    return ".".join(str(part) for part in loc) or None


def error_from_validation(
    exc: ValidationError, code: ErrorCode = ErrorCode.INVALID_REQUEST
) -> ErrorBody:
    """One ErrorBody for a pydantic ValidationError: `param` names the first bad field and the
    message lists every problem as `field: reason` so nothing is hidden from the client."""
    problems = []
    first_param: str | None = None
    for error in exc.errors(include_url=False):
        path = field_path(error_location(error))
        if first_param is None:
            first_param = path
        reason = error["msg"]
        problems.append(f"{path}: {reason}" if path else reason)
    return ErrorBody.of(code, "; ".join(problems) or str(exc), first_param)
