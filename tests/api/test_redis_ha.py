"""The producers' side of Redis high availability: clients built from Sentinel settings reach
the master the Sentinels name, an enqueue with a replica count is on the replica when it
returns, and the API answers 503 + Retry-After while no master is known."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.sentinel import SentinelConnectionPool

from bench.availability.sentinel_cluster import (
    MASTER_NAME,
    SentinelCluster,
    free_port,
    redis_binary,
)
from producer_api.client import AsyncClient
from redis_io.clients import redis_client
from schemas import DEFAULT_PREFIX, RedisKeys
from schemas.redis_connection import RedisConnectionSettings
from tests.api.conftest import MODEL, auth

pytestmark = pytest.mark.anyio
KEYS = RedisKeys(DEFAULT_PREFIX)


@pytest.fixture
def replicated(tmp_path: Path):
    """A master and its replica (no Sentinels)."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found")
    pair = SentinelCluster(tmp_path / "redis", binary, sentinel_count=1)
    pair.start(sentinels=False)
    yield pair
    pair.stop()


async def test_sentinel_settings_build_a_client_of_the_named_master_with_the_urls_login():
    settings = RedisConnectionSettings(
        redis_url="redis://:pw@ignored:1/4", redis_sentinels="127.0.0.1:1", redis_master_name="m"
    )
    client = redis_client(settings)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "m"
    assert pool.connection_kwargs["db"] == 4 and pool.connection_kwargs["password"] == "pw"
    await client.aclose()


async def test_a_plain_url_builds_a_plain_client(redis_url):
    client = redis_client(RedisConnectionSettings(redis_url=redis_url))
    assert not isinstance(client.connection_pool, SentinelConnectionPool)
    assert await client.ping()
    await client.aclose()


async def test_no_master_known_is_503_with_retry_after_never_a_hang(stack):
    api = stack.api(redis_sentinels=f"127.0.0.1:{free_port()}", retry_after_s=3)
    with httpx.Client(base_url=api.url, headers=auth(), timeout=10) as http:
        created = http.post("/v1/jobs", json={"model": MODEL, "prompt": "hi"})
        read = http.get("/v1/jobs/job_AAAAAAAAAAAAAAAAAAAAAA")
    for response in (created, read):
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "3"
        assert response.json()["error"]["code"] == "unavailable"


async def test_an_enqueue_that_waits_for_a_replica_is_on_the_replica_when_it_returns(replicated):
    where = RedisConnectionSettings(
        redis_url=f"redis://127.0.0.1:{replicated.master_port}/0", redis_wait_replicas=1
    )
    replica = Redis(port=replicated.replica_port, decode_responses=True)
    async with AsyncClient(where) as client:
        for _ in range(20):
            job = await client.enqueue(model=MODEL, prompt="keep me")
            assert await replica.hget(KEYS.job(job.id), "status") == "queued"
    await replica.aclose()


async def test_an_enqueue_without_a_reachable_replica_is_answered_after_the_timeout(
    redis_url, caplog
):
    where = RedisConnectionSettings(
        redis_url=redis_url, redis_wait_replicas=1, redis_wait_timeout_ms=50
    )
    async with AsyncClient(where) as client:
        job = await client.enqueue(model=MODEL, prompt="on the master alone")
        assert (await client.get(job.id)).status.value == "queued"
    assert "only 0 of 1 replicas acknowledged within 50 ms" in caplog.text


async def test_clients_reach_the_master_a_sentinel_names(tmp_path: Path):
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found")
    cluster = SentinelCluster(tmp_path / "redis", binary, sentinel_count=1)
    cluster.start(sentinels=False)
    try:
        cluster.start_sentinels(wait_for_peers=False)
        where = RedisConnectionSettings(
            redis_sentinels=cluster.sentinels, redis_master_name=MASTER_NAME
        )
        async with AsyncClient(where) as client:
            job = await client.enqueue(model=MODEL, prompt="through a sentinel")
        master = Redis(port=cluster.master_port, decode_responses=True)
        assert await master.exists(KEYS.job(job.id))
        await master.aclose()
    finally:
        cluster.stop()
