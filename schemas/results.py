"""The result of a finished job: its choices, token usage and timings."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import overload

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.chunks import FinishReason, StopReason, TokenId, TokenLogprob


@overload
def as_utc(value: datetime) -> datetime: ...


@overload
def as_utc(value: None) -> None: ...


def as_utc(value: datetime | None) -> datetime | None:
    """Aware datetimes are stored in UTC so the same instant always serialises the same way."""
    return None if value is None else value.astimezone(UTC)


class ChoiceResult(BaseModel):
    """One generated choice, whole."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int = Field(ge=0, strict=True)
    text: str
    token_ids: list[TokenId]
    finish_reason: FinishReason
    stop_reason: StopReason = None
    logprobs: list[TokenLogprob] | None = None

    @model_validator(mode="after")
    def _logprobs_per_token(self) -> ChoiceResult:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs must have one entry per token in token_ids")
        return self


class Usage(BaseModel):
    """Token counts, summed over all choices for completion tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: int = Field(ge=0, strict=True)
    completion_tokens: int = Field(ge=0, strict=True)
    total_tokens: int = Field(ge=0, strict=True)
    cached_prompt_tokens: int = Field(0, ge=0, strict=True, description="prefix-cache hits")

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_prompt_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            cached_prompt_tokens=cached_prompt_tokens,
        )

    @model_validator(mode="after")
    def _sums(self) -> Usage:
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError("total_tokens must equal prompt_tokens + completion_tokens")
        if self.cached_prompt_tokens > self.prompt_tokens:
            raise ValueError("cached_prompt_tokens must not exceed prompt_tokens")
        return self


class Timings(BaseModel):
    """When the job moved through the system. Times are UTC; durations in seconds.

    `queued_at` comes from the enqueuer's clock and the rest from the worker's, so durations that
    span both (queue_wait_s, ttft_s, total_s) are clamped at 0 against clock skew."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    queued_at: AwareDatetime
    started_at: AwareDatetime | None = None
    first_token_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None
    queue_wait_s: float | None = Field(None, ge=0)  # started - queued
    ttft_s: float | None = Field(None, ge=0)  # first token - queued: what the user waited
    total_s: float | None = Field(None, ge=0)  # finished - queued
    decode_s: float | None = Field(None, ge=0)  # finished - first token

    @field_validator("queued_at", "started_at", "first_token_at", "finished_at")
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @classmethod
    def from_times(
        cls,
        queued_at: datetime,
        started_at: datetime | None = None,
        first_token_at: datetime | None = None,
        finished_at: datetime | None = None,
    ) -> Timings:
        """Timings with every duration computed from the given instants."""

        def span(start: datetime | None, end: datetime | None) -> float | None:
            if start is None or end is None:
                return None
            return max((end - start).total_seconds(), 0.0)

        return cls(
            queued_at=queued_at,
            started_at=started_at,
            first_token_at=first_token_at,
            finished_at=finished_at,
            queue_wait_s=span(queued_at, started_at),
            ttft_s=span(queued_at, first_token_at),
            total_s=span(queued_at, finished_at),
            decode_s=span(first_token_at, finished_at),
        )


class JobResult(BaseModel):
    """What a succeeded job produced; stored JSON-encoded in the job hash's `result` field. An
    embedding job has its vector in `embedding` (a score job: its cross-encoder's label logits)
    and one empty choice (no tokens generated); a job of several `inputs` has one vector per
    input in `embeddings` and each input's token count in `input_tokens`, in input order."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    choices: list[ChoiceResult] = Field(min_length=1)
    usage: Usage
    timings: Timings
    # With sampling.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None
    embeddings: list[list[float]] | None = None
    input_tokens: list[int] | None = None

    @model_validator(mode="after")
    def _choices_numbered(self) -> JobResult:
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError("choices must be ordered by index 0, 1, ..., n-1")
        completion = sum(len(c.token_ids) for c in self.choices)
        if completion != self.usage.completion_tokens:
            raise ValueError("usage.completion_tokens must equal the token count of all choices")
        if (self.embeddings is None) != (self.input_tokens is None):
            raise ValueError("embeddings and input_tokens come together")
        if self.embeddings is not None and self.input_tokens is not None:
            if len(self.embeddings) != len(self.input_tokens):
                raise ValueError("input_tokens must have one entry per vector in embeddings")
            if sum(self.input_tokens) != self.usage.prompt_tokens:
                raise ValueError("usage.prompt_tokens must equal the sum of input_tokens")
        return self
