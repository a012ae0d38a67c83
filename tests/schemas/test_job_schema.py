"""JobRequest / Job: validation messages name the field, JSON and Redis-hash round trips."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given, settings
from pydantic import ValidationError

from schemas import (
    TERMINAL_STATUSES,
    ErrorBody,
    Job,
    JobField,
    JobRequest,
    JobStatus,
    error_from_validation,
    hash_fields,
    is_valid_job_id,
    new_job_id,
    utc_now,
)
from schemas.jobs import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_MODEL_NAME_CHARS,
    MAX_PRIORITY,
    MAX_TIMEOUT_S,
)
from tests.schemas.strategies import job_requests, jobs

VALID = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello"}


def _rejected_param(data: dict) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        JobRequest.model_validate(data)
    body = error_from_validation(info.value)
    return body.param, body.message


BAD_VALUES = [
    ("model", ""),
    ("model", "two words"),
    ("model", "tab\there"),
    ("model", "x" * (MAX_MODEL_NAME_CHARS + 1)),
    ("model", 5),
    ("model", None),
    ("prompt", ""),
    ("prompt", 42),
    ("prompt", ["a", "b"]),
    ("messages", []),
    ("messages", "hello"),
    ("messages", [{"role": "robot", "content": "x"}]),
    ("messages", [{"role": "user"}]),
    ("messages", [{"role": "user", "content": 3}]),
    ("messages", [{"role": "user", "content": "x", "mood": "happy"}]),
    ("prompt_token_ids", []),
    ("prompt_token_ids", [-1]),
    ("prompt_token_ids", [1.5]),
    ("prompt_token_ids", ["7"]),
    ("prompt_token_ids", [True]),
    ("sampling", "greedy"),
    ("sampling", {"temperature": -0.5}),
    ("sampling", {"max_tokens": 0}),
    ("sampling", {"n": 2, "best_of": 1}),  # best_of below n
    ("sampling", {"early_stopping": True}),  # a field inferq does not have
    ("stream", "yes"),
    ("stream", 1),
    ("priority", -1),
    ("priority", MAX_PRIORITY + 1),
    ("priority", 1.5),
    ("priority", "high"),
    ("priority", True),
    ("deadline", "2030-01-01T00:00:00"),
    ("deadline", "tomorrow"),
    ("deadline", datetime(2030, 1, 1)),
    ("timeout_s", 0),
    ("timeout_s", -3),
    ("timeout_s", math.inf),
    ("timeout_s", math.nan),
    ("timeout_s", MAX_TIMEOUT_S * 2),
    ("timeout_s", "soon"),
    ("idempotency_key", ""),
    ("idempotency_key", "has space"),
    ("idempotency_key", "k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1)),
    ("idempotency_key", 12),
    ("metadata", {"k": 5}),
    ("metadata", {"": "v"}),
    ("metadata", {"k" * 65: "v"}),
    ("metadata", {"k": "v" * 513}),
    ("metadata", {f"k{i}": "v" for i in range(MAX_METADATA_PAIRS + 1)}),
    ("metadata", ["k", "v"]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=lambda v: repr(v)[:30])
def test_bad_value_is_rejected_naming_the_field(field, value):
    data = dict(VALID)
    if field in ("messages", "prompt_token_ids"):
        data.pop("prompt")
    data[field] = value
    param, message = _rejected_param(data)
    assert param is not None and param.split(".")[0] == field
    assert field in message


@pytest.mark.parametrize(
    "inputs",
    [
        {},
        {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
        {"prompt": "a", "prompt_token_ids": [1]},
        {"messages": [{"role": "user", "content": "a"}], "prompt_token_ids": [1]},
        {"prompt": "a", "messages": [{"role": "user", "content": "a"}], "prompt_token_ids": [1]},
    ],
)
def test_exactly_one_input_is_required(inputs):
    _, message = _rejected_param({"model": "m", **inputs})
    assert "exactly one of prompt, messages, prompt_token_ids" in message


@pytest.mark.parametrize(
    "inputs",
    [
        {"prompt": "a"},
        {"messages": [{"role": "user", "content": "a"}]},
        {"prompt_token_ids": [0, 1]},
    ],
)
def test_each_single_input_is_accepted(inputs):
    request = JobRequest(model="m", **inputs)
    assert request.input_kind == next(iter(inputs))


@pytest.mark.parametrize("model", [Job, JobRequest])
def test_unknown_top_level_field_is_rejected(model):
    data = {**VALID, "surprise": 1}
    if model is Job:
        data = {"id": new_job_id(), "request": VALID, "created_at": utc_now(), "surprise": 1}
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    assert error_from_validation(info.value).param == "surprise"


def test_sampling_consistency_errors_name_the_fields():
    _, message = _rejected_param({**VALID, "sampling": {"min_tokens": 9, "max_tokens": 3}})
    assert "min_tokens" in message and "max_tokens" in message
    _, message = _rejected_param({**VALID, "sampling": {"top_logprobs": 2}})
    assert "top_logprobs" in message


def test_timeout_becomes_an_absolute_deadline_that_never_moves():
    before = utc_now()
    request = JobRequest(**VALID, timeout_s=30)
    after = utc_now()
    assert request.timeout_s is None
    assert before + timedelta(seconds=30) <= request.deadline <= after + timedelta(seconds=30)
    again = JobRequest.model_validate_json(request.to_json())
    assert again.deadline == request.deadline
    assert "timeout_s" not in request.to_json()


def test_deadline_and_timeout_together_are_rejected():
    _, message = _rejected_param({**VALID, "deadline": utc_now().isoformat(), "timeout_s": 3})
    assert "deadline" in message and "timeout_s" in message


def test_deadline_is_stored_in_utc_as_the_same_instant():
    local = datetime(2030, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    request = JobRequest(**VALID, deadline=local)
    assert request.deadline == local
    assert request.deadline.utcoffset() == timedelta(0)
    assert request.is_past_deadline(now=local + timedelta(microseconds=1))
    assert not request.is_past_deadline(now=local - timedelta(microseconds=1))


def test_job_ids_are_unique_and_valid():
    ids = {new_job_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_valid_job_id(i) for i in ids)
    assert not is_valid_job_id("job_short")
    assert not is_valid_job_id("../../etc/passwd")


def test_terminal_statuses():
    assert {s for s in JobStatus if s.is_terminal} == TERMINAL_STATUSES
    assert not JobStatus.QUEUED.is_terminal and not JobStatus.RUNNING.is_terminal


@settings(max_examples=60, deadline=None)
@given(job_requests())
def test_request_json_round_trip_is_lossless(request):
    assert JobRequest.model_validate_json(request.to_json()) == request
    assert JobRequest.model_validate_json(request.model_dump_json()) == request


@settings(max_examples=30, deadline=None)
@given(jobs())
def test_job_redis_hash_round_trip_is_lossless(job):
    flat = job.to_redis_hash()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in flat.items())
    assert set(flat) <= set(JobField)
    as_bytes = {k.encode(): v.encode() for k, v in flat.items()}
    for stored in (flat, as_bytes):
        back = Job.from_redis_hash(stored)
        assert back == job
        assert back.to_redis_hash() == flat
    assert Job.model_validate_json(job.model_dump_json()) == job


def test_hash_leaves_out_absent_fields_and_keeps_model_and_priority_readable():
    job = Job.new(JobRequest(**VALID, priority=3), owner=None)
    flat = job.to_redis_hash()
    assert flat[JobField.MODEL] == VALID["model"]
    assert flat[JobField.PRIORITY] == "3"
    for absent in ("owner", "started_at", "finished_at", "worker", "error", "result"):
        assert absent not in flat


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request", "{not json"),
        ("request", '{"model": ""}'),
        ("status", "paused"),
        ("attempts", "-1"),
        ("created_at", "yesterday"),
    ],
)
def test_corrupt_hash_field_is_reported_by_name(field, value):
    flat = Job.new(JobRequest(**VALID)).to_redis_hash()
    flat[field] = value
    with pytest.raises(ValidationError) as info:
        Job.from_redis_hash(flat)
    assert error_from_validation(info.value).param.split(".")[0] == field


def test_missing_hash_field_is_reported_by_name():
    flat = Job.new(JobRequest(**VALID)).to_redis_hash()
    del flat["request"]
    with pytest.raises(ValidationError) as info:
        Job.from_redis_hash(flat)
    assert error_from_validation(info.value).param == "request"


def test_hash_fields_encodes_partial_updates_like_the_full_hash():
    job = Job.new(JobRequest(**VALID))
    started = datetime(2030, 1, 1, 8, tzinfo=UTC)
    error = ErrorBody.of("engine_error", "boom")
    changed = job.model_copy(
        update={"status": JobStatus.FAILED, "started_at": started, "error": error, "attempts": 2}
    )
    update = hash_fields(status=JobStatus.FAILED, started_at=started, error=error, attempts=2)
    assert update == {k: v for k, v in changed.to_redis_hash().items() if k in update}
    assert Job.from_redis_hash({**job.to_redis_hash(), **update}) == changed
    with pytest.raises(ValueError, match="not a job hash field"):
        hash_fields(colour="red")
