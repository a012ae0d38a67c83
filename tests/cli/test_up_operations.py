"""`inferq up` as an operator lives with it: quiet while idle, says what a Ctrl-C waits for, and
stops at once on a second Ctrl-C with every running job handed back to the queue.

The subprocess tests run `inferq up` on tests/worker's fake engine (no model load), on free
ports."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from cli import up_redis, up_system
from cli.main import build_parser, configure_logging
from producer_api.batches.controller import QuietResumeCron
from schemas import RedisKeys
from schemas.jobs import JobField
from tests.cli.test_up import free_port

REPO = Path(__file__).resolve().parents[2]
FAKE_MODEL = "fake-model"
IDLE_BUDGET_LINES = 30  # what `inferq up` may print in five idle minutes, start-up included


# ---------------------------------------------------------------------------- fast checks


def test_up_and_its_children_log_at_warning_unless_told():
    parser = build_parser()
    quiet = parser.parse_args(["up"])
    assert quiet.log_level is None and quiet.default_log_level == "warning"
    told = parser.parse_args(["--log-level", "info", "up"])
    assert told.log_level == "info"
    assert parser.parse_args(["status"]).default_log_level == "info"


def test_http_client_request_lines_stay_out_of_the_terminal():
    configure_logging("info")
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)


def _arq_record(level: int, message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("arq.worker", level, __file__, 1, message, args, None)


def test_resume_cron_runs_are_logged_only_at_debug():
    quiet = QuietResumeCron()
    start = _arq_record(logging.INFO, "%6.2fs → %s()%s", 0.01, "cron:resume_batches:1:x", "")
    finish = _arq_record(logging.INFO, "%6.2fs ← %s ● %s", 0.0, "cron:resume_batches:1:x", 0)
    batch_run = _arq_record(logging.INFO, "%6.2fs → %s(%s)", 0.01, "b1:advance_batch", "'b1'")
    trouble = _arq_record(logging.WARNING, "job %s expired", "cron:resume_batches:1")
    assert not quiet.filter(start) and not quiet.filter(finish)
    assert quiet.filter(batch_run) and quiet.filter(trouble)
    arq_log = logging.getLogger("arq.worker")
    before = arq_log.level
    arq_log.setLevel(logging.DEBUG)
    try:
        assert quiet.filter(start)
    finally:
        arq_log.setLevel(before)


def test_stacks_on_different_redis_ports_keep_their_data_apart(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path))
    default = up_redis.default_data_dir("redis://127.0.0.1:6379/0")
    assert default == tmp_path / "redis"  # where it always was
    assert up_redis.default_data_dir("redis://127.0.0.1/0") == default
    other = up_redis.default_data_dir("redis://127.0.0.1:6400/0")
    assert other == tmp_path / "redis-6400"


def test_up_flags_say_what_they_are(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--port PORT port the API listens on (env INFERQ_PORT" in help_text
    assert "--redis-url REDIS_URL the Redis that holds" in help_text
    assert "--data-dir" in help_text and "redis-<port" in help_text


# A child that ignores the first SIGTERM (a worker draining a long job) and exits on the second
_DRAINING_CHILD = """
import pathlib, signal, sys, time
seen = []
def on_term(signum, frame):
    seen.append(signum)
    if len(seen) > 1:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
pathlib.Path(sys.argv[1]).touch()
while True:
    time.sleep(0.05)
"""


def _draining_system(tmp_path: Path, grace_s: float) -> up_system.System:
    system = up_system.System()
    ready = tmp_path / "handler-installed"
    child = system.spawn(
        "worker",
        [sys.executable, "-c", _DRAINING_CHILD, str(ready)],
        dict(os.environ),
        waits_for="it finishes its running jobs",
        hurry_signal=signal.SIGTERM,
        grace_s=grace_s,
    )
    give_up = time.monotonic() + 30
    while not ready.exists():
        assert child.alive() and time.monotonic() < give_up
        time.sleep(0.02)
    return system


def test_a_second_signal_hurries_a_draining_child(capsys, tmp_path):
    system = _draining_system(tmp_path, grace_s=60)
    system.on_signal(signal.SIGINT, None)
    # the second Ctrl-C arrives while the worker drains
    timer = threading.Timer(1.5, system.on_signal, (signal.SIGINT, None))
    timer.start()
    started = time.monotonic()
    system.stop()
    took = time.monotonic() - started
    out = capsys.readouterr().out
    assert took < 4, out
    assert "waiting for the worker: it finishes its running jobs" in out
    assert "stopping the worker now" in out
    assert "worker stopped cleanly" in out


def test_a_child_that_ignores_its_signals_is_killed_after_its_time(capsys, tmp_path):
    system = _draining_system(tmp_path, grace_s=1.0)
    system.on_signal(signal.SIGTERM, None)
    started = time.monotonic()
    system.stop()
    assert time.monotonic() - started < 5
    assert "did not stop in time; killing it" in capsys.readouterr().out


# ---------------------------------------------------------------------------- inferq up


class UpProcess:
    """`inferq up` on the fake engine; its output lines, each with the time it came."""

    def __init__(self, tmp_path: Path, redis_url: str, extra_env: dict[str, str]) -> None:
        self.api_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
        pythonpath = [str(REPO), str(REPO / "tests" / "worker"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        env["INFERQ_ENGINE_FACTORY"] = "worker_fakes:build_engine"
        env["INFERQ_HOME"] = str(tmp_path / "home")
        env.update(extra_env)
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "cli", "up", "--model", FAKE_MODEL,
                "--port", str(self.api_port), "--redis-url", redis_url,
                "--grpc-port", str(free_port()),  # not the default: runs may overlap
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for_line(self, needle: str, timeout: float) -> float:
        """When the first line containing `needle` came."""
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            for at, line in list(self.lines):
                if needle in line:
                    return at
            assert self.process.poll() is None, self.text()
            time.sleep(0.05)
        raise AssertionError(f"no line with {needle!r} in {timeout} s:\n{self.text()}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)


@pytest.fixture
def up_process(tmp_path):
    started: list[UpProcess] = []

    def start(redis_url: str | None = None, **extra_env: str) -> UpProcess:
        url = redis_url or f"redis://127.0.0.1:{free_port()}/0"
        process = UpProcess(tmp_path, url, extra_env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.close()


@pytest.mark.slow
def test_idle_up_prints_under_30_lines_in_five_minutes(up_process):
    stack = up_process()
    ready_at = stack.wait_for_line("Ctrl-C stops everything", timeout=120)
    idle_s = 20.0  # four runs of the batch controller's resume cron, ten worker heartbeats
    time.sleep(idle_s)
    lines = [line for _, line in stack.lines]
    idle_lines = [line for at, line in stack.lines if at > ready_at + 0.5]
    projected = len(lines) + len(idle_lines) * (300 - idle_s) / idle_s
    assert projected < IDLE_BUDGET_LINES, stack.text()
    for line in lines:
        assert " INFO " not in line and "cron:" not in line, stack.text()
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(30) == 0, stack.text()


def test_second_ctrl_c_stops_at_once_and_hands_the_job_back(up_process, redis_server):
    # a job of 400 steps of 0.2 s: the 30 s drain cannot finish it
    stack = up_process(redis_server.url, INFERQ_FAKE_STEP_SECONDS="0.2")
    stack.wait_for_line("Ctrl-C stops everything", timeout=120)
    body = {"model": FAKE_MODEL, "prompt": "count", "sampling": {"max_tokens": 400}}
    with httpx.Client(base_url=stack.base_url, timeout=10) as http:
        created = http.post("/v1/jobs", json=body)
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        give_up = time.monotonic() + 30
        while http.get(f"/v1/jobs/{job_id}").json()["status"] != "running":
            assert time.monotonic() < give_up, stack.text()
            time.sleep(0.1)
    time.sleep(0.5)  # a few tokens out

    stack.process.send_signal(signal.SIGINT)
    told_at = stack.wait_for_line("waiting for the worker: it finishes its running jobs", 10)
    assert "Ctrl-C again" in stack.text()
    assert stack.process.poll() is None  # still draining
    second = time.monotonic()
    assert second - told_at < 5
    stack.process.send_signal(signal.SIGINT)
    assert stack.process.wait(15) == 0, stack.text()
    assert time.monotonic() - second < 10, stack.text()
    assert "worker stopped cleanly" in stack.text()

    # handed back: a fresh entry for the job, in the stream and held by no worker
    keys = RedisKeys()
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        job = client.hgetall(keys.job(job_id))
        assert job[JobField.STATUS] in ("queued", "running"), job
        stream = keys.jobs_stream(FAKE_MODEL)
        entry_ids = [entry_id for entry_id, _ in client.xrange(stream)]
        assert job[JobField.ENTRY_ID] in entry_ids
        assert client.xpending(stream, keys.group)["pending"] == 0
    finally:
        client.close()
