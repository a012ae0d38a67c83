"""`inferq api`: the API alone (uvicorn), configured by INFERQ_* settings plus a few flags."""

from __future__ import annotations

import argparse
import sys

from producer_api.settings import ApiSettings


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default=None, help="listen address (default INFERQ_HOST or 127.0.0.1)")
    add("--port", type=int, default=None, help="listen port (default INFERQ_PORT or 8000)")
    add("--redis-url", default=None, help="default INFERQ_REDIS_URL")


def run_api(args: argparse.Namespace) -> int:
    """Serve the API in this process until Ctrl-C / SIGTERM."""
    import uvicorn

    from producer_api.app import create_app

    overrides = {
        name: getattr(args, name)
        for name in ("host", "port", "redis_url")
        if getattr(args, name, None) is not None
    }
    try:
        settings = ApiSettings(**overrides)
    except ValueError as exc:
        print(f"inferq api: error: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=getattr(args, "log_level", "info"),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inferq api", description=__doc__)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_api_arguments(parser)
    return run_api(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
