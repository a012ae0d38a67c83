"""`inferq grpc`: its port is one setting (flag --grpc-port / --port, INFERQ_GRPC_PORT), every
API setting applies, and the process serves until SIGTERM, then exits cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.main import build_parser
from cli.up import UpSettings
from producer_api.grpc.settings import DEFAULT_GRPC_PORT
from producer_api.grpc.stubs import inference_pb2 as pb
from producer_api.grpc.stubs import inference_pb2_grpc
from tests.conftest import _free_port

START_TIMEOUT_S = 30


def settings_of(argv: list[str], monkeypatch, **env: str):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["grpc", *argv])
    return args.handler.flags.settings(args)


def test_the_port_comes_from_the_flag_the_environment_or_the_default(monkeypatch):
    monkeypatch.setenv("INFERQ_AUTH_DISABLED", "1")
    monkeypatch.delenv("INFERQ_GRPC_PORT", raising=False)
    assert settings_of([], monkeypatch).grpc_port == DEFAULT_GRPC_PORT
    assert settings_of([], monkeypatch, INFERQ_GRPC_PORT="6001").grpc_port == 6001
    assert settings_of(["--port", "6002"], monkeypatch).grpc_port == 6002
    assert settings_of(["--grpc-port", "6003", "--max-queue-len", "7"], monkeypatch).model_dump(
        include={"grpc_port", "max_queue_len"}
    ) == {"grpc_port": 6003, "max_queue_len": 7}


def test_inferq_up_takes_the_same_setting(monkeypatch):
    monkeypatch.setenv("INFERQ_GRPC_PORT", "6001")
    assert UpSettings().grpc_port == 6001
    args = build_parser().parse_args(["up", "--grpc-port", "6004"])
    assert args.handler.flags.settings(args).grpc_port == 6004


def test_inferq_grpc_serves_until_sigterm(redis_url):
    port = _free_port()
    env = {
        **os.environ,
        "INFERQ_REDIS_URL": redis_url,
        "INFERQ_AUTH_DISABLED": "1",
        "INFERQ_GRPC_PORT": str(port),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "--log-level", "warning", "grpc"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = inference_pb2_grpc.InferenceStub(channel)
            assert list(stub.ListModels(pb.ListModelsRequest(), timeout=5).models) == []
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert process.wait(15) == 0, process.stdout.read() if process.stdout else ""
        assert time.monotonic() - started < 10
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
