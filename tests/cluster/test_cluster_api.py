"""The HTTP API in cluster mode on a 3-primary Redis Cluster: its 429 admission limit counts the
backlog on every shard, a dead-lettered job shows as failed (and in /metrics and the dashboard's
data), and a streaming client reading through SSE while its worker is killed mid-stream sees
every chunk exactly once from the worker that takes over."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from cluster_helpers import MODEL, cluster_settings, kill_a_worker_once
from worker_fakes import FakeEngine, expected_output
from worker_harness import running_worker

from producer_api.client.http_client import SseParser
from producer_api.client.redis_client import AsyncRedisClient
from producer_api.queue import queue_length
from tests.api.conftest import ALICE_KEY, Stack, auth
from tests.api.conftest import stack as api_stack  # noqa: F401 (the API's fixture, on redis_url)
from tests.api.test_ops import samples

pytestmark = pytest.mark.anyio


@pytest.fixture
def redis_url(cluster_url: str) -> str:
    """The API stack's Redis: the cluster."""
    return cluster_url


def api_client(stack: Stack, **settings: object) -> httpx.AsyncClient:
    api = stack.api(redis_cluster=True, models=[MODEL], **settings)
    return httpx.AsyncClient(base_url=api.url, headers=auth(ALICE_KEY), timeout=30)


def job_body(first_token: int, max_tokens: int = 4) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt_token_ids": [first_token, 71, 72],
        "stream": True,
        "sampling": {"max_tokens": max_tokens},
    }


async def test_the_queue_limit_counts_every_shard(api_stack, cluster_url):  # noqa: F811
    async with api_client(api_stack, queue_limits={MODEL: 4}, retry_after_s=7) as http:
        accepted = [await http.post("/v1/jobs", json=job_body(80 + i)) for i in range(4)]
        assert [r.status_code for r in accepted] == [202] * 4
        refused = await http.post("/v1/jobs", json=job_body(90))
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "7"
        assert refused.json()["error"]["code"] == "queue_full"
        async with AsyncRedisClient(cluster_settings(cluster_url)) as client:
            keys = client.keys
            partitions = {keys.queue_stream(MODEL, 0, r.json()["id"]) for r in accepted}
            assert len(partitions) > 1  # the limit is the model's, not a partition's
            async with running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True):
                for response in accepted:
                    await client.wait(response.json()["id"], timeout=20)
                assert await queue_length(client.redis, keys, MODEL) == 0
        assert (await http.post("/v1/jobs", json=job_body(91))).status_code == 202


async def test_a_dead_lettered_job_shows_through_the_api(api_stack, cluster_url):  # noqa: F811
    async with (
        api_client(api_stack) as http,
        AsyncRedisClient(cluster_settings(cluster_url)) as client,
    ):
        poison = (await http.post("/v1/jobs", json=job_body(60))).json()
        good = (await http.post("/v1/jobs", json=job_body(61))).json()
        # three attempts already crashed a worker each
        await client.redis.hset(client.keys.job(poison["id"]), "attempts", "3")
        async with running_worker(cluster_url, FakeEngine(), model=MODEL, redis_cluster=True):
            done = (await http.get(f"/v1/jobs/{good['id']}/wait", params={"timeout": 20})).json()
            failed = await http.get(f"/v1/jobs/{poison['id']}/wait", params={"timeout": 20})
        assert done["status"] == "succeeded"
        failed = failed.json()
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "max_attempts_exceeded"
        metrics = samples((await http.get("/metrics")).text)
        assert metrics[("inferq_dead_letters", (("model", MODEL),))] == 1
        data = (await http.get("/dashboard/data")).json()
        (letters,) = data["dead_letters"]
        assert (letters["model"], letters["count"]) == (MODEL, 1)
        assert letters["last_reason"] == "max_attempts_exceeded"


async def least_chunks(client: AsyncRedisClient, job_ids: list[str], count: int) -> bool:
    """Whether every job has at least `count` chunks in its replay stream."""
    for job_id in job_ids:
        if await client.redis.xlen(client.keys.out_stream(job_id)) < count:
            return False
    return True


async def sse_chunks(http: httpx.AsyncClient, job_id: str) -> tuple[list[dict], dict]:
    """Every chunk event of one job's SSE stream, and its done event's data."""
    parser, chunks = SseParser(), []
    async with http.stream("GET", f"/v1/jobs/{job_id}/stream") as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            event = parser.feed(line)
            if event is None:
                continue
            if event.event == "chunk":
                chunks.append(json.loads(event.data))
                assert int(event.id) == chunks[-1]["index"]
            elif event.event == "done":
                return chunks, json.loads(event.data)
    raise AssertionError(f"{job_id}: the stream ended without a done event")


async def test_an_sse_reader_sees_each_chunk_once_across_a_worker_kill(api_stack, cluster_url):  # noqa: F811
    max_tokens = 40
    async with (
        api_client(api_stack) as http,
        AsyncRedisClient(cluster_settings(cluster_url)) as client,
    ):
        bodies = [job_body(30 + i, max_tokens) for i in range(6)]
        created = [(await http.post("/v1/jobs", json=body)).json()["id"] for body in bodies]
        readers = [asyncio.create_task(sse_chunks(http, job_id)) for job_id in created]
        await kill_a_worker_once(cluster_url, lambda: least_chunks(client, created, 5))
        assert not await least_chunks(client, created, max_tokens)  # killed mid-generation
        assert not any(reader.done() for reader in readers)
        async with running_worker(
            cluster_url, FakeEngine(), model=MODEL, name="rescuer", redis_cluster=True
        ):
            read = await asyncio.wait_for(asyncio.gather(*readers), 60)
    for body, (chunks, done) in zip(bodies, read, strict=True):
        ids, text = expected_output(body["prompt_token_ids"], max_tokens)
        assert [c["index"] for c in chunks] == list(range(len(chunks)))
        assert [t for c in chunks for t in c["token_ids"]] == ids
        assert "".join(c["text"] for c in chunks) == text
        assert done["status"] == "succeeded" and done["worker"] == "rescuer"
        assert done["attempts"] == 2
        assert done["result"]["choices"][0]["text"] == text
