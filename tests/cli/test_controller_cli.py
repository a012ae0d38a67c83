"""`inferq batch controller`: the arq worker as our CLI runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def test_controller_logs_each_line_once_and_stops_on_sigint(redis_url):
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "batch", "controller"],
        env={**os.environ, "INFERQ_REDIS_URL": redis_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        seen: list[str] = []
        give_up = time.monotonic() + 60
        while not any("redis_version=" in line for line in seen):
            line = process.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
            assert time.monotonic() < give_up, "".join(seen)
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(seen) + rest
    assert output.count("Starting worker for") == 1, output  # one handler, not arq's and ours
    assert "shutdown on SIGINT" in output
    assert process.returncode == 0, output
