"""The dashboard in headless Chromium against a real stack (slow): Redis, a real worker on the
default model, `inferq api`; after a few jobs the rendered page shows the numbers those jobs
produced (tokens/s > 0, TTFT p50 equal to the jobs' own median TTFT), and a screenshot is kept.

Set INFERQ_DASHBOARD_PNG=path to also copy the screenshot there (bench/dashboard.png for the
README: `INFERQ_DASHBOARD_PNG=bench/dashboard.png bash scripts/test.sh -m slow -k dashboard`)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from real_stack import MODEL, free_port, start_api, stop, wait_ready
from worker_harness import start_worker_process

from producer_api.client.redis_client import RedisClient
from schemas import JobStatus

pytestmark = [pytest.mark.slow, pytest.mark.model]

JOBS = 6
MAX_TOKENS = 24
WINDOW = (1400, 1000)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "chromium not installed (scripts/test.sh installs it: apt-get install chromium)"
        )
    return found


def browse(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on `url`; the virtual-time budget lets the page's fetch and render
    finish before the DOM is dumped or the screenshot taken."""
    args = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--virtual-time-budget=8000", *flags, url,
    ]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)


def rendered_metrics(dom: str) -> dict[str, str]:
    return dict(re.findall(r'data-metric="([a-z0-9_]+)">([^<]*)<', dom))


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)), 1) - 1]


@pytest.fixture
def stack(redis_server, tmp_path):
    worker = start_worker_process(
        redis_server.url, fake=False, model=MODEL, name="dash-worker", heartbeat_interval_s=0.5,
        extra_env={"INFERQ_NUM_THREADS": "2"},
    )  # fmt: skip
    port = free_port()
    api = start_api(redis_server.url, port)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, [worker, api])
        yield redis_server.url, base_url
    finally:
        stop(api)
        stop(worker, 60)


def test_dashboard_shows_the_running_stacks_numbers(stack, tmp_path):
    redis_url, base_url = stack
    with RedisClient(redis_url) as client:
        jobs = [
            client.enqueue(
                model=MODEL,
                prompt=f"Tell me about the number {i}.",
                sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
            )
            for i in range(JOBS)
        ]
        done = [client.wait(job.id, timeout=240) for job in jobs]
    assert all(job.status is JobStatus.SUCCEEDED for job in done)
    ttfts = [job.result.timings.ttft_s for job in done]
    generated = sum(job.result.usage.completion_tokens for job in done)
    assert generated == JOBS * MAX_TOKENS

    # The samples reach Redis with the worker's next heartbeat.
    with httpx.Client(base_url=base_url, timeout=5) as http:
        give_up = time.monotonic() + 30
        while True:
            data = http.get("/dashboard/data").json()
            model = next((m for m in data["models"] if m["name"] == MODEL), None)
            window = model["windows"][-1] if model else {}
            if window.get("jobs_finished") == JOBS and window["generated_tokens"] >= generated:
                break
            assert time.monotonic() < give_up, f"samples did not arrive: {data}"
            time.sleep(0.5)

    dom = browse(f"{base_url}/dashboard", "--dump-dom").stdout
    shown = rendered_metrics(dom)
    assert shown["workers"] == "1"
    assert shown["jobs_finished"] == str(JOBS)
    assert int(shown["generated_tokens"]) >= generated
    assert float(shown["tokens_per_s"]) > 0
    p50_ms = float(shown["ttft_p50"].removesuffix(" ms"))
    assert p50_ms > 0
    assert p50_ms == pytest.approx(nearest_rank(ttfts, 0.5) * 1000, abs=1)
    assert float(shown["ttft_p99"].removesuffix(" ms")) == pytest.approx(
        nearest_rank(ttfts, 0.99) * 1000, abs=1
    )
    assert shown["batch_ttft_p50"] == "\u2013"  # no batch job ran: an en dash, not a number
    assert "dash-worker" in dom

    screenshot = tmp_path / "dashboard.png"
    browse(f"{base_url}/dashboard", f"--screenshot={screenshot}")
    png = screenshot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000  # a rendered page, not a blank one
    keep = os.environ.get("INFERQ_DASHBOARD_PNG")
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, keep)

    status = subprocess.run(
        ["inferq", "status", "--redis-url", redis_url], capture_output=True, text=True, check=True
    ).stdout
    worker_row = next(line for line in status.splitlines() if line.startswith("dash-worker"))
    # generated, then the LoRA adapters served, resident and cached, beat, up, version
    assert f" {generated} " in worker_row or int(worker_row.split()[-7]) >= generated
