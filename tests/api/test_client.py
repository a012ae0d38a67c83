"""`producer_api.client`: Client / AsyncClient over HTTP and over Redis, same methods, same
results; HTTP streams resume after the connection drops."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest
import redis as sync_redis

from producer_api.client import AsyncClient, Client, JobNotFoundError, QueueError, transport_of
from schemas import ErrorCode, JobRequest, JobStatus
from tests.api.conftest import ALICE_KEY, BOB_KEY, KEYS, MODEL
from tests.api.echo_worker import echo_output

PROMPT = " ".join(f"word{i}" for i in range(12))


def request(**fields) -> JobRequest:
    return JobRequest(
        model=MODEL, prompt=PROMPT, stream=True, sampling={"max_tokens": 12}, **fields
    )


@pytest.fixture(params=["http", "redis"])
def client_url(request, stack):
    api = stack.api()
    stack.worker(step_delay_s=0.01)
    if request.param == "http":
        return {"url": api.url, "api_key": ALICE_KEY}
    return {"url": stack.redis_url, "owner": "alice"}


def test_sync_client_enqueue_stream_wait_get(client_url):
    with Client(**client_url, poll_interval=0.2) as client:
        job = client.enqueue(request())
        assert job.status is JobStatus.QUEUED and job.model == MODEL
        chunks = list(client.stream(job.id))
        done = client.wait(job.id, timeout=10)
        assert client.get(job.id).status is JobStatus.SUCCEEDED
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == echo_output(request()).text
    assert done.status is JobStatus.SUCCEEDED
    assert done.result.choices[0].text == echo_output(request()).text


@pytest.mark.anyio
async def test_async_client_run_and_cancel(client_url):
    async with AsyncClient(**client_url, poll_interval=0.2) as client:
        finished = await client.run(request(), timeout=10)
        assert finished.result.choices[0].text == echo_output(request()).text
        later = await client.enqueue(model=MODEL, prompt="x " * 200, sampling={"max_tokens": 200})
        cancelled = await client.cancel(later.id)
        assert cancelled.status is JobStatus.CANCELLED
        with pytest.raises(JobNotFoundError):
            await client.get("job_" + "A" * 22)
        resumed = [c async for c in client.stream(finished.id, last_index=3)]
        assert resumed[0].index == 4


@pytest.mark.anyio
async def test_sync_client_inside_a_running_event_loop(client_url):
    with Client(**client_url, poll_interval=0.2) as client:
        done = client.run(request(), timeout=10)
        chunks = list(client.stream(done.id))
    assert done.result.choices[0].text == echo_output(request()).text
    assert "".join(c.text for c in chunks) == done.result.choices[0].text


def client_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "inferq-client"}


def test_streams_close_when_abandoned_or_with_their_client(stack):
    stack.worker(step_delay_s=0.2)
    probe = sync_redis.Redis.from_url(stack.redis_url)
    others = client_threads()
    client = Client(stack.redis_url, poll_interval=0.2)
    job = client.enqueue(request())
    channel = KEYS.channel(job.id)
    chunks = client.stream(job.id)
    next(chunks)
    assert probe.pubsub_numsub(channel) == [(channel.encode(), 1)]
    del chunks
    assert probe.pubsub_numsub(channel) == [(channel.encode(), 0)]
    kept = client.stream(job.id)
    next(kept)
    (thread,) = client_threads() - others
    client.close()
    assert probe.pubsub_numsub(channel) == [(channel.encode(), 0)]
    assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        next(kept)
    probe.close()


def test_an_unclosed_client_ends_its_thread_once_collected(redis_url):
    others = client_threads()
    client = Client(redis_url)
    client.enqueue(model=MODEL, prompt="fire and forget")
    (thread,) = client_threads() - others
    del client
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    with pytest.raises(ValueError):
        Client("ftp://example.com")  # refused before any thread starts
    assert client_threads() <= others


def test_http_client_keys_are_isolated(stack):
    api = stack.api()
    with Client(api.url, api_key=ALICE_KEY) as alice, Client(api.url, api_key=BOB_KEY) as bob:
        job = alice.enqueue(request())
        with pytest.raises(JobNotFoundError):
            bob.get(job.id)
        with pytest.raises(QueueError) as caught:
            Client(api.url).enqueue(request())
        assert caught.value.code is ErrorCode.UNAUTHORIZED


def test_http_queue_full_error_carries_retry_after(stack):
    api = stack.api(queue_limits={MODEL: 1}, retry_after_s=4)
    with Client(api.url, api_key=ALICE_KEY) as client:
        client.enqueue(request())
        with pytest.raises(QueueError) as caught:
            client.enqueue(request())
    assert caught.value.code is ErrorCode.QUEUE_FULL
    assert caught.value.retry_after == 4


class DroppingProxy:
    """TCP proxy to the API that cuts the first event-stream connection after `cut_after` bytes
    of response, like a flaky network or a restarting load balancer."""

    def __init__(self, upstream_port: int, cut_after: int) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.cuts = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        state = {"cutting": False, "sent": 0}  # the connection may carry several requests

        async def upstream() -> None:
            while data := await reader.read(65536):
                if b"/stream" in data and self.cuts == 0:
                    self.cuts += 1
                    state.update(cutting=True, sent=0)
                up_writer.write(data)

        async def downstream() -> None:
            while data := await up_reader.read(256):
                if state["cutting"] and state["sent"] + len(data) > self.cut_after:
                    writer.write(data[: self.cut_after - state["sent"]])
                    return
                writer.write(data)
                state["sent"] += len(data)
                await writer.drain()

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        writer.close()
        up_writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def test_http_stream_resumes_after_a_dropped_connection(stack):
    api = stack.api()
    stack.worker(step_delay_s=0.05)
    proxy = DroppingProxy(api.port, cut_after=700)  # headers plus a few chunk events
    port = stack.bg.run(proxy.start())
    try:
        with Client(f"http://127.0.0.1:{port}", api_key=ALICE_KEY) as client:
            job = client.enqueue(request())
            chunks = list(client.stream(job.id))
    finally:
        stack.bg.run(proxy.stop())
    assert proxy.cuts == 1
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) == echo_output(request()).text


def test_transport_follows_the_url_scheme():
    assert transport_of("https://api.example.com") == "http"
    assert transport_of("rediss://cache:6380/0") == "redis"
    with pytest.raises(ValueError):
        transport_of("ftp://x")


@pytest.mark.anyio
async def test_redis_client_wait_rides_out_a_redis_restart(redis_server):
    """A failover or restart drops the client's connection mid-wait; wait() reconnects and
    still answers within its timeout instead of raising."""
    client = AsyncClient(redis_server.url, max_retries=8)
    try:
        job = await client.enqueue(request())
        redis_server.kill()
        restarted = asyncio.get_running_loop().run_in_executor(
            None, lambda: (time.sleep(0.5), redis_server.start())
        )
        waited = await client.wait(job.id, timeout=4)
        await restarted
        assert waited.id == job.id
        assert waited.status == JobStatus.QUEUED  # no worker: it is still queued, not lost
        assert (await client.get(job.id)).id == job.id
    finally:
        await client.aclose()
