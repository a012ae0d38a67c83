"""One real system for the API tests that need a real model: a private redis-server, an
`inferq worker` process on the given model, and the HTTP API in this process, ready when the
API's /ready says a worker beats."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.api.conftest import BackgroundLoop, Stack
from tests.conftest import _started_server

READY_TIMEOUT_S = 300


@contextmanager
def real_worker_stack(
    tmp_path_factory: pytest.TempPathFactory,
    model: str,
    *worker_args: str,
    threads: str = "2",
    ready_timeout_s: float = READY_TIMEOUT_S,
    **api_overrides: Any,
) -> Iterator[Stack]:
    """Yields the stack once the worker serves; `threads` is the worker's default
    INFERQ_NUM_THREADS (the environment's wins); `api_overrides` go to `Stack.api`."""
    server = _started_server(tmp_path_factory.mktemp("redis-real-worker"))
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "cli", "--log-level", "warning", "worker", "--model", model,
            "--redis-url", server.url, *worker_args,
        ],
        env={**os.environ, "INFERQ_NUM_THREADS": os.environ.get("INFERQ_NUM_THREADS", threads)},
    )  # fmt: skip
    bg = BackgroundLoop()
    stack = Stack(server.url, bg)
    try:
        api = stack.api(**{"models": [], **api_overrides})
        give_up = time.monotonic() + ready_timeout_s
        with httpx.Client(base_url=api.url) as http:
            while http.get("/ready").status_code != 200:
                assert worker.poll() is None, "the worker exited during start-up"
                assert time.monotonic() < give_up, "the worker did not come up"
                time.sleep(0.5)
        yield stack
    finally:
        stack.close()
        bg.close()
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
        server.kill()
