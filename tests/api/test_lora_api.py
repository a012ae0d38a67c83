"""LoRA adapters through the API, with echo workers that advertise adapters: a request whose
model names an adapter is queued on its base model with the adapter in the job, on every
route; /v1/models lists adapters with their parent; an unknown adapter is a 404 before anything
is queued; run-time loading is off unless allowed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from producer_api.queue import queue_length
from tests.api.conftest import KEYS, MODEL, Stack, auth

ADAPTERS = ["sql-lora", "chat-lora"]


@pytest.fixture
def served(stack: Stack):
    api = stack.api()
    worker = stack.worker(lora_adapters=ADAPTERS)
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        yield http, worker


def test_models_list_each_adapter_with_its_parent(served):
    http, _worker = served
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL, *ADAPTERS}
    assert cards[MODEL]["parent"] is None
    for name in ADAPTERS:
        assert cards[name]["parent"] == cards[name]["root"] == MODEL
        assert cards[name]["workers"] == 1
    assert http.get("/v1/models/sql-lora").json()["parent"] == MODEL


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "one two three", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"prompt": "one two", "max_tokens": 3}),
        ("/v1/jobs", {"prompt": "one two", "sampling": {"max_tokens": 3}}),
    ],
)
def test_a_request_for_an_adapter_runs_on_its_base_model_with_it(served, path, body):
    http, worker = served
    response = http.post(path, json={**body, "model": "sql-lora"})
    assert response.status_code in (200, 202), response.text
    if path == "/v1/jobs":
        job = response.json()
        assert (job["request"]["model"], job["request"]["lora"]) == (MODEL, "sql-lora")
        done = http.get(f"/v1/jobs/{job['id']}/wait", params={"timeout": 10}).json()
        assert done["status"] == "succeeded"
    assert worker.loras == ["sql-lora"]


def test_the_jobs_api_takes_an_adapter_of_the_base_model_by_lora(served):
    http, worker = served
    body = {"model": MODEL, "lora": "chat-lora", "prompt": "a b", "sampling": {"max_tokens": 2}}
    job = http.post("/v1/jobs", json=body).json()
    assert http.get(f"/v1/jobs/{job['id']}/wait", params={"timeout": 10}).json()["status"] == (
        "succeeded"
    )
    assert worker.loras == ["chat-lora"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "no-lora", "prompt": "x"}, "model"),
        ("/v1/chat/completions", {"model": "no-lora", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ("/v1/jobs", {"model": MODEL, "lora": "no-lora", "prompt": "x"}, "lora"),
    ],
)  # fmt: skip
def test_an_unknown_adapter_is_404_and_nothing_is_queued(stack: Stack, path, body, param):
    api = stack.api()
    stack.heartbeat()  # a live worker of the base model that takes nothing
    stack.bg.run(_advertise(stack, ADAPTERS))
    with httpx.Client(base_url=api.url, headers=auth(), timeout=30) as http:
        response = http.post(path, json=body)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == param
    assert stack.bg.run(_queued(stack)) == 0


def test_run_time_loading_is_off_unless_allowed(served):
    http, _worker = served
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp/x"}),
        ("/v1/unload_lora_adapter", {"lora_name": "sql-lora"}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 403, response.text


async def _advertise(stack: Stack, adapters: list[str]) -> None:
    from redis.asyncio import Redis

    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        await redis.hset(
            KEYS.worker("idle-worker"), "lora_adapters", str(adapters).replace("'", '"')
        )
    finally:
        await redis.aclose()


async def _queued(stack: Stack) -> int:
    from redis.asyncio import Redis

    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        await asyncio.sleep(0)
        return await queue_length(redis, KEYS, MODEL)
    finally:
        await redis.aclose()


def test_grpc_completions_on_an_adapter_run_on_its_base_model(stack: Stack):
    import grpc

    from producer_api.grpc.stubs import inference_pb2 as pb
    from tests.api.grpc_stack import grpc_server, metadata

    stack.api()
    worker = stack.worker(lora_adapters=ADAPTERS)
    with grpc_server(stack) as client:
        request = pb.CompletionsRequest(model_id="chat-lora", prompt="a b c", num_tokens=3)
        reply = client.stub.CreateCompletion(request, metadata=metadata(), timeout=30)
        assert reply.choices[0].text
        with pytest.raises(grpc.RpcError) as error:
            unknown = pb.CompletionsRequest(model_id="no-lora", prompt="a b c", num_tokens=3)
            client.stub.CreateCompletion(unknown, metadata=metadata(), timeout=30)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # model_not_found's status
    assert worker.loras == ["chat-lora"]
