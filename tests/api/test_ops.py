"""/health, /ready and /metrics."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from schemas.jobs import PRIORITY_BULK
from tests.api.conftest import MODEL, auth
from tests.api.test_jobs_api import job_body, sse_events


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_health_and_ready(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url) as http:
        assert http.get("/health").json() == {"status": "ok"}
        not_ready = http.get("/ready")
        assert not_ready.status_code == 503
        assert not_ready.json()["redis"] is True and not_ready.json()["workers"] == 0
        stack.worker(quantization="gguf")
        ready = http.get("/ready")
        assert ready.status_code == 200
        assert ready.json()["models"] == [MODEL] and ready.json()["workers"] == 1
        (load,) = ready.json()["load"]
        assert load == {
            "model": MODEL,
            "workers": 1,
            "running": 0,
            "waiting": 0,
            "queued": 0,
            "kv_cache_usage": 0.0,
            "max_model_len": None,
            "quantization": "gguf",
        }


def test_ready_is_503_when_redis_is_down(stack, redis_server):
    api = stack.api(redis_url=redis_server.url)
    redis_server.kill()
    with httpx.Client(base_url=api.url, headers=auth()) as http:
        assert http.get("/health").status_code == 200
        down = http.get("/ready")
        assert down.status_code == 503 and down.json()["redis"] is False
        refused = http.post("/v1/jobs", json=job_body())
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "unavailable"


def test_metrics(stack):
    api = stack.api()
    with httpx.Client(base_url=api.url, headers=auth(), timeout=20) as http:
        for _ in range(2):
            http.post("/v1/jobs", json=job_body())
        bulk = http.post("/v1/jobs", json={**job_body(), "priority": PRIORITY_BULK}).json()
        http.get("/v1/jobs/job_doesnotexist000000000")
        time.sleep(0.05)
        before = samples(http.get("/metrics").text)
        assert before[("inferq_queue_length", (("model", MODEL),))] == 3  # bulk stream counted
        assert http.delete(f"/v1/jobs/{bulk['id']}").status_code == 200
        assert before[("inferq_queue_pending", (("model", MODEL),))] == 0
        assert before[("inferq_queue_oldest_queued_age_seconds", (("model", MODEL),))] > 0
        # the bulk queue apart, and vLLM's waiting gauge counting every queued job
        by_class = "inferq_queue_waiting"
        assert before[(by_class, (("model", MODEL), ("priority", "interactive")))] == 2
        assert before[(by_class, (("model", MODEL), ("priority", "batch")))] == 1
        assert before[("vllm:num_requests_waiting", (("model_name", MODEL),))] == 3
        assert before[("vllm:num_requests_running", (("model_name", MODEL),))] == 0
        assert before[("inferq_dead_letters", (("model", MODEL),))] == 0
        created = (
            "inferq_api_requests_total",
            (("method", "POST"), ("route", "/v1/jobs"), ("status", "202")),
        )
        missing = (
            "inferq_api_requests_total",
            (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404")),
        )
        assert before[created] == 3 and before[missing] == 1
        stack.worker(step_delay_s=0.1)
        job = http.post("/v1/jobs", json=job_body("a b c d e f g h")).json()
        with http.stream("GET", job["links"]["stream"]) as response:
            lines = response.iter_lines()
            sse_events(lines, limit=1)
            during = samples(http.get("/metrics").text)
        assert during[("inferq_sse_connections", ())] == 1
        assert during[("inferq_live_workers", (("model", MODEL),))] == 1
        http.get(job["links"]["wait"], params={"timeout": 10})
        time.sleep(0.3)
        after = samples(http.get("/metrics").text)
    assert after[("inferq_sse_connections", ())] == 0
    assert after[("inferq_queue_length", (("model", MODEL),))] == 0
    assert after[("inferq_queue_oldest_queued_age_seconds", (("model", MODEL),))] == 0
