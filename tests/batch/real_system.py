"""The real system for batch acceptance tests: a Redis server, an inference worker process on
the default model, the API (uvicorn) and arq controller processes that tests start and kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.api.conftest import ALICE_KEY, BackgroundLoop, Stack
from tests.batch.batch_calls import BatchCalls
from tests.conftest import RedisServer, _started_server

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
READY_TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]
CONTROLLER_ENV = {
    "INFERQ_BATCH_POLL_INTERVAL_S": "0.2",
    "INFERQ_BATCH_LEASE_S": "3",
    "INFERQ_BATCH_RESUME_EVERY_S": "1",
}


def completion_line(custom_id: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    )


def start_worker(redis_url: str, **settings: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, "INFERQ_NUM_THREADS": os.environ.get("INFERQ_NUM_THREADS", "2")}
    env.update({f"INFERQ_{k.upper()}": str(v) for k, v in settings.items()})
    return subprocess.Popen(
        [
            sys.executable, "-m", "cli", "--log-level", "warning", "worker", "--model", MODEL,
            "--redis-url", redis_url, "--max-model-len", str(MAX_MODEL_LEN),
        ],
        env=env,
    )  # fmt: skip


def start_controller(redis_url: str) -> subprocess.Popen[bytes]:
    """`arq producer_api.batches.controller.WorkerSettings`, as an operator runs it."""
    env = {**os.environ, **CONTROLLER_ENV, "INFERQ_REDIS_URL": redis_url}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    arq = Path(sys.executable).with_name("arq")
    return subprocess.Popen(
        [str(arq), "producer_api.batches.controller.WorkerSettings"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RealSystem(BatchCalls):
    wait_timeout_s = 600.0
    poll_s = 0.2

    def __init__(self, server: RedisServer, worker: subprocess.Popen[bytes]) -> None:
        self.server = server
        self.worker = worker
        self.bg = BackgroundLoop()
        self.stack = Stack(server.url, self.bg)
        self.api = self.stack.api(models=[], max_batch_lines=5000)
        self.http = httpx.Client(
            base_url=self.api.url, headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=120
        )
        give_up = time.monotonic() + READY_TIMEOUT_S
        while self.http.get("/ready").status_code != 200:
            assert worker.poll() is None, "the worker exited during start-up"
            assert time.monotonic() < give_up, "the worker did not come up"
            time.sleep(0.5)

    def close(self) -> None:
        self.http.close()
        self.stack.close()
        self.bg.close()
        stop(self.worker)

    def submit(self, lines: list[str]) -> dict[str, Any]:
        uploaded = self.upload("\n".join(lines) + "\n", name="in.jsonl")
        return self.create(uploaded["id"])

    def wait_completed(self, batch_id: str, count: int, timeout: float = 300) -> dict[str, Any]:
        give_up = time.monotonic() + timeout
        while (batch := self.batch(batch_id))["request_counts"]["completed"] < count:
            assert time.monotonic() < give_up, f"batch stuck at {batch}"
            time.sleep(0.1)
        return batch


@contextmanager
def running_system(data_dir: Path, **worker_settings: Any) -> Iterator[RealSystem]:
    """A fresh redis-server in data_dir, a real worker, then the RealSystem on top; all stopped
    at the end (the worker alone when the system never came up)."""
    server = _started_server(data_dir)
    worker = start_worker(server.url, **worker_settings)
    real = None
    try:
        real = RealSystem(server, worker)
        yield real
    finally:
        if real is not None:
            real.close()
        else:
            stop(worker)
        server.kill()
