"""Every status the gRPC service answers with, produced: bad input is INVALID_ARGUMENT naming
the message's field with nothing queued, a full queue RESOURCE_EXHAUSTED with a retry hint,
NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from redis import Redis

from producer_api.grpc.stubs import inference_pb2 as pb
from schemas.jobs import MAX_PROMPT_CHARS
from schemas.sampling import MAX_STOP_STRINGS
from tests.api.conftest import BOB_KEY, KEYS, MODEL, Stack, auth
from tests.api.echo_worker import write_echo_tokenizer
from tests.api.grpc_stack import GrpcClient, grpc_server, metadata, trailing

CONTEXT = 64  # the echo worker's context, in words


@pytest.fixture
def client(stack: Stack, tmp_path: Path) -> Iterator[GrpcClient]:
    stack.api()
    stack.worker(max_model_len=CONTEXT, tokenizer_file=write_echo_tokenizer(tmp_path))
    with grpc_server(stack) as served:
        yield served


def queued(stack: Stack) -> int:
    with Redis.from_url(stack.redis_url) as redis:
        return redis.xlen(KEYS.jobs_stream(MODEL))


def refusal(call, request, key: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as failed:
        call(request, metadata=metadata() if key is None else metadata(key), timeout=30)
    return failed.value


def stream_all(client: GrpcClient):
    """StreamCompletion read to its end, called like a unary method."""
    return lambda request, **kw: list(client.stub.StreamCompletion(request, **kw))


def completion(**fields) -> pb.CompletionsRequest:
    return pb.CompletionsRequest(**{"model_id": MODEL, "prompt": "hello there", **fields})


BAD_COMPLETIONS = [
    (completion(prompt=""), "prompt"),
    (pb.CompletionsRequest(model_id=MODEL), "prompt"),
    (completion(prompt_token_ids=[1, 2]), "prompt_token_ids"),  # and a prompt: one only
    (pb.CompletionsRequest(model_id=MODEL, prompt_token_ids=[1, 99_999_999]), "prompt_token_ids.1"),
    (completion(temperature=2.5), "temperature"),
    (completion(top_p=0), "top_p"),
    (completion(top_k=0), "top_k"),
    (completion(min_p=1.5), "min_p"),
    (completion(presence_penalty=-3), "presence_penalty"),
    (completion(repetition_penalty=0), "repetition_penalty"),
    (completion(seed=-1), "seed"),
    (completion(num_tokens=0), "num_tokens"),
    (completion(num_tokens=CONTEXT), "num_tokens"),
    (completion(min_tokens=50, num_tokens=5), "min_tokens"),
    (completion(n=0), "n"),
    (completion(n=9), "n"),  # over the server's max_n
    (completion(priority=10), "priority"),
    (completion(top_logprobs=3), "top_logprobs"),  # without logprobs
    (completion(timeout_s=-1), "timeout_s"),
    (completion(stop_token_ids=[-4]), "stop_token_ids"),
    (completion(stop_sequences=["\n"] * (MAX_STOP_STRINGS + 1)), "stop_sequences"),
    (completion(stop_sequences=["ok", ""]), "stop_sequences"),
    (completion(model_id="no-such-model"), "model_id"),
    (completion(model_id=""), "model_id"),
    (completion(prompt="word " * CONTEXT), "prompt"),  # longer than the context
    (completion(prompt="x" * (MAX_PROMPT_CHARS + 1)), "prompt"),
]


@pytest.mark.parametrize(("request_", "field"), BAD_COMPLETIONS)
def test_bad_input_is_invalid_argument_naming_the_field_and_queues_nothing(
    client, stack, request_, field
):
    unary = refusal(client.stub.CreateCompletion, request_)
    streamed = refusal(stream_all(client), pb.StreamCompletionRequest(completion=request_))
    for error in (unary, streamed):
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert trailing(error)["error-param"] == field
        assert error.details().startswith(field.partition(".")[0]), error.details()
    assert queued(stack) == 0


def test_bad_chat_input_names_the_field(client, stack):
    empty = refusal(
        client.stub.CreateChatCompletion, pb.ChatCompletionsRequest(model_id=MODEL, messages=[])
    )
    role = refusal(
        client.stub.CreateChatCompletion,
        pb.ChatCompletionsRequest(
            model_id=MODEL, messages=[pb.ChatMessage(role="robot", content="hi")]
        ),
    )
    assert (trailing(empty)["error-param"], trailing(role)["error-param"]) == (
        "messages",
        "messages.0.role",
    )
    assert {empty.code(), role.code()} == {grpc.StatusCode.INVALID_ARGUMENT}
    assert queued(stack) == 0


def test_a_stream_request_without_a_start_or_with_a_bad_resume_point(client):
    nothing = refusal(stream_all(client), pb.StreamCompletionRequest())
    after = refusal(
        stream_all(client),
        pb.StreamCompletionRequest(completion=completion(), after_chunk=3),
    )
    assert trailing(nothing)["error-param"] == "completion"
    assert trailing(after)["error-param"] == "after_chunk"


def test_a_full_queue_is_resource_exhausted_with_a_retry_hint(stack):
    stack.api(max_queue_len=1)
    stack.heartbeat()  # a live worker that takes nothing: the first job stays queued
    with httpx.Client(base_url=stack.servers[0].url, headers=auth()) as http:
        body = {"model": MODEL, "prompt": "first"}
        assert http.post("/v1/jobs", json=body).status_code == 202
    with grpc_server(stack, max_queue_len=1, retry_after_s=7) as client:
        error = refusal(client.stub.CreateCompletion, completion())
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailing(error)["retry-after"] == "7"
    assert trailing(error)["error-code"] == "queue_full"
    assert queued(stack) == 1


def test_unknown_jobs_are_not_found(client):
    for job_id in ("job_" + "x" * 22, "not-a-job-id"):
        for call in (client.stub.GetJob, client.stub.CancelJob):
            error = refusal(call, pb.GetJobRequest(job_id=job_id))
            assert error.code() is grpc.StatusCode.NOT_FOUND
    error = refusal(
        stream_all(client),
        pb.StreamCompletionRequest(job_id="job_" + "y" * 22),
    )
    assert error.code() is grpc.StatusCode.NOT_FOUND


def test_missing_or_wrong_keys_are_unauthenticated(client, stack):
    for headers in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", "sk-x"),)):
        with pytest.raises(grpc.RpcError) as failed:
            client.stub.CreateCompletion(completion(), metadata=headers, timeout=10)
        assert failed.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as failed:
            client.stub.ListModels(pb.ListModelsRequest(), metadata=headers, timeout=10)
        assert failed.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert queued(stack) == 0


def test_another_keys_job_is_permission_denied(client):
    reply = client.stub.CreateCompletion(completion(num_tokens=2), metadata=metadata(), timeout=30)
    for call, message in (
        (client.stub.GetJob, pb.GetJobRequest(job_id=reply.job_id)),
        (client.stub.CancelJob, pb.CancelJobRequest(job_id=reply.job_id)),
        (
            stream_all(client),
            pb.StreamCompletionRequest(job_id=reply.job_id),
        ),
    ):
        error = refusal(call, message, key=BOB_KEY)
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED
        assert trailing(error)["error-param"] == "job_id"
    mine = client.stub.GetJob(pb.GetJobRequest(job_id=reply.job_id), metadata=metadata())
    assert mine.status == "succeeded" and mine.choices[0].text == reply.choices[0].text


def test_a_job_failing_in_the_worker_is_its_status(client):
    """Too long only as the worker counts (the API counts no assistant turn): the job fails
    there, and the call answers as the API would have, INVALID_ARGUMENT naming the field."""
    messages = [
        pb.ChatMessage(role="assistant", content="word " * CONTEXT),
        pb.ChatMessage(role="user", content="go on"),
    ]
    request = pb.ChatCompletionsRequest(model_id=MODEL, messages=messages, num_tokens=4)
    for call in (client.stub.CreateChatCompletion, stream_all(client)):
        message = request if call is client.stub.CreateChatCompletion else None
        error = refusal(call, message or pb.StreamCompletionRequest(chat=request))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert trailing(error)["error-code"] == "context_length_exceeded"
