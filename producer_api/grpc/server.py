"""The gRPC server process: `inferq.v1.Inference`, the standard health service and server
reflection on one `grpc.aio` server, over the producer state the HTTP app uses.

Health: the overall service ("") is SERVING while the process runs (as /health); the
`inferq.v1.Inference` service is SERVING while Redis answers and a worker is alive (as /ready),
re-checked every HEALTH_INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from contextlib import AsyncExitStack

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from redis.exceptions import RedisError

from producer_api.deps import ApiState
from producer_api.grpc.servicer import InferenceServicer
from producer_api.grpc.settings import GrpcSettings
from producer_api.grpc.stubs import SERVICE_NAME, inference_pb2_grpc
from producer_api.metrics import ApiMetrics
from producer_api.state import open_state

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 2.0
STOP_GRACE_S = 5.0  # open calls get this long to end when the server stops
OVERALL = ""  # the health service's name for the whole server
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    """One gRPC server over its own producer state: `await start()`, then `await stop()`."""

    def __init__(self, settings: GrpcSettings) -> None:
        self.settings = settings
        self.port = 0
        self._exit = AsyncExitStack()
        self._server: aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen on the configured host and port; returns the port (the one chosen for 0)."""
        state = await self._exit.enter_async_context(open_state(self.settings, ApiMetrics()))
        server = aio.server(
            options=[
                # the same bound as the HTTP API's request bodies
                ("grpc.max_receive_message_length", self.settings.max_body_bytes),
            ]
        )
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server,
        )  # fmt: skip
        address = f"{self.settings.host}:{self.settings.grpc_port}"
        self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        await self._health.set(OVERALL, _SERVING)
        await self._update_health(state)
        self._watch = asyncio.ensure_future(self._watch_health(state))
        log.info("gRPC server listening on %s:%d", self.settings.host, self.port)
        return self.port

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def stop(self, grace_s: float | None = STOP_GRACE_S) -> None:
        """Stop taking calls, give open ones `grace_s` to end, and close the state."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
        await self._exit.aclose()

    async def _watch_health(self, state: ApiState) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self._update_health(state)

    async def _update_health(self, state: ApiState) -> None:
        try:
            async with asyncio.timeout(HEALTH_CHECK_TIMEOUT_S):
                await state.redis.ping()
                serving = bool(await state.workers.models())
        except (RedisError, OSError, TimeoutError):
            serving = False
        await self._health.set(SERVICE_NAME, _SERVING if serving else _NOT_SERVING)


async def serve(settings: GrpcSettings) -> None:
    """Serve until SIGTERM / SIGINT, then stop gracefully."""
    server = GrpcServer(settings)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
        log.info("gRPC server stopping")
    finally:
        await server.stop()


def run_grpc(settings: GrpcSettings) -> int:
    """Serve the gRPC API in this process until Ctrl-C / SIGTERM (what `inferq grpc` runs)."""
    asyncio.run(serve(settings))
    return 0
