"""A throw-away Redis high-availability set on free local ports: one master, one replica and
three Sentinels (quorum 2), each a `redis-server` child with its config in a scratch folder.
Used by the failover test (tests/deploy/test_redis_failover.py) and bench/availability/redis_ha.py.

Sentinel timings are short (down-after 1 s, failover-timeout 5 s) so a failover takes a few
seconds instead of the production defaults' half a minute."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

MASTER_NAME = "inferq"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_binary() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )


def ask(port: int, *command: str, timeout: float = 1.0) -> str:
    """One RESP command over a plain socket (no client library): the reply as text, '' when
    nothing answers."""
    parts = [f"*{len(command)}\r\n"] + [f"${len(c.encode())}\r\n{c}\r\n" for c in command]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall("".join(parts).encode())
            time.sleep(0.02)
            return sock.recv(65536).decode(errors="replace")
    except OSError:
        return ""


@dataclass
class SentinelCluster:
    """Start with `start()`, end with `stop()`; `kill_master()` is the SIGKILL under test."""

    root: Path
    binary: str
    master_port: int = field(default_factory=free_port)
    replica_port: int = field(default_factory=free_port)
    sentinel_count: int = 3
    sentinel_ports: list[int] = field(default_factory=list)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sentinel_ports = self.sentinel_ports or [
            free_port() for _ in range(self.sentinel_count)
        ]

    @property
    def sentinels(self) -> str:
        """The value of INFERQ_REDIS_SENTINELS."""
        return ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)

    def env(self, wait_replicas: int = 1) -> dict[str, str]:
        """What every inferq process needs to follow this set."""
        return {
            "INFERQ_REDIS_SENTINELS": self.sentinels,
            "INFERQ_REDIS_MASTER_NAME": MASTER_NAME,
            "INFERQ_REDIS_WAIT_REPLICAS": str(wait_replicas),
            "INFERQ_REDIS_URL": f"redis://127.0.0.1:{self.master_port}/0",
        }

    def start(self, *, sentinels: bool = True) -> None:
        """Master and replica, then (unless `sentinels` is False) the Sentinels, once each
        knows the replica and the other Sentinels."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._server("master", self.master_port)
        self._server(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port)
        )
        self._wait(lambda: "master_link_status:up" in ask(self.replica_port, "INFO", "replication"))
        if sentinels:
            self.start_sentinels()

    def start_sentinels(self, *, wait_for_peers: bool = True) -> None:
        """The Sentinels; with `wait_for_peers`, until every one knows the replica and the
        other Sentinels (which a failover needs; a client only needs the master's address)."""
        for number, port in enumerate(self.sentinel_ports):
            config = self.root / f"sentinel-{number}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.root}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n"
            )
            self._start(f"sentinel-{number}", port, [str(config), "--sentinel"])
        if wait_for_peers:
            self._wait(lambda: all(self._sees_peers(port) for port in self.sentinel_ports), 30)

    @property
    def quorum(self) -> int:
        return min(2, len(self.sentinel_ports))

    def master_port_now(self) -> int | None:
        """The master's port as the first answering Sentinel names it."""
        for port in self.sentinel_ports:
            reply = ask(port, "SENTINEL", "get-master-addr-by-name", MASTER_NAME)
            lines = reply.split("\r\n")
            if len(lines) >= 5 and lines[4].isdigit():
                return int(lines[4])
        return None

    def kill_master(self) -> None:
        process = self.processes.pop("master")
        process.kill()
        process.wait()

    def wait_promoted(self, timeout: float = 60.0) -> float:
        """Seconds until the Sentinels name the replica as master."""
        started = time.monotonic()
        self._wait(lambda: self.master_port_now() == self.replica_port, timeout)
        return time.monotonic() - started

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.processes.clear()

    def _sees_peers(self, port: int) -> bool:
        reply = ask(port, "SENTINEL", "master", MASTER_NAME)
        lines = reply.split("\r\n")
        fields = dict(zip(lines[2::4], lines[4::4], strict=False))
        others = str(len(self.sentinel_ports) - 1)
        return fields.get("num-slaves") == "1" and fields.get("num-other-sentinels") == others

    def _server(self, name: str, port: int, *extra: str) -> None:
        args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once, not after 5 s
        self._start(name, port, [*args, "--dir", str(self.root), *extra])

    def _start(self, name: str, port: int, args: list[str]) -> None:
        log = self.root / f"{name}.log"
        self.processes[name] = subprocess.Popen(
            [self.binary, *args, "--logfile", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait(lambda: "PONG" in ask(port, "PING"), 10)

    def _wait(self, condition, timeout: float = 10.0) -> None:
        give_up = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > give_up:
                logs = {p.name: p.read_text()[-800:] for p in self.root.glob("*.log")}
                raise RuntimeError(f"the Redis HA set did not settle: {logs}")
            time.sleep(0.1)
