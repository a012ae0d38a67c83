"""Pointed at the wrong place, every `inferq` command says so in one line naming what it tried
(no traceback) and exits non-zero; and each reads the same INFERQ_* variables as `inferq up`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from tests.cli.test_up import free_port

REPO = Path(__file__).resolve().parents[2]


def inferq(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    return subprocess.run(
        [sys.executable, "-m", "cli", *argv],
        capture_output=True,
        text=True,
        env={**clean, **(env or {})},
        cwd=REPO,
        timeout=60,
    )


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture
def batch_file(tmp_path: Path) -> Path:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(line) + "\n")
    return path


def test_batch_submit_to_a_closed_port_names_the_url(batch_file):
    url = f"http://127.0.0.1:{free_port()}"
    result = inferq("batch", "submit", str(batch_file), "--api-url", url)
    assert result.returncode != 0
    line = one_line(result.stderr)
    assert url in line and "--api-url" in line and "INFERQ_API_URL" in line


@pytest.mark.parametrize("variables", ["url", "port"])
def test_batch_submit_finds_the_api_as_inferq_up_does(batch_file, variables):
    port = free_port()
    env = (
        {"INFERQ_API_URL": f"http://127.0.0.1:{port}"}
        if variables == "url"
        else {"INFERQ_PORT": str(port)}  # the variable `inferq up --port` reads
    )
    result = inferq("batch", "submit", str(batch_file), env=env)
    assert result.returncode != 0
    assert f"http://127.0.0.1:{port}" in one_line(result.stderr)


def test_batch_submit_of_a_missing_file_says_which(tmp_path):
    missing = tmp_path / "nope.jsonl"
    result = inferq("batch", "submit", str(missing))
    assert result.returncode != 0 and str(missing) in one_line(result.stderr)


def test_status_against_a_closed_redis_port_names_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for env, argv in (({}, ["--redis-url", url]), ({"INFERQ_REDIS_URL": url}, [])):
        result = inferq("status", *argv, env=env)
        assert result.returncode == 2
        line = one_line(result.stderr)
        assert url in line and "--redis-url" in line


def test_status_of_an_empty_redis_says_where_it_looked(redis_url, capsys, monkeypatch):
    monkeypatch.setenv("INFERQ_PREFIX", "elsewhere")
    assert main(["status", "--redis-url", redis_url]) == 1
    captured = capsys.readouterr()
    assert f"no worker heartbeat seen at {redis_url}, prefix 'elsewhere'" in captured.out
    line = one_line(captured.err)
    assert redis_url in line and "INFERQ_REDIS_URL" in line and "'elsewhere'" in line


def test_status_help_names_the_variables():
    result = inferq("status", "--help")
    text = " ".join(result.stdout.split())
    assert "env INFERQ_REDIS_URL" in text and "env INFERQ_PREFIX" in text
