"""The Redis server of `inferq up` (cli.up): the one that answers at --redis-url, or a
redis-server started for a local URL with its data (AOF) in the data dir."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis

from cli.addresses import LOOPBACK_HOSTS, redacted
from cli.up_system import Child, System, UpError
from engine.model_files import inferq_home

DEFAULT_REDIS_PORT = 6379


def default_data_dir(redis_url: str) -> Path:
    """One data dir per Redis port, so two stacks on different ports never share AOF files;
    the default port keeps the dir it always had."""
    port = urlsplit(redis_url).port or DEFAULT_REDIS_PORT
    return inferq_home() / ("redis" if port == DEFAULT_REDIS_PORT else f"redis-{port}")


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


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
