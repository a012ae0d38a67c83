"""`inferq status` and `/dashboard/data` on a real Redis: heartbeats and samples written by the
worker's own heartbeat code, queues with pending entries, dead letters; the numbers shown are
the ones those writes imply."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from redis.asyncio import Redis

from cli.main import main as inferq
from cli.status import redacted
from producer_api.app import create_app
from producer_api.settings import ApiSettings
from producer_api.status import TtftStats, percentile, read_snapshot, token_rates
from schemas import RedisKeys
from schemas.jobs import PriorityClass
from schemas.workers import TokenSample, TtftSample
from worker.heartbeat import TtftBuffer, beat

MODEL = "org/Model v1"  # needs percent-encoding in keys
WEIGHT_BYTES = 99 * 2**20 + 2**19  # 99.5 MiB of quantized weights
KEYS = RedisKeys()


def stats(free: int, total: int, running: int, waiting: int, prompt: int, generated: int):
    return SimpleNamespace(
        num_blocks_free=free,
        num_blocks_total=total,
        num_running=running,
        num_waiting=waiting,
        num_prompt_tokens_computed=prompt,
        num_generation_tokens=generated,
    )


async def _populate(url: str) -> dict[str, float]:
    """Two heartbeats of one gguf worker 0.5 s apart (+200 generated tokens), three TTFTs of
    interactive jobs and two of batch jobs, a queue with one job running and two waiting, one
    dead letter."""
    redis = Redis.from_url(url, decode_responses=True)
    started = datetime.now(UTC)
    first = await beat(
        redis, KEYS, name="gpu-0", model=MODEL, stats=stats(90, 100, 0, 0, 10, 50),
        started_at=started, ttl_s=30, max_model_len=2048,
    )  # fmt: skip
    await asyncio.sleep(0.5)
    ttfts = TtftBuffer()
    for i, ttft in enumerate((0.05, 0.10, 0.40)):
        ttfts.add(TtftSample(time.time(), ttft, f"job{i}"))
    for i, ttft in enumerate((2.0, 3.0)):
        ttfts.add(TtftSample(time.time(), ttft, f"bulk{i}", PriorityClass.BATCH))
    second = await beat(
        redis, KEYS, name="gpu-0", model=MODEL, stats=stats(60, 100, 3, 1, 400, 250),
        started_at=started, ttl_s=30, ttfts=ttfts.take(), quantization="gguf",
        weight_bytes=WEIGHT_BYTES, architecture="LlamaForCausalLM",
    )  # fmt: skip
    stream = KEYS.jobs_stream(MODEL)
    await redis.xgroup_create(stream, KEYS.group, "0", mkstream=True)
    for i in range(3):
        await redis.xadd(stream, {"job": f"q{i}"})
    await redis.xreadgroup(KEYS.group, "gpu-0", {stream: ">"}, count=1)
    await redis.xadd(
        KEYS.dead_letters(MODEL),
        {"job": "bad", "reason": "max_attempts_exceeded", "message": "gave up", "at": "now"},
    )
    await redis.aclose()
    return {"span": second.updated_at.timestamp() - first.updated_at.timestamp()}


@pytest.fixture
def populated(redis_url: str) -> dict[str, float]:
    return asyncio.run(_populate(redis_url))


def test_snapshot_reports_what_the_worker_wrote(redis_url, populated):
    async def read():
        redis = Redis.from_url(redis_url, decode_responses=True)
        try:
            return await read_snapshot(redis, KEYS)
        finally:
            await redis.aclose()

    snapshot = asyncio.run(read())
    (worker,) = snapshot.workers
    assert (worker.name, worker.model, worker.running, worker.waiting) == ("gpu-0", MODEL, 3, 1)
    assert worker.kv_usage == pytest.approx(0.4) and worker.generated_tokens == 250
    assert (worker.quantization, worker.weight_bytes) == ("gguf", WEIGHT_BYTES)
    (queue,) = snapshot.queues
    assert (queue.model, queue.kind, queue.length, queue.pending, queue.waiting) == (
        MODEL, "jobs", 3, 1, 2,
    )  # fmt: skip
    (dead,) = snapshot.dead_letters
    assert (dead.model, dead.count, dead.last_reason) == (MODEL, 1, "max_attempts_exceeded")
    (model,) = snapshot.models
    assert (model.workers, model.queued, model.dead_letters) == (1, 2, 1)
    one_minute = model.windows[0]
    assert one_minute.window_s == 60 and one_minute.generated_tokens == 200
    assert one_minute.tokens_per_s == pytest.approx(200 / populated["span"], rel=1e-3)
    assert one_minute.prompt_tokens_per_s == pytest.approx(390 / populated["span"], rel=1e-3)
    assert one_minute.jobs_finished == 5
    assert one_minute.interactive == TtftStats(3, 0.10, 0.40)
    assert one_minute.batch == TtftStats(2, 2.0, 3.0)
    assert sum(rate for _, rate in model.tokens_per_s_series) * 10 == pytest.approx(200)


def test_inferq_status_prints_the_tables(redis_url, populated, capsys):
    assert inferq(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    model_row = next(line for line in out.splitlines() if line.startswith(MODEL))
    assert "40%" in model_row and "100ms/400ms" in model_row and "2000ms/3000ms" in model_row
    worker_row = next(line for line in out.splitlines() if line.startswith("gpu-0"))
    assert "40% (40/100)" in worker_row and " 250 " in worker_row
    assert " gguf " in worker_row and " 99.5 MiB " in worker_row
    assert " LlamaForCausalLM " in worker_row
    assert "max_attempts_exceeded" in out

    assert inferq(["status", "--redis-url", redis_url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["queues"][0]["waiting"] == 2 and data["workers"][0]["name"] == "gpu-0"
    assert data["workers"][0]["quantization"] == "gguf"
    assert data["workers"][0]["architecture"] == "LlamaForCausalLM"


def test_inferq_status_shows_a_full_precision_worker_beside_a_quantized_one(redis_url, capsys):
    """A worker that names no quantization (full precision, or one from before the field) reads
    as "none"; each worker row names its own method and weight size."""

    async def two_workers() -> None:
        redis = Redis.from_url(redis_url, decode_responses=True)
        now = datetime.now(UTC)
        try:
            for name, quantization, size in (("full-0", None, None), ("int8-0", "int8", 2**27)):
                await beat(
                    redis, KEYS, name=name, model=MODEL, stats=stats(10, 10, 0, 0, 0, 0),
                    started_at=now, ttl_s=30, quantization=quantization, weight_bytes=size,
                )  # fmt: skip
        finally:
            await redis.aclose()

    asyncio.run(two_workers())
    assert inferq(["status", "--redis-url", redis_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("WORKER"))
    assert "quantization" in header and "weights" in header
    full = next(line for line in lines if line.startswith("full-0"))
    quantized = next(line for line in lines if line.startswith("int8-0"))
    assert " none " in full and " - " in full
    assert " int8 " in quantized and " 128.0 MiB " in quantized


def test_inferq_status_shows_the_lora_adapters_of_each_worker(redis_url, capsys):
    async def two_workers() -> None:
        redis = Redis.from_url(redis_url, decode_responses=True)
        for name, adapters in (("lora-w", ["sql", "chat", "math"]), ("plain-w", [])):
            await beat(
                redis, KEYS, name=name, model=MODEL, stats=stats(90, 100, 0, 0, 0, 0),
                started_at=datetime.now(UTC), ttl_s=30, lora_adapters=adapters,
                lora_resident=adapters[:1], lora_cached=adapters[1:2],
            )  # fmt: skip
        await redis.aclose()

    asyncio.run(two_workers())
    assert inferq(["status", "--redis-url", redis_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("WORKER"))
    assert "LoRA resident" in header and "LoRA cached" in header
    rows = {line.split()[0]: line for line in lines if line}
    cells = rows["lora-w"].split()
    served = cells.index("sql,chat,math")
    assert cells[served + 1 : served + 3] == ["sql", "chat"]  # resident, cached
    assert " - " in rows["plain-w"]
    assert inferq(["status", "--redis-url", redis_url, "--json"]) == 0
    workers = {w["name"]: w for w in json.loads(capsys.readouterr().out)["workers"]}
    assert workers["lora-w"]["lora_adapters"] == ["sql", "chat", "math"]
    assert (workers["lora-w"]["lora_resident"], workers["lora-w"]["lora_cached"]) == (
        ["sql"],
        ["chat"],
    )
    assert workers["plain-w"]["lora_adapters"] == []


def test_check_worker_exit_codes(redis_url, populated, capsys, monkeypatch):
    assert inferq(["status", "--redis-url", redis_url, "--check-worker", "gpu-0"]) == 0
    assert inferq(["status", "--redis-url", redis_url, "--check-worker", "gpu-9"]) == 1
    monkeypatch.setenv("INFERQ_NAME", "gpu-0")
    assert inferq(["status", "--redis-url", redis_url, "--check-worker"]) == 0
    monkeypatch.delenv("INFERQ_NAME")
    monkeypatch.setattr("socket.gethostname", lambda: "gpu")  # default names are host-pid-rand
    assert inferq(["status", "--redis-url", redis_url, "--check-worker"]) == 0
    monkeypatch.setattr("socket.gethostname", lambda: "cpu")
    assert inferq(["status", "--redis-url", redis_url, "--check-worker"]) == 1
    assert inferq(["status", "--redis-url", "redis://127.0.0.1:1/0", "--check-worker"]) == 2


def test_dashboard_page_and_data(redis_url, populated):
    app = create_app(ApiSettings(redis_url=redis_url, auth_disabled=True))
    with TestClient(app) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/data" in page.text and "<script>" in page.text
        data = http.get("/dashboard/data").json()
    (model,) = data["models"]
    assert model["name"] == MODEL and model["windows"][0]["jobs_finished"] == 5
    assert model["windows"][0]["interactive"]["ttft_p50_s"] == 0.10
    assert model["windows"][0]["batch"]["jobs_finished"] == 2
    assert data["workers"][0]["kv_blocks_free"] == 60


def test_rates_and_percentiles_on_edge_cases():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    now = time.time()
    # one beat per worker: no rate yet; a restarted counter never counts negative
    assert token_rates([TokenSample(now, "a", 5, 5)], now, 60) == (0, None, None)
    samples = [TokenSample(now - 10, "a", 100, 0), TokenSample(now, "a", 40, 0)]
    assert token_rates(samples, now, 60)[0] == 0
    # two workers: their growth adds up over the span the samples cover
    samples = [TokenSample(now - 4, "a", 0, 0), TokenSample(now, "a", 40, 0)]
    samples += [TokenSample(now - 2, "b", 10, 0), TokenSample(now, "b", 30, 0)]
    assert token_rates(samples, now, 60)[:2] == (60, pytest.approx(15.0))
    # samples older than the window are left out
    assert token_rates(samples, now, 3)[:2] == (20, pytest.approx(10.0))


def test_sample_members_round_trip():
    ttft = TtftSample(1700000000.5, 0.123456, "job-x")
    assert TtftSample.parse(ttft.member(), ttft.finished_at) == ttft
    full = TtftSample(1700000000.5, 0.5, "job_y", PriorityClass.BATCH, 2.25, 0.0125, 140)
    assert TtftSample.parse(full.member(), full.finished_at) == full
    # members written before the other latencies were added still read
    assert TtftSample.parse("0.123456:job-x", 1700000000.5) == ttft
    tokens = TokenSample(1700000000.5, "host:1/a", 12, 34)
    assert TokenSample.parse(tokens.member(), tokens.at) == tokens


def test_redacted_hides_the_password():
    assert redacted("redis://:pw@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redacted("rediss://user:pw@h/0") == "rediss://user:***@h/0"
    assert redacted("redis://h:6379/0") == "redis://h:6379/0"
