"""A real inferq system as subprocesses: Redis (from tests.conftest), real workers on the
default model (worker_harness), and the API served by `inferq api` on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_api(redis_url: str, port: int, extra_env: dict[str, str] | None = None):
    """`inferq api` without auth on 127.0.0.1:`port` (the CLI entry a deployment runs)."""
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": redis_url,
        "INFERQ_AUTH_DISABLED": "1",
        "INFERQ_WORKER_CACHE_S": "0",
        **(extra_env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "--log-level", "warning", "api",
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, env=env,
    )  # fmt: skip


def wait_ready(base_url: str, processes: list[subprocess.Popen], timeout: float = READY_TIMEOUT_S):
    """Until GET /ready is 200 (Redis answers, a worker beats); fails if a process exits."""
    give_up = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=2.0) as http:
        while True:
            for process in processes:
                assert process.poll() is None, f"{process.args} exited during start-up"
            try:
                if http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < give_up, "the stack did not become ready"
            time.sleep(0.3)


def stop(process: subprocess.Popen, timeout: float = 30.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
