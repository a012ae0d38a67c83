"""The gRPC server on a test stack's background loop (beside its HTTP API and workers), and a
blocking client made of the generated stubs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from producer_api.grpc.server import GrpcServer
from producer_api.grpc.settings import GrpcSettings
from producer_api.grpc.stubs import inference_pb2_grpc
from tests.api.conftest import ALICE_KEY, BOB_KEY, MODEL, Stack

STACK_SETTINGS: dict[str, Any] = {
    "api_keys": {"alice": ALICE_KEY, "bob": BOB_KEY},
    "models": [MODEL],
    "poll_interval_s": 0.2,
    "worker_cache_s": 0.0,
}


def metadata(key: str = ALICE_KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@dataclass
class GrpcClient:
    channel: grpc.Channel
    stub: inference_pb2_grpc.InferenceStub
    port: int


@contextmanager
def grpc_server(stack: Stack, **overrides: Any) -> Iterator[GrpcClient]:
    """A gRPC server on `stack`'s Redis, with the test keys, and a channel to it."""
    settings = GrpcSettings(
        **{**STACK_SETTINGS, "redis_url": stack.redis_url, "grpc_port": 0, **overrides}
    )
    server = GrpcServer(settings)
    port = stack.bg.run(server.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield GrpcClient(channel, inference_pb2_grpc.InferenceStub(channel), port)
    finally:
        channel.close()
        stack.bg.run(server.stop(grace_s=1.0))


def trailing(error: grpc.RpcError) -> dict[str, str]:
    """The trailing metadata of a failed call."""
    assert isinstance(error, grpc.Call)
    return {key: value for key, value in error.trailing_metadata() or ()}
