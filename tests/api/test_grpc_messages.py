"""The wire contract's objects as gRPC messages: what ended a choice, a job's record, and the
request fields named as the gRPC message names them."""

from __future__ import annotations

from datetime import timedelta

import pytest

from producer_api.errors import ApiError
from producer_api.grpc.requests import job_request, message_field
from producer_api.grpc.responses import chunk_message, job_message
from producer_api.grpc.stubs import inference_pb2 as pb
from schemas import (
    ChoiceResult,
    ErrorBody,
    ErrorCode,
    Job,
    JobRequest,
    JobResult,
    JobStatus,
    Timings,
    TokenChunk,
    Usage,
    utc_now,
)


def test_a_stop_sequence_or_stop_token_is_the_oneof_it_belongs_to():
    by_string = chunk_message(
        TokenChunk(job_id="job_x", index=3, text="a", finish_reason="stop", stop_reason="\n")
    )
    by_token = chunk_message(
        TokenChunk(job_id="job_x", index=4, finish_reason="stop", stop_reason=2, final=True)
    )
    unfinished = chunk_message(TokenChunk(job_id="job_x", index=0, text="b", token_ids=[7]))
    assert by_string.WhichOneof("stop_reason") == "stop_sequence"
    assert by_string.stop_sequence == "\n"
    assert (by_token.WhichOneof("stop_reason"), by_token.stop_token_id) == ("stop_token_id", 2)
    assert unfinished.WhichOneof("stop_reason") is None and unfinished.finish_reason == ""
    assert not unfinished.HasField("usage")


def test_a_job_record_carries_its_result_or_its_error():
    created = utc_now()
    request = JobRequest(model="m", prompt="hi", priority=3)
    result = JobResult(
        choices=[ChoiceResult(index=0, text="yo", token_ids=[5, 6], finish_reason="length")],
        usage=Usage.of(2, 2),
        timings=Timings.from_times(created),
    )
    done = Job.new(request, owner="alice").model_copy(
        update={
            "status": JobStatus.SUCCEEDED,
            "result": result,
            "finished_at": created + timedelta(seconds=1),
        }
    )
    message = job_message(done)
    assert (message.status, message.model_id, message.priority) == ("succeeded", "m", 3)
    assert message.choices[0].text == "yo" and message.usage.total_tokens == 4
    assert not message.HasField("error") and not message.HasField("started_at")
    assert message.finished_at.ToDatetime().timestamp() == done.finished_at.timestamp()
    failed = done.model_copy(
        update={
            "status": JobStatus.FAILED,
            "result": None,
            "error": ErrorBody.of(ErrorCode.ENGINE_ERROR, "boom"),
        }
    )
    message = job_message(failed)
    assert (message.error.code, message.error.message) == ("engine_error", "boom")
    assert len(message.choices) == 0 and not message.HasField("usage")


def test_fields_are_named_as_the_grpc_message_names_them():
    assert message_field("sampling.max_tokens") == "num_tokens"
    assert message_field("sampling.stop.3") == "stop_sequences.3"
    assert message_field("model") == "model_id"
    assert message_field("prompt_token_ids.2") == "prompt_token_ids.2"
    built = job_request(
        pb.CompletionsRequest(model_id="m", prompt="hi", stop_sequences=["."], temperature=0),
        7,
        stream=True,
        timeout_s=30,
    )
    assert built.sampling.max_tokens == 7 and built.sampling.stop == ["."]
    assert built.sampling.temperature == 0 and built.stream and built.deadline is not None
    unset = job_request(
        pb.CompletionsRequest(model_id="m", prompt="hi"), 5, stream=False, timeout_s=1
    )
    assert unset.sampling == JobRequest(model="m", prompt="hi", sampling={"max_tokens": 5}).sampling


def test_beam_search_fields_reach_the_job_and_their_conflicts_name_the_field():
    beams = pb.CompletionsRequest(
        model_id="m", prompt="p", n=4, temperature=0, use_beam_search=True, length_penalty=0.5
    )
    sampling = job_request(beams, 8, stream=False, timeout_s=30).sampling
    assert (sampling.use_beam_search, sampling.n, sampling.length_penalty) == (True, 4, 0.5)
    plain = job_request(
        pb.CompletionsRequest(model_id="m", prompt="p"), 8, stream=False, timeout_s=30
    )
    assert (plain.sampling.use_beam_search, plain.sampling.length_penalty) == (False, 1.0)
    with_logprobs = pb.CompletionsRequest(
        model_id="m", prompt="p", use_beam_search=True, logprobs=True
    )
    with pytest.raises(ApiError) as refused:
        job_request(with_logprobs, 8, stream=False, timeout_s=30)
    assert refused.value.error.param == "logprobs"
