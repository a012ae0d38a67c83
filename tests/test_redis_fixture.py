"""The Redis test fixtures: a real server that keeps its data across stop/kill and restart."""

from __future__ import annotations

import os

import pytest
import redis


def _write_sample(client: redis.Redis) -> str:
    client.set("greeting", "hello")
    client.hset("job:1", mapping={"status": "queued", "attempts": "0"})
    return client.xadd("jobs:m", {"job": "job_1"})


def _assert_sample(client: redis.Redis, entry_id: str) -> None:
    assert client.get("greeting") == "hello"
    assert client.hgetall("job:1") == {"status": "queued", "attempts": "0"}
    assert client.xrange("jobs:m") == [(entry_id, {"job": "job_1"})]


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_data_survives_restart(redis_server, how):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    entry_id = _write_sample(client)
    client.close()
    port = redis_server.port

    getattr(redis_server, how)()
    assert not redis_server.running
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(redis_server.url, socket_connect_timeout=1).ping()

    redis_server.start()
    assert redis_server.port == port
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    _assert_sample(client, entry_id)
    client.close()


def test_server_process_is_gone_after_the_test(redis_server):
    pid = redis_server.process.pid
    redis_server.kill()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_shared_server_is_flushed_per_test(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.dbsize() == 0
    client.set("left-behind", "1")
    client.close()


def test_shared_server_is_flushed_per_test_again(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.dbsize() == 0
    client.close()


def test_fake_redis_sync(fake_redis_sync):
    entry_id = fake_redis_sync.xadd("s", {"job": "x"})
    assert fake_redis_sync.xrange("s") == [(entry_id, {"job": "x"})]


@pytest.mark.anyio
async def test_fake_redis_async(fake_redis):
    await fake_redis.hset("h", mapping={"a": "1"})
    assert await fake_redis.hgetall("h") == {"a": "1"}
