"""JobResult, Usage, Timings and ErrorBody."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from pydantic import ValidationError

from schemas import (
    ChoiceResult,
    ErrorBody,
    ErrorCode,
    JobRequest,
    JobResult,
    Timings,
    Usage,
    error_from_validation,
)
from schemas.errors import MAX_ERROR_MESSAGE_CHARS
from tests.schemas.strategies import job_results

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _choice(index: int, ids: list[int]) -> ChoiceResult:
    return ChoiceResult(index=index, text="x" * len(ids), token_ids=ids, finish_reason="length")


@settings(max_examples=60, deadline=None)
@given(job_results())
def test_result_json_round_trip_is_lossless(result):
    assert JobResult.model_validate_json(result.model_dump_json(exclude_none=True)) == result
    assert JobResult.model_validate_json(result.model_dump_json()) == result


def test_timings_from_times_computes_every_duration():
    started, first, finished = (T0 + timedelta(seconds=s) for s in (0.5, 0.75, 2.0))
    timings = Timings.from_times(T0, started, first, finished)
    assert timings.queue_wait_s == (started - T0).total_seconds()
    assert timings.ttft_s == (first - T0).total_seconds()
    assert timings.total_s == (finished - T0).total_seconds()
    assert timings.decode_s == (finished - first).total_seconds()


def test_timings_clamp_clock_skew_and_leave_unknowns_empty():
    timings = Timings.from_times(T0, T0 - timedelta(seconds=1))
    assert timings.queue_wait_s == 0.0
    assert timings.ttft_s is None and timings.total_s is None and timings.decode_s is None


def test_usage_must_add_up():
    assert Usage.of(7, 5).total_tokens == 12
    with pytest.raises(ValidationError, match="total_tokens"):
        Usage(prompt_tokens=7, completion_tokens=5, total_tokens=11)
    with pytest.raises(ValidationError, match="cached_prompt_tokens"):
        Usage.of(3, 1, cached_prompt_tokens=4)


def test_choices_must_be_numbered_in_order_and_match_usage():
    timings = Timings.from_times(T0)
    with pytest.raises(ValidationError, match="ordered by index"):
        JobResult(choices=[_choice(1, [1]), _choice(0, [2])], usage=Usage.of(1, 2), timings=timings)
    with pytest.raises(ValidationError, match="completion_tokens"):
        JobResult(choices=[_choice(0, [1, 2])], usage=Usage.of(1, 3), timings=timings)
    with pytest.raises(ValidationError) as info:
        JobResult(choices=[], usage=Usage.of(1, 0), timings=timings)
    assert error_from_validation(info.value).param == "choices"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("index", -1),
        ("text", None),
        ("token_ids", [-1]),
        ("finish_reason", "tired"),
        ("logprobs", [{}]),
    ],
)
def test_bad_choice_field_is_named(field, value):
    data = {"index": 0, "text": "a", "token_ids": [1], "finish_reason": "stop", field: value}
    with pytest.raises(ValidationError) as info:
        ChoiceResult.model_validate(data)
    assert error_from_validation(info.value).param.split(".")[0] == field


def test_error_from_validation_names_nested_fields_and_lists_all_problems():
    with pytest.raises(ValidationError) as info:
        JobRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "robot", "content": "x"}],
                "sampling": {"top_p": 0},
            }
        )
    body = error_from_validation(info.value)
    assert body.code is ErrorCode.INVALID_REQUEST
    assert body.param == "messages.0.role"
    assert "messages.0.role" in body.message and "sampling.top_p" in body.message


def test_error_body_round_trip_and_long_messages_are_cut():
    body = ErrorBody.of(ErrorCode.QUEUE_FULL, "x" * (MAX_ERROR_MESSAGE_CHARS + 10), "model")
    assert len(body.message) == MAX_ERROR_MESSAGE_CHARS
    assert ErrorBody.model_validate_json(body.model_dump_json()) == body
    with pytest.raises(ValidationError):
        ErrorBody.model_validate({"code": "oops", "message": "m"})


def test_error_codes_are_stable_lowercase_strings_with_http_statuses():
    values = [code.value for code in ErrorCode]
    assert len(values) == len(set(values))
    assert all(v == v.lower() and " " not in v for v in values)
    assert ErrorCode.QUEUE_FULL.http_status == 429
    assert ErrorCode.NOT_FOUND.http_status == 404
    assert ErrorCode.INVALID_REQUEST.http_status == 422
    assert ErrorCode.INTERNAL_ERROR.http_status == 500
