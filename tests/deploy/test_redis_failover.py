"""A Redis master failover under load: one master, one replica, three Sentinels (real
processes on free ports), the API and a worker on the default model, both configured with the
Sentinels. 40 streaming jobs run (half from the HTTP client, half from the Python client
straight on Redis) when the master is SIGKILLed; the Sentinels promote the replica.

Every job acknowledged to its client finishes, every stream gives chunks 0..n once each with
the text of the result, no process is restarted, and while no master answers the API says 503
with Retry-After (never another 5xx, never a hang)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from real_stack import free_port, start_api, stop, wait_ready
from worker_harness import start_worker_process, stop_process

from bench.availability.sentinel_cluster import MASTER_NAME, SentinelCluster, ask, redis_binary
from producer_api.client import AsyncClient, RedisConnectionSettings
from schemas import DEFAULT_PREFIX, Job, JobStatus, RedisKeys, TokenChunk

pytestmark = [pytest.mark.slow, pytest.mark.anyio]

MODEL = "SmolLM2-135M-Instruct"
JOBS_PER_CLIENT = 20
MAX_TOKENS = 24
PROBE_TIMEOUT_S = 10.0  # an API call slower than this is a hang
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0}


@dataclass
class Probe:
    """POST /v1/jobs every 50 ms across the failover: what the API answered, and when."""

    codes: list[int] = field(default_factory=list)
    retry_after_missing: int = 0
    accepted: list[tuple[float, str]] = field(default_factory=list)  # (monotonic, job id)

    async def run(self, http: httpx.AsyncClient, stop_at: asyncio.Event) -> None:
        while not stop_at.is_set():
            body = {"model": MODEL, "prompt": "probe", "stream": True, "sampling": SAMPLING}
            response = await http.post("/v1/jobs", json=body, timeout=PROBE_TIMEOUT_S)
            self.codes.append(response.status_code)
            if response.status_code == 503 and "retry-after" not in response.headers:
                self.retry_after_missing += 1
            if response.status_code in (200, 201, 202):
                self.accepted.append((time.monotonic(), response.json()["id"]))
            await asyncio.sleep(0.05)


async def _collect(client: AsyncClient, job_id: str) -> list[TokenChunk]:
    return [chunk async for chunk in client.stream(job_id)]


def _check_stream(job: Job, chunks: list[TokenChunk]) -> None:
    assert job.status is JobStatus.SUCCEEDED, (job.id, job.status, job.error)
    assert [c.index for c in chunks] == list(range(len(chunks))), job.id
    assert chunks[-1].final and not any(c.final for c in chunks[:-1])
    choice = job.result.choices[0]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids


@pytest.fixture
def cluster(tmp_path: Path):
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not found")
    cluster = SentinelCluster(tmp_path / "redis", binary)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("run", [1, 2, 3])
async def test_master_failover_loses_no_job_and_no_chunk(cluster: SentinelCluster, run: int):
    env = cluster.env(wait_replicas=1)
    master_url = env["INFERQ_REDIS_URL"]
    worker = start_worker_process(master_url, fake=False, model=MODEL, extra_env=env)
    port = free_port()
    api = start_api(master_url, port, extra_env={**env, "INFERQ_RETRY_AFTER_S": "1"})
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, [worker, api])
        where = RedisConnectionSettings(
            redis_sentinels=cluster.sentinels, redis_master_name=MASTER_NAME, redis_wait_replicas=1
        )
        async with (
            AsyncClient(base_url, max_retries=50) as over_http,
            AsyncClient(where, max_retries=50) as over_redis,
            httpx.AsyncClient(base_url=base_url) as http,
        ):
            jobs: list[tuple[AsyncClient, Job]] = []
            for i in range(JOBS_PER_CLIENT):
                for client in (over_http, over_redis):
                    prompt = f"Count slowly from {i} to {i + 30}:"
                    job = await client.enqueue(
                        model=MODEL, prompt=prompt, stream=True, sampling=SAMPLING
                    )
                    jobs.append((client, job))
            streams = [asyncio.create_task(_collect(client, job.id)) for client, job in jobs]
            # mid-run: some jobs have output on the replay streams, none is finished
            await _until(lambda: _chunks_seen(cluster, jobs) >= 5, 120)
            probe, stop_probe = Probe(), asyncio.Event()
            probing = asyncio.create_task(probe.run(http, stop_probe))
            await asyncio.sleep(0.3)
            killed_at = time.monotonic()
            cluster.kill_master()
            promoted_s = await asyncio.to_thread(cluster.wait_promoted)
            await _until(lambda: any(t > killed_at for t, _ in probe.accepted), 60)
            stop_probe.set()
            await asyncio.wait_for(probing, PROBE_TIMEOUT_S + 5)
            results = await asyncio.wait_for(asyncio.gather(*streams), 600)
            for (client, job), chunks in zip(jobs, results, strict=True):
                _check_stream(await client.get(job.id), chunks)
            for _, job_id in probe.accepted:  # acknowledged during the switch: they finish too
                done = await over_redis.wait(job_id, timeout=300)
                assert done.status is JobStatus.SUCCEEDED, (job_id, done.status)
        first_accept = min(t for t, _ in probe.accepted if t > killed_at) - killed_at
        print(
            f"\nrun {run}: replica promoted {promoted_s:.1f} s after the kill; first job "
            f"accepted after {first_accept:.1f} s; API answers {sorted(set(probe.codes))}"
        )
        assert set(probe.codes) <= {202, 503}, probe.codes
        assert 503 in probe.codes  # the switch was seen, and answered as it should be
        assert probe.retry_after_missing == 0
        assert worker.poll() is None and api.poll() is None  # nothing restarted
    finally:
        stop(api)
        stop_process(worker)


def _chunks_seen(cluster: SentinelCluster, jobs: list[tuple[AsyncClient, Job]]) -> int:
    """How many of the jobs have a chunk on the master (asked without a client library)."""
    keys = RedisKeys(DEFAULT_PREFIX)
    reply = ask(cluster.master_port, "EXISTS", *(keys.out_stream(job.id) for _, job in jobs))
    return int(reply[1:].strip() or 0) if reply.startswith(":") else 0


async def _until(condition, timeout: float) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.05)
