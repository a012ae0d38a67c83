"""The Batch API on a 3-primary Redis Cluster: the API, the batch controller and a worker in
cluster mode; the controller's own arq queue on a plain Redis (`redis_batch_queue_url`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from arq.connections import RedisSettings
from arq.worker import Worker as ArqWorker
from redis import Redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch"))

from producer_api.batches import controller
from redis_io.clients import redis_client
from schemas.redis_connection import RedisConnectionSettings
from tests.api.conftest import BackgroundLoop
from tests.batch.conftest import FAKE_MODEL, FAST_CONTROLLER_ENV, BatchStack
from tests.batch.test_batch_api import completion_line, expected_text


class ClusterBatchStack(BatchStack):
    """BatchStack whose arq controller uses the plain queue Redis, not the cluster."""

    def __init__(self, cluster_url: str, queue_url: str, bg: BackgroundLoop) -> None:
        super().__init__(cluster_url, bg)
        self.queue_url = queue_url

    def start_controller(self) -> None:
        settings = controller.WorkerSettings

        async def make() -> ArqWorker:
            return ArqWorker(
                functions=settings.functions,
                cron_jobs=settings.cron_jobs,
                on_startup=settings.on_startup,
                on_shutdown=settings.on_shutdown,
                redis_settings=RedisSettings.from_dsn(self.queue_url),
                queue_name=settings.queue_name,
                max_tries=settings.max_tries,
                job_timeout=settings.job_timeout,
                poll_delay=0.05,
                handle_signals=False,
            )

        worker = self.bg.run(make())
        self._arq = (worker, self.bg.start(worker.async_run()))


@pytest.fixture
def cluster_batch_stack(
    monkeypatch: pytest.MonkeyPatch, cluster_url: str, redis_url: str
) -> Iterator[ClusterBatchStack]:
    monkeypatch.setenv("INFERQ_REDIS_URL", cluster_url)
    monkeypatch.setenv("INFERQ_REDIS_CLUSTER", "true")
    monkeypatch.setenv("INFERQ_REDIS_BATCH_QUEUE_URL", redis_url)
    for name, value in FAST_CONTROLLER_ENV.items():
        monkeypatch.setenv(name, value)
    bg = BackgroundLoop()
    stack = ClusterBatchStack(cluster_url, redis_url, bg)
    try:
        yield stack
    finally:
        stack.close()
        bg.close()


def test_a_batch_completes_with_each_custom_id_once(cluster_batch_stack: ClusterBatchStack):
    stack = cluster_batch_stack
    prompts = {f"req-{i}": f"prompt number {i}" for i in range(30)}
    lines = [completion_line(cid, prompt) for cid, prompt in prompts.items()]
    lines.insert(3, "{this is not json")
    uploaded = stack.upload("\n".join(lines) + "\n")
    stack.start_worker()
    stack.start_controller()
    created = stack.create(uploaded["id"])
    done = stack.wait(created["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 31, "completed": 30, "failed": 1}
    output = stack.content(done["output_file_id"])
    assert sorted(r["custom_id"] for r in output) == sorted(prompts)
    for record in output:
        body = record["response"]["body"]
        assert body["choices"][0]["text"] == expected_text(prompts[record["custom_id"]])
    errors = stack.content(done["error_file_id"])
    assert [e["error"]["line"] for e in errors] == [4]
    # the batch lives on the cluster (a tagged name); the queue Redis holds only arq's keys
    cluster = redis_client(RedisConnectionSettings(redis_url=stack.redis_url, redis_cluster=True))
    keys = RedisConnectionSettings(redis_cluster=True).redis_keys("inferq")
    try:
        assert stack.bg.run(cluster.exists(keys.batch(created["id"]))) == 1
    finally:
        stack.bg.run(cluster.aclose())
    plain = Redis.from_url(stack.queue_url)
    assert not plain.exists(keys.batch(created["id"]))
    plain.close()


def test_without_a_queue_redis_the_controller_names_the_setting():
    settings = RedisConnectionSettings(redis_url="redis://127.0.0.1:7000/0", redis_cluster=True)
    with pytest.raises(ValueError, match="redis_batch_queue_url"):
        controller.arq_redis_settings(settings)
    queue = "redis://127.0.0.1:6390/0"
    with_queue = settings.model_copy(update={"redis_batch_queue_url": queue})
    assert controller.arq_redis_settings(with_queue).port == 6390


def test_the_http_api_streams_a_completion_from_the_cluster(
    cluster_batch_stack: ClusterBatchStack,
):
    stack = cluster_batch_stack
    stack.start_worker()
    give_up = time.monotonic() + 20
    while FAKE_MODEL not in {m["id"] for m in stack.http.get("/v1/models").json()["data"]}:
        assert time.monotonic() < give_up, "the worker's heartbeat never showed on the cluster"
        time.sleep(0.1)
    request = {"model": FAKE_MODEL, "prompt": "hello there", "max_tokens": 8, "stream": True}
    with stack.http.stream("POST", "/v1/completions", json=request) as response:
        assert response.status_code == 200, response.read()
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(event)["choices"][0]["text"] for event in events[:-1])
    assert text == expected_text("hello there", 8)
