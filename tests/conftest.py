"""Shared test fixtures: real throw-away Redis servers, fakeredis, and the anyio backend.

Real Redis: `redis_server` (one server per test, restartable: `.stop()`, `.kill()`, `.start()`
on the same port and data dir, AOF with fsync on every write so even SIGKILL loses nothing) and
`redis_url` (a URL to a session-wide server, flushed before each test: use it when you don't
restart the server). Async tests: mark them `@pytest.mark.anyio` (asyncio backend only).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Triton kernels run in the interpreter on machines without an NVIDIA GPU. The flag is read when
# a kernel is decorated, which some libraries do on import, so set it before anything else runs.
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REDIS_SERVER_ENV = "INFERQ_REDIS_SERVER"
_START_TIMEOUT_S = 15.0


def _find_redis_server() -> str | None:
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return explicit
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the server gets SIGKILL if the test process dies, so no server outlives pytest.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server child process on a fixed port and data dir, with AOF persistence."""

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.port = port or _free_port()
        self.extra_args = extra_args  # e.g. cluster mode (tests/cluster)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start (or restart) on the same port and data dir; the AOF restores earlier data."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            *self.extra_args,
        ]  # fmt: skip
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=preexec
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start:\n{self._log_tail()}")
            if _ping(self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING in time:\n{self._log_tail()}")

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM: Redis flushes the AOF and exits)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as if the machine lost the process."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"


def find_redis_binary() -> str:
    """redis-server's path; skips the test when there is none."""
    binary = _find_redis_server()
    if binary is None:
        pytest.skip(
            "redis-server not found (looked at $INFERQ_REDIS_SERVER, PATH, /usr/bin): install "
            "it as the README's test instructions say (apt-get install -y redis-server)"
        )
    return binary


def _started_server(data_dir: Path) -> RedisServer:
    binary = find_redis_binary()
    last_error: Exception | None = None
    for _ in range(3):  # another process may grab the free port between probe and bind
        server = RedisServer(binary, data_dir)
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last_error = exc
            server.kill()
    raise RuntimeError(f"could not start redis-server: {last_error}")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private Redis server for one test; it may be stopped, killed and restarted."""
    server = _started_server(tmp_path / "redis")
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def shared_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One Redis server for the whole session; don't stop it (use `redis_server` for that)."""
    server = _started_server(tmp_path_factory.mktemp("redis-shared"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def redis_url(shared_redis_server: RedisServer) -> str:
    """URL of the session's Redis server, emptied (FLUSHALL) for this test."""
    if not shared_redis_server.running:
        shared_redis_server.start()
    with socket.create_connection(("127.0.0.1", shared_redis_server.port), timeout=5) as sock:
        sock.sendall(b"FLUSHALL\r\n")
        assert sock.recv(64).startswith(b"+OK")
    return shared_redis_server.url


@pytest.fixture
def fake_redis():
    """An in-memory asyncio Redis (fakeredis), str responses; fresh per test."""
    import fakeredis

    return fakeredis.aioredis.FakeRedis(decode_responses=True)


@pytest.fixture
def fake_redis_sync():
    """An in-memory synchronous Redis (fakeredis), str responses; fresh per test."""
    import fakeredis

    return fakeredis.FakeRedis(decode_responses=True)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """`@pytest.mark.anyio` tests run on asyncio only (redis.asyncio needs it)."""
    return "asyncio"
