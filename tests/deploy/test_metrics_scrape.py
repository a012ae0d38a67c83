"""A Prometheus scrape of a running stack's /metrics (the `inferq api` process, a worker process
on the fake engine): after interactive and batch jobs, the vLLM-named series a vLLM Grafana
board reads are there, with the types vLLM gives them and the values the jobs imply."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from real_stack import free_port, start_api, stop, wait_ready
from worker_harness import start_worker_process, stop_process

from schemas import JobResult
from schemas.jobs import PRIORITY_BULK

MODEL = "fake-model"
INTERACTIVE_JOBS = 4
BATCH_JOBS = 2

VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


@pytest.fixture
def stack(redis_url):
    worker = start_worker_process(
        redis_url, fake=True, model=MODEL, name="metrics-w",
        extra_env={"INFERQ_FAKE_STEP_SECONDS": "0.01"},
    )  # fmt: skip
    port = free_port()
    api = start_api(redis_url, port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, [worker, api], timeout=120)
        yield base_url
    finally:
        stop(api)
        stop_process(worker)


def scrape(http: httpx.Client) -> dict[str, tuple[str, list[Sample]]]:
    """Family name -> (type, samples) of one scrape."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(response.text)}


def value(families, family: str, sample: str, **labels: str) -> float:
    _type, samples = families[family]
    found = [s.value for s in samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, (sample, labels, samples)
    return found[0]


def run_jobs(http: httpx.Client) -> list[JobResult]:
    """Interactive jobs, then batch ones (bulk priority), each waited for; their results."""
    jobs = []
    for i in range(INTERACTIVE_JOBS + BATCH_JOBS):
        body = {
            "model": MODEL,
            "prompt": f"job number {i} " * (i + 1),
            "sampling": {"max_tokens": 5 + i, "ignore_eos": True},
        }
        if i >= INTERACTIVE_JOBS:
            body["priority"] = PRIORITY_BULK
        created = http.post("/v1/jobs", json=body)
        assert created.status_code == 202, created.text
        jobs.append(created.json()["id"])
    done = []
    for job_id in jobs:
        view = http.get(f"/v1/jobs/{job_id}/wait", params={"timeout": 30}).json()
        assert view["status"] == "succeeded", view
        done.append(JobResult.model_validate(view["result"]))
    return done


def test_a_scrape_has_the_vllm_series_with_the_jobs_numbers(stack):
    with httpx.Client(base_url=stack, timeout=10) as http:
        results = run_jobs(http)
        # The samples reach Redis with the worker's next heartbeat.
        give_up = time.monotonic() + 20
        while True:
            families = scrape(http)
            _type, ttft = families["vllm:time_to_first_token_seconds"]
            counts = [s for s in ttft if s.name.endswith("_count")]
            generated = families["vllm:generation_tokens"][1]
            expected_generated = sum(r.usage.completion_tokens for r in results)
            if (
                sum(s.value for s in counts) == len(results)
                and generated
                and generated[0].value == expected_generated
            ):
                break
            assert time.monotonic() < give_up, families.get("vllm:time_to_first_token_seconds")
            time.sleep(0.3)

    for name, kind in VLLM_TYPES.items():
        assert families[name][0] == kind, name
        assert families[name][1], f"{name} has no samples"
        assert {s.labels["model_name"] for s in families[name][1]} == {MODEL}

    interactive, batch = results[:INTERACTIVE_JOBS], results[INTERACTIVE_JOBS:]
    for priority, group in (("interactive", interactive), ("batch", batch)):
        labels = {"model_name": MODEL, "priority": priority}
        ttft = "vllm:time_to_first_token_seconds"
        assert value(families, ttft, ttft + "_count", **labels) == len(group)
        assert value(families, ttft, ttft + "_sum", **labels) == pytest.approx(
            sum(r.timings.ttft_s for r in group), abs=1e-4
        )
        assert value(families, ttft, ttft + "_bucket", le="+Inf", **labels) == len(group)
        e2e = "vllm:e2e_request_latency_seconds"
        assert value(families, e2e, e2e + "_sum", **labels) == pytest.approx(
            sum(r.timings.total_s for r in group), abs=1e-4
        )
        itl = "vllm:inter_token_latency_seconds"
        gaps = sum(r.usage.completion_tokens - 1 for r in group)
        assert value(families, itl, itl + "_count", **labels) == gaps
        assert value(families, itl, itl + "_sum", **labels) == pytest.approx(
            sum(r.timings.decode_s for r in group), abs=1e-3
        )
        assert 0 < value(families, itl, itl + "_sum", **labels) / gaps < 1.0

    model = {"model_name": MODEL}
    prompt = sum(r.usage.prompt_tokens for r in results)
    assert value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **model) == prompt
    assert value(families, "vllm:num_requests_running", "vllm:num_requests_running", **model) == 0
    assert value(families, "vllm:num_requests_waiting", "vllm:num_requests_waiting", **model) == 0
    usage = value(families, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", **model)
    assert 0.0 <= usage <= 1.0
    # the same numbers under inferq's own names
    mine = {"model": MODEL}
    assert value(
        families, "inferq_generation_tokens", "inferq_generation_tokens_total", **mine
    ) == (sum(r.usage.completion_tokens for r in results))
    assert value(families, "inferq_dead_letters", "inferq_dead_letters", **mine) == 0
    assert value(families, "inferq_live_workers", "inferq_live_workers", **mine) == 1
    rate = "inferq_generation_tokens_per_second"
    assert value(families, rate, rate, **mine) > 0
