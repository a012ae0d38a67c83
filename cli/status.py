"""`inferq status`: the system at a glance in a terminal, read straight from Redis; and the
health checks containers run (`--check-worker`, `--check-url`).

    inferq status                       # models, workers, queues, dead letters, rates
    inferq status --watch 2             # redraw every 2 s (Ctrl-C ends)
    inferq status --json                # the same snapshot the dashboard uses
    inferq status --check-worker        # exit 0 if this host's worker has a live heartbeat
    inferq status --check-url http://127.0.0.1:8000/health --check-url .../ready

Exit codes: 0 fine, 1 a check failed, 2 Redis unreachable.
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
from urllib.parse import urlsplit, urlunsplit

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from producer_api.status import StatusSnapshot, TtftStats, read_snapshot
from producer_api.workers import parse_heartbeat
from schemas import DEFAULT_PREFIX, RedisKeys
from schemas.defaults import DEFAULT_REDIS_URL

CHECK_TIMEOUT_S = 3.0


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--redis-url", default=os.environ.get("INFERQ_REDIS_URL", DEFAULT_REDIS_URL))
    add("--prefix", default=os.environ.get("INFERQ_PREFIX", DEFAULT_PREFIX))
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


def redacted(url: str) -> str:
    """The URL without its password (for printing)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


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
            f"{w.kv_usage:.0%} ({w.kv_blocks_total - w.kv_blocks_free}/{w.kv_blocks_total})",
            str(w.running),
            str(w.waiting),
            str(w.generated_tokens),
            _ago(w.heartbeat_age_s),
            _ago(w.uptime_s),
            w.version,
        ]
        for w in snapshot.workers
    ]
    headers = [
        "WORKER",
        "model",
        "KV used (blocks)",
        "running",
        "waiting",
        "generated",
        "beat",
        "up",
        "version",
    ]
    out += _table(headers, rows) if rows else ["WORKERS  (none alive)"]

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


async def _snapshot(redis_url: str, prefix: str) -> StatusSnapshot:
    redis = Redis.from_url(redis_url, decode_responses=True, socket_timeout=CHECK_TIMEOUT_S)
    try:
        return await read_snapshot(redis, RedisKeys(prefix))
    finally:
        await redis.aclose()


def worker_is_alive(redis_url: str, prefix: str, name: str | None) -> tuple[bool, str]:
    """Whether worker `name` (or, for None/"", $INFERQ_NAME or any worker named after this
    host, as the worker's default name `host-pid-random` is) has a live heartbeat."""

    async def check() -> tuple[bool, str]:
        keys = RedisKeys(prefix)
        redis = Redis.from_url(redis_url, decode_responses=True, socket_timeout=CHECK_TIMEOUT_S)
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
                    return True, f"worker {live.info.name} alive ({live.info.model})"
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


def run_status(args: argparse.Namespace) -> int:
    """Print the snapshot (once, or every --watch seconds), or run the health checks."""
    if args.check_worker is not None or args.check_url:
        ok, notes = True, []
        try:
            if args.check_worker is not None:
                alive, note = worker_is_alive(args.redis_url, args.prefix, args.check_worker)
                ok, notes = ok and alive, [*notes, note]
        except (RedisError, OSError) as exc:
            print(f"inferq status: Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
            return 2
        if args.check_url:
            answered, note = urls_answer(args.check_url)
            ok, notes = ok and answered, [*notes, note]
        print("; ".join(notes))
        return 0 if ok else 1
    try:
        while True:
            snapshot = asyncio.run(_snapshot(args.redis_url, args.prefix))
            if args.json:
                text = json.dumps(snapshot.to_dict(), indent=2) + "\n"
            else:
                text = render(snapshot, args.redis_url)
            if args.watch:
                sys.stdout.write("\x1b[2J\x1b[H")  # clear the screen, cursor home
            sys.stdout.write(text)
            sys.stdout.flush()
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except (RedisError, OSError) as exc:
        print(f"inferq status: Redis at {redacted(args.redis_url)}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
