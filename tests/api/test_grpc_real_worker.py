"""The gRPC service against the real system: a real Redis, a real worker process on the default
model, the HTTP API and the gRPC server side by side. Greedy answers over gRPC equal the HTTP
API's, the issue's example request runs as written, and a call ended by its deadline or by the
client frees the job's KV blocks in the worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
import pytest
from redis import Redis

from producer_api.grpc.stubs import inference_pb2, inference_pb2_grpc
from schemas import WorkerInfo
from tests.api.conftest import Stack, auth
from tests.api.grpc_stack import GrpcClient, grpc_server
from tests.api.real_worker import real_worker_stack

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12
READY_TIMEOUT_S = 300
FREED_TIMEOUT_S = 20

pytestmark = [pytest.mark.slow, pytest.mark.model]


@contextmanager
def real_system(
    tmp_path_factory: pytest.TempPathFactory, *extra_args: str
) -> Iterator[tuple[Stack, GrpcClient]]:
    """Redis, a real worker on the default model (plus `extra_args`), the HTTP API and the
    gRPC server, up and ready."""
    worker_args = ("--max-model-len", str(MAX_MODEL_LEN), "--heartbeat-interval-s", "0.5")
    # gRPC as `inferq up` runs it on localhost: without keys (the issue's example sends none)
    with (
        real_worker_stack(tmp_path_factory, MODEL, *worker_args, *extra_args) as stack,
        grpc_server(stack, models=[], api_keys={}, auth_disabled=True) as client,
    ):
        yield stack, client


@pytest.fixture(scope="module")
def system(tmp_path_factory) -> Iterator[tuple[Stack, GrpcClient]]:
    with real_system(tmp_path_factory) as running:
        yield running


def http_completion(stack: Stack, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=120) as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_unary_and_stream_equal_the_http_api(system):
    stack, client = system
    for prompt in PROMPTS:
        over_http = http_completion(stack, prompt)
        request = inference_pb2.CompletionsRequest(
            model_id=MODEL, prompt=prompt, num_tokens=MAX_TOKENS, temperature=0
        )
        unary = client.stub.CreateCompletion(request, timeout=120)
        assert unary.choices[0].text == over_http["choices"][0]["text"]
        assert unary.choices[0].finish_reason == over_http["choices"][0]["finish_reason"]
        assert unary.usage.prompt_tokens == over_http["usage"]["prompt_tokens"]
        assert unary.usage.completion_tokens == over_http["usage"]["completion_tokens"]
        chunks = list(
            client.stub.StreamCompletion(
                inference_pb2.StreamCompletionRequest(completion=request), timeout=120
            )
        )
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert "".join(c.text for c in chunks) == over_http["choices"][0]["text"]
        assert [t for c in chunks for t in c.token_ids] == list(unary.choices[0].token_ids)
        assert chunks[-1].final and chunks[-1].usage.completion_tokens == len(
            unary.choices[0].token_ids
        )


def test_greedy_chat_equals_the_http_api(system):
    stack, client = system
    messages = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=stack.servers[0].url, headers=auth(), timeout=120) as http:
        over_http = http.post("/v1/chat/completions", json=body).json()
    reply = client.stub.CreateChatCompletion(
        inference_pb2.ChatCompletionsRequest(
            model_id=MODEL,
            messages=[inference_pb2.ChatMessage(**m) for m in messages],
            num_tokens=MAX_TOKENS,
            temperature=0,
        ),
        timeout=120,
    )
    assert reply.choices[0].text == over_http["choices"][0]["message"]["content"]
    assert reply.usage.total_tokens == over_http["usage"]["total_tokens"]


def test_the_issues_example_request_works_as_written(system):
    _, client = system
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(f"localhost:{client.port}"))
    resp = stub.CreateCompletion(inference_pb2.CompletionsRequest(
        prompt="The quick brown fox jumps over the lazy", num_tokens=10, temperature=0.7,
        top_p=0.9, stop_sequences=["\n"], model_id="SmolLM2-135M-Instruct"))  # fmt: skip
    [choice] = resp.choices
    assert choice.finish_reason in ("stop", "length")
    assert "\n" not in choice.text
    assert 1 <= resp.usage.completion_tokens <= 10
    assert resp.job_id.startswith("job_")


def worker_load(stack: Stack) -> WorkerInfo:
    with Redis.from_url(stack.redis_url, decode_responses=True) as redis:
        [name] = redis.scan_iter("inferq:worker:*")
        return WorkerInfo.from_redis_hash(redis.hgetall(name))


def wait_freed(stack: Stack) -> WorkerInfo:
    """The worker's heartbeat once it runs nothing and every KV block is free again."""
    give_up = time.monotonic() + FREED_TIMEOUT_S
    while True:
        load = worker_load(stack)
        if load.running == 0 and load.kv_blocks_free == load.kv_blocks_total:
            return load
        assert time.monotonic() < give_up, load
        time.sleep(0.2)


# Long enough to outlast DEADLINE_S on the fastest CPU we get (about 7 ms a token), within
# the worker's 512-token context.
LONG = inference_pb2.CompletionsRequest(
    model_id=MODEL, prompt="Count slowly:", num_tokens=480, ignore_eos=True, temperature=0
)
DEADLINE_S = 1.5


def wait_running(stack: Stack) -> None:
    give_up = time.monotonic() + FREED_TIMEOUT_S
    while worker_load(stack).running == 0:
        assert time.monotonic() < give_up
        time.sleep(0.1)


def test_a_deadline_frees_the_jobs_blocks(system):
    stack, client = system
    wait_freed(stack)
    with pytest.raises(grpc.RpcError) as failed:
        client.stub.CreateCompletion(LONG, timeout=DEADLINE_S)
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_freed(stack)


def test_a_client_cancel_mid_stream_frees_the_jobs_blocks(system):
    stack, client = system
    wait_freed(stack)
    call = client.stub.StreamCompletion(
        inference_pb2.StreamCompletionRequest(completion=LONG), timeout=120
    )
    first = next(call)
    wait_running(stack)
    call.cancel()
    wait_freed(stack)
    job = client.stub.GetJob(inference_pb2.GetJobRequest(job_id=first.job_id), timeout=10)
    assert job.status == "cancelled"
