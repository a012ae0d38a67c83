"""`inferq up` (cli.up): starts Redis, the API, the batch controller and a worker,
answers a completion and a batch, and stops them all on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from cli import up, up_redis, up_system

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_up(data_dir: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """`inferq up` with `args` (authentication off: no keys in its environment), once its
    banner says everything serves; the process and what it printed so far."""
    env = {k: v for k, v in os.environ.items() if k not in ("INFERQ_API_KEYS",)}
    command = [sys.executable, "-m", "cli", "--log-level", "warning", "up"]
    process = subprocess.Popen(
        [*command, "--data-dir", str(data_dir), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    output: list[str] = []
    try:
        give_up = time.monotonic() + 300
        assert process.stdout is not None
        while not any("Ctrl-C stops everything" in line for line in output):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(output)
            output.append(line)
            assert time.monotonic() < give_up, "".join(output)
    except BaseException:
        process.kill()
        raise
    return process, "".join(output)


def stop_up(process: subprocess.Popen[str], printed: str) -> str:
    """Ctrl-C, as a user stops it: it must exit 0; what it printed while stopping."""
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=90)
    assert process.returncode == 0, printed + rest
    return rest


def test_no_auth_only_on_loopback(monkeypatch):
    monkeypatch.delenv("INFERQ_API_KEYS", raising=False)
    monkeypatch.delenv("INFERQ_AUTH_DISABLED", raising=False)
    env, auth_off = up.api_environment(up.UpSettings(host="127.0.0.1"))
    assert auth_off and env["INFERQ_AUTH_DISABLED"] == "1"
    with pytest.raises(up_system.UpError, match="INFERQ_API_KEYS"):
        up.api_environment(up.UpSettings(host="0.0.0.0"))
    monkeypatch.setenv("INFERQ_API_KEYS", '{"me": "secret"}')
    env, auth_off = up.api_environment(up.UpSettings(host="0.0.0.0"))
    assert not auth_off and "INFERQ_AUTH_DISABLED" not in env


def test_banner_shows_a_working_curl_and_warns_without_auth():
    settings = up.UpSettings(model=MODEL, port=8123, redis_url="redis://:pw@127.0.0.1:6390/0")
    banner = up._banner("http://127.0.0.1:8123", settings, auth_off=True)
    assert "AUTHENTICATION IS DISABLED" in banner
    assert "curl -s http://127.0.0.1:8123/v1/completions" in banner
    assert f'"model": "{MODEL}"' in banner
    # other commands are told where this system is, without the Redis password
    assert "INFERQ_API_URL=http://127.0.0.1:8123" in banner
    assert "INFERQ_REDIS_URL=redis://:***@127.0.0.1:6390/0" in banner


def test_existing_redis_is_used_not_started(redis_url):
    system = up_system.System()
    assert up_redis.start_redis(system, redis_url, Path("/nonexistent")) is None
    assert system.children == []


@pytest.mark.slow
@pytest.mark.model
def test_up_answers_a_completion_and_stops_cleanly(tmp_path):
    api_port, redis_port, grpc_port = free_port(), free_port(), free_port()
    process, text = start_up(
        tmp_path, "--port", str(api_port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--grpc-port", str(grpc_port),
    )  # fmt: skip
    try:
        assert "AUTHENTICATION IS DISABLED" in text and "curl -s" in text
        response = httpx.post(
            f"http://127.0.0.1:{api_port}/v1/completions",
            json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
        assert _batch_output(f"http://127.0.0.1:{api_port}") == ["only-line"]
        assert _grpc_completion(grpc_port).usage.completion_tokens >= 1
        rest = stop_up(process, text)
    finally:
        if process.poll() is None:
            process.kill()
    for child in ("worker", "batch-controller", "grpc", "api", "redis"):
        assert f"{child} stopped cleanly" in rest, rest
    assert not answers(api_port) and not answers(redis_port) and not answers(grpc_port)


@pytest.mark.slow
def test_up_serves_the_embedding_model_beside(tmp_path):
    from engine.model_files import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("all-MiniLM-L6-v2")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    api_port, redis_port = free_port(), free_port()
    process, text = start_up(
        tmp_path, "--no-worker", "--no-grpc", "--embedding-model", "all-MiniLM-L6-v2",
        "--port", str(api_port), "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
    )  # fmt: skip
    try:
        assert "/v1/embeddings" in text
        response = httpx.post(
            f"http://127.0.0.1:{api_port}/v1/embeddings",
            json={"model": "all-MiniLM-L6-v2", "input": ["Hello", "world"]},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert [len(item["embedding"]) for item in response.json()["data"]] == [384, 384]
        rest = stop_up(process, text)
    finally:
        if process.poll() is None:
            process.kill()
    assert "embedding-worker stopped cleanly" in rest, rest


def _grpc_completion(port: int):
    """The issue's example request, through the gRPC server `inferq up` started."""
    from producer_api.grpc.stubs import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(f"localhost:{port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return stub.CreateCompletion(
            inference_pb2.CompletionsRequest(
                prompt="The quick brown fox jumps over the lazy", num_tokens=10,
                temperature=0.7, top_p=0.9, stop_sequences=["\n"], model_id=MODEL,
            ),
            timeout=120,
        )  # fmt: skip


def _batch_output(base_url: str) -> list[str]:
    """Run a one-line batch through the Batch API; the custom_ids of its output lines."""
    line = {
        "custom_id": "only-line",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "One, two,", "max_tokens": 2},
    }
    with httpx.Client(base_url=base_url, timeout=30) as http:
        uploaded = http.post(
            "/v1/files",
            files={"file": ("in.jsonl", json.dumps(line) + "\n")},
            data={"purpose": "batch"},
        )
        assert uploaded.status_code == 200, uploaded.text
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        }
        batch = http.post("/v1/batches", json=body).json()
        give_up = time.monotonic() + 120
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < give_up, f"batch stuck: {batch}"
            time.sleep(0.5)
            batch = http.get(f"/v1/batches/{batch['id']}").json()
        assert batch["status"] == "completed", batch
        output = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    return [json.loads(row)["custom_id"] for row in output.splitlines() if row.strip()]
