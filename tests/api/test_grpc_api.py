"""The gRPC service against a real Redis, the HTTP API and echo workers (tests/api/echo_worker.py),
through the generated stubs: the same jobs and answers as over HTTP, resumable streams, calls
that end early cancel their jobs, health and reflection."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from redis import Redis

from producer_api.grpc.stubs import SERVICE_NAME
from producer_api.grpc.stubs import inference_pb2 as pb
from schemas import JobStatus
from tests.api.conftest import KEYS, MODEL, Stack, auth
from tests.api.grpc_stack import GrpcClient, grpc_server, metadata
from tests.api.test_jobs_api import sse_events

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def client(stack: Stack) -> Iterator[GrpcClient]:
    stack.api()
    stack.worker()
    with grpc_server(stack) as served:
        yield served


@pytest.fixture
def slow_client(stack: Stack) -> Iterator[GrpcClient]:
    """A worker that takes 0.2 s a token, so calls can end while their job runs."""
    stack.api()
    stack.worker(step_delay_s=0.2)
    with grpc_server(stack) as served:
        yield served


def http(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=30)


def job_status(stack: Stack, job_id: str) -> JobStatus:
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        return JobStatus(redis.hget(KEYS.job(job_id), "status"))


def wait_status(stack: Stack, job_id: str, timeout: float = 10.0) -> JobStatus:
    """The job's status once it has ended (or as it stands after `timeout`)."""
    give_up = time.monotonic() + timeout
    while not job_status(stack, job_id).is_terminal and time.monotonic() < give_up:
        time.sleep(0.05)
    return job_status(stack, job_id)


def test_unary_completion_equals_the_http_api(client, stack):
    request = pb.CompletionsRequest(
        model_id=MODEL, prompt=PROMPT, num_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    reply = client.stub.CreateCompletion(request, metadata=metadata(), timeout=30)
    with http(stack) as api:
        body = api.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 2,
            },
        ).json()
    [choice] = reply.choices
    assert choice.text == body["choices"][0]["text"]
    assert choice.finish_reason == body["choices"][0]["finish_reason"]
    assert [lp.token for lp in choice.logprobs] == body["choices"][0]["logprobs"]["tokens"]
    assert len(choice.logprobs[0].top_logprobs) == 2
    assert reply.usage.completion_tokens == body["usage"]["completion_tokens"]
    assert reply.usage.prompt_tokens == body["usage"]["prompt_tokens"]
    assert reply.job_id.startswith("job_") and reply.model_id == MODEL


def test_chat_completion_equals_the_http_api(client, stack):
    messages = [{"role": "user", "content": "two plus two"}]
    reply = client.stub.CreateChatCompletion(
        pb.ChatCompletionsRequest(
            model_id=MODEL, messages=[pb.ChatMessage(**m) for m in messages], temperature=0
        ),
        metadata=metadata(),
        timeout=30,
    )
    with http(stack) as api:
        body = api.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0}
        ).json()
    assert reply.choices[0].text == body["choices"][0]["message"]["content"]
    assert reply.usage.total_tokens == body["usage"]["total_tokens"]


def test_stream_equals_the_unary_answer_chunk_by_chunk(client, stack):
    request = pb.CompletionsRequest(model_id=MODEL, prompt=PROMPT, num_tokens=6, temperature=0)
    unary = client.stub.CreateCompletion(request, metadata=metadata(), timeout=30)
    chunks = list(
        client.stub.StreamCompletion(
            pb.StreamCompletionRequest(completion=request), metadata=metadata(), timeout=30
        )
    )
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == unary.choices[0].text
    assert [t for c in chunks for t in c.token_ids] == list(unary.choices[0].token_ids)
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == unary.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    with http(stack) as api:
        job = api.post(
            "/v1/jobs",
            json={"model": MODEL, "prompt": PROMPT, "stream": True, "sampling": {"max_tokens": 6}},
        ).json()
        events = sse_events(api.get(f"/v1/jobs/{job['id']}/stream"))
    over_http = [json.loads(e.data) for e in events if e.event == "chunk"]
    assert [(c["index"], c["text"]) for c in over_http] == [(c.index, c.text) for c in chunks]


def test_a_dropped_stream_resumes_with_every_chunk_exactly_once(slow_client, stack):
    request = pb.CompletionsRequest(
        model_id=MODEL, prompt=PROMPT, num_tokens=9, temperature=0, keep_running=True
    )
    first = slow_client.stub.StreamCompletion(
        pb.StreamCompletionRequest(completion=request), metadata=metadata(), timeout=30
    )
    seen = [next(first), next(first)]
    first.cancel()  # the connection drops
    job_id = seen[0].job_id
    assert job_status(stack, job_id) is JobStatus.RUNNING  # it keeps running
    rest = list(
        slow_client.stub.StreamCompletion(
            pb.StreamCompletionRequest(job_id=job_id, after_chunk=seen[-1].index),
            metadata=metadata(),
            timeout=30,
        )
    )
    chunks = seen + rest
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].final
    whole = slow_client.stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=metadata())
    assert whole.status == "succeeded"
    assert "".join(c.text for c in chunks) == whole.choices[0].text == " ".join(PROMPT.split()[:9])
    again = list(
        slow_client.stub.StreamCompletion(
            pb.StreamCompletionRequest(job_id=job_id), metadata=metadata(), timeout=30
        )
    )
    assert [(c.index, c.text) for c in again] == [(c.index, c.text) for c in chunks]


def test_a_client_that_cancels_mid_stream_cancels_its_job(slow_client, stack):
    request = pb.CompletionsRequest(model_id=MODEL, prompt=PROMPT, num_tokens=9)
    call = slow_client.stub.StreamCompletion(
        pb.StreamCompletionRequest(completion=request), metadata=metadata(), timeout=30
    )
    job_id = next(call).job_id
    call.cancel()
    with pytest.raises(grpc.RpcError) as failed:
        next(call)
    assert failed.value.code() is grpc.StatusCode.CANCELLED
    assert wait_status(stack, job_id) is JobStatus.CANCELLED


def test_a_deadline_that_passes_cancels_the_job(slow_client, stack):
    with pytest.raises(grpc.RpcError) as failed:
        slow_client.stub.CreateCompletion(
            pb.CompletionsRequest(model_id=MODEL, prompt=PROMPT, num_tokens=9),
            metadata=metadata(),
            timeout=0.7,
        )
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        [job_key] = redis.scan_iter(KEYS.job_key_prefix() + "*")
    job_id = job_key.removeprefix(KEYS.job_key_prefix())
    assert wait_status(stack, job_id) in (JobStatus.CANCELLED, JobStatus.FAILED)


def test_a_job_cancelled_meanwhile_ends_the_call_with_cancelled(slow_client, stack):
    request = pb.CompletionsRequest(model_id=MODEL, prompt=PROMPT, num_tokens=9, keep_running=True)
    stream = slow_client.stub.StreamCompletion(
        pb.StreamCompletionRequest(completion=request), metadata=metadata(), timeout=30
    )
    job_id = next(stream).job_id
    cancelled = slow_client.stub.CancelJob(pb.CancelJobRequest(job_id=job_id), metadata=metadata())
    assert cancelled.status == "cancelled" and cancelled.error.code == "cancelled"
    with pytest.raises(grpc.RpcError) as failed:
        list(stream)
    assert failed.value.code() is grpc.StatusCode.CANCELLED


def test_list_models_health_and_reflection_answer(client):
    models = client.stub.ListModels(pb.ListModelsRequest(), metadata=metadata()).models
    assert [m.id for m in models] == [MODEL] and models[0].workers == 1
    health = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", SERVICE_NAME):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    [listed] = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
    [described] = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)]),
        timeout=5,
    )
    assert described.file_descriptor_response.file_descriptor_proto


def test_concurrent_calls_each_get_their_own_answer(client):
    prompts = [f"call {i} says hello" for i in range(6)]
    answers: dict[str, str] = {}

    def call(prompt: str) -> None:
        reply = client.stub.CreateCompletion(
            pb.CompletionsRequest(model_id=MODEL, prompt=prompt, num_tokens=8),
            metadata=metadata(),
            timeout=30,
        )
        answers[prompt] = reply.choices[0].text

    threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {p: p for p in prompts}
