"""`inferq status`: the system at a glance in a terminal, read straight from Redis; and the
health checks containers run (`--check-worker`, `--check-url`).

    inferq status                       # models, workers (with their architecture, quantization
                                        # and weight size), queues, dead letters, rates
    inferq status --watch 2             # redraw every 2 s (Ctrl-C ends)
    inferq status --json                # the same snapshot the dashboard uses
    inferq status --check-worker        # exit 0 if this host's worker has a live heartbeat
    inferq status --check-url http://127.0.0.1:8000/health --check-url .../ready

Where it reads: `--redis-url` / `--prefix`, else INFERQ_REDIS_URL / INFERQ_PREFIX, as every
other inferq process. Exit codes: 0 fine, 1 a check failed or nothing of inferq is at that
Redis and prefix (the wrong place, most likely), 2 Redis unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from datetime import UTC, datetime

import httpx
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cli.addresses import redacted
from cli.flags import SettingsFlags, add_settings_arguments, same_setting
from producer_api.settings import ApiSettings
from producer_api.status import StatusSnapshot, TtftStats, read_snapshot
from producer_api.workers import parse_heartbeat
from redis_io.clients import redis_client
from schemas.redis_connection import RedisConnectionSettings

CHECK_TIMEOUT_S = 3.0


class StatusSettings(RedisConnectionSettings, BaseSettings):
    """Where `inferq status` reads: the Redis (or Sentinels) and prefix the API and the workers
    use."""

    model_config = SettingsConfigDict(env_prefix="INFERQ_", extra="ignore")

    prefix: str = same_setting(ApiSettings, "prefix")


def add_status_arguments(parser: argparse.ArgumentParser) -> SettingsFlags[StatusSettings]:
    flags = add_settings_arguments(parser, StatusSettings)
    add = parser.add_argument
    add(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    add("--json", action="store_true", help="print the snapshot as JSON")
    add(
        "--check-worker",
        nargs="?",
        const="",
        default=None,
        metavar="NAME",
        help="exit 0 when worker NAME (default: $INFERQ_NAME, else any worker named after "
        "this host) has a live heartbeat, else 1",
    )
    add(
        "--check-url",
        action="append",
        default=[],
        metavar="URL",
        help="exit 0 when every URL answers 200 (repeatable; e.g. the API's /health, /ready)",
    )
    return flags


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _ttft(stats: TtftStats) -> str:
    return f"{_ms(stats.ttft_p50_s)}/{_ms(stats.ttft_p99_s)}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _quantization(method: str | None) -> str:
    return method or "none"  # full precision (or a worker too old to say)


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f} MiB"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        cells = [
            str(c).rjust(w) if i else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(snapshot: StatusSnapshot, redis_url: str) -> str:
    """The snapshot as plain-text tables."""
    when = datetime.fromtimestamp(snapshot.at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    out = [f"inferq status  {redacted(redis_url)}  prefix {snapshot.prefix}  {when}", ""]
    windows = [w.window_s for w in snapshot.models[0].windows] if snapshot.models else []
    headers = ["MODEL", "workers", "KV used", "running", "waiting", "queued", "dead"]
    for window in windows:
        label = f"{window // 60}m" if window % 60 == 0 else f"{window}s"
        headers += [
            f"tok/s {label}",
            f"TTFT p50/p99 {label}",
            f"batch TTFT {label}",
            f"jobs {label}",
        ]
    rows = []
    for model in snapshot.models:
        row = [
            model.name,
            str(model.workers),
            f"{model.kv_usage:.0%}",
            str(model.running),
            str(model.waiting),
            str(model.queued),
            str(model.dead_letters),
        ]
        for w in model.windows:
            row += [
                _rate(w.tokens_per_s),
                _ttft(w.interactive),
                _ttft(w.batch),
                str(w.jobs_finished),
            ]
        rows.append(row)
    out += _table(headers, rows) if rows else ["MODELS  (none: nothing queued, no live worker)"]

    out.append("")
    rows = [
        [
            w.name,
            w.model,
            w.architecture or "-",
            _quantization(w.quantization),
            _mib(w.weight_bytes),
            f"{w.kv_usage:.0%} ({w.kv_blocks_total - w.kv_blocks_free}/{w.kv_blocks_total})",
            str(w.running),
            str(w.waiting),
            str(w.generated_tokens),
            ",".join(w.lora_adapters) or "-",
            ",".join(w.lora_resident) or "-",
            ",".join(w.lora_cached) or "-",
            _ago(w.heartbeat_age_s),
            _ago(w.uptime_s),
            w.version,
        ]
        for w in snapshot.workers
    ]
    headers = [
        "WORKER",
        "model",
        "architecture",
        "quantization",
        "weights",
        "KV used (blocks)",
        "running",
        "waiting",
        "generated",
        "LoRA adapters",
        "LoRA resident",
        "LoRA cached",
        "beat",
        "up",
        "version",
    ]
    out += (
        _table(headers, rows) if rows else [f"WORKERS  (none alive: {_where(snapshot, redis_url)})"]
    )

    out.append("")
    rows = [
        [
            q.model,
            q.kind,
            str(q.length),
            str(q.pending),
            str(q.waiting),
            _ago(q.oldest_waiting_age_s) if q.waiting else "-",
        ]
        for q in snapshot.queues
    ]
    headers = ["QUEUE (model)", "kind", "XLEN", "pending", "waiting", "oldest waiting"]
    out += _table(headers, rows) if rows else ["QUEUES  (none)"]

    out.append("")
    rows = [
        [
            d.model,
            str(d.count),
            d.last_reason or "-",
            d.last_at or "-",
            (d.last_message or "-")[:60],
        ]
        for d in snapshot.dead_letters
    ]
    headers = ["DEAD LETTERS", "count", "last reason", "at", "message"]
    out += _table(headers, rows) if rows else ["DEAD LETTERS  (none)"]
    return "\n".join(out) + "\n"


def _client(where: RedisConnectionSettings) -> Redis:
    return redis_client(
        where, socket_timeout=CHECK_TIMEOUT_S, socket_connect_timeout=CHECK_TIMEOUT_S
    )


async def _snapshot(where: RedisConnectionSettings, prefix: str) -> StatusSnapshot:
    redis = _client(where)
    try:
        return await read_snapshot(redis, where.redis_keys(prefix))
    finally:
        await redis.aclose()


def worker_is_alive(
    where: RedisConnectionSettings, prefix: str, name: str | None
) -> tuple[bool, str]:
    """Whether worker `name` (or, for None/"", $INFERQ_NAME or any worker named after this
    host, as the worker's default name `host-pid-random` is) has a live heartbeat."""

    async def check() -> tuple[bool, str]:
        keys = where.redis_keys(prefix)
        redis = _client(where)
        try:
            wanted = name or os.environ.get("INFERQ_NAME")
            if wanted:
                names = [keys.worker(wanted)]
            else:
                host = socket.gethostname()
                names = [k async for k in redis.scan_iter(keys.worker(host) + "-*", count=500)]
            for key in names:
                live = parse_heartbeat(await redis.hgetall(key))
                if live is not None:
                    return True, f"worker {live.name} alive ({live.model})"
            return False, f"no live heartbeat for worker {wanted or socket.gethostname() + '-*'}"
        finally:
            await redis.aclose()

    return asyncio.run(check())


def urls_answer(urls: list[str]) -> tuple[bool, str]:
    notes, ok = [], True
    with httpx.Client(timeout=CHECK_TIMEOUT_S) as http:
        for url in urls:
            try:
                code = http.get(url).status_code
            except httpx.HTTPError as exc:
                code, ok = None, False
                notes.append(f"{url}: {type(exc).__name__}")
                continue
            ok = ok and code == 200
            notes.append(f"{url}: {code}")
    return ok, "; ".join(notes)


def _where(snapshot: StatusSnapshot, redis_url: str) -> str:
    return f"no worker heartbeat seen at {redacted(redis_url)}, prefix {snapshot.prefix!r}"


def is_empty(snapshot: StatusSnapshot) -> bool:
    """Nothing of inferq under this prefix: no worker, queue, model or dead letter."""
    return not (snapshot.workers or snapshot.queues or snapshot.models or snapshot.dead_letters)


def _unreachable(redis_url: str, exc: Exception) -> int:
    print(
        f"inferq status: error: no Redis answers at {redacted(redis_url)} ({exc}); "
        "pass --redis-url or set INFERQ_REDIS_URL",
        file=sys.stderr,
    )
    return 2


def run_status(settings: StatusSettings, args: argparse.Namespace) -> int:
    """Print the snapshot (once, or every --watch seconds), or run the health checks."""
    redis_url, prefix = settings.redis_url, settings.prefix
    if args.check_worker is not None or args.check_url:
        ok, notes = True, []
        try:
            if args.check_worker is not None:
                alive, note = worker_is_alive(settings, prefix, args.check_worker)
                ok, notes = ok and alive, [*notes, note]
        except (RedisError, OSError) as exc:
            return _unreachable(redis_url, exc)
        if args.check_url:
            answered, note = urls_answer(args.check_url)
            ok, notes = ok and answered, [*notes, note]
        print("; ".join(notes))
        return 0 if ok else 1
    try:
        while True:
            snapshot = asyncio.run(_snapshot(settings, prefix))
            if args.json:
                text = json.dumps(snapshot.to_dict(), indent=2) + "\n"
            else:
                text = render(snapshot, redis_url)
            if args.watch:
                sys.stdout.write("\x1b[2J\x1b[H")  # clear the screen, cursor home
            sys.stdout.write(text)
            sys.stdout.flush()
            if not args.watch:
                if is_empty(snapshot):
                    print(
                        f"inferq status: nothing of inferq here ({_where(snapshot, redis_url)}, "
                        "no queue, no dead letter): pass --redis-url / --prefix or set "
                        "INFERQ_REDIS_URL / INFERQ_PREFIX to where the system runs",
                        file=sys.stderr,
                    )
                    return 1
                return 0
            time.sleep(args.watch)
    except (RedisError, OSError) as exc:
        return _unreachable(redis_url, exc)
    except KeyboardInterrupt:
        return 0
