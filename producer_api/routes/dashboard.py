"""The live dashboard: `/dashboard` is one self-contained HTML page (inline CSS and JS, no build
step) that polls `/dashboard/data`, the `producer_api.status` snapshot as JSON. Like /metrics it
needs no API key: it shows model and worker names and load, never prompts or outputs."""

from __future__ import annotations

import logging
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse
from redis.exceptions import RedisError

from producer_api.deps import State
from producer_api.errors import error_response, error_responses
from producer_api.status import read_snapshot
from schemas import ErrorBody, ErrorCode

log = logging.getLogger(__name__)

router = APIRouter(tags=["ops"])


@cache
def dashboard_page() -> str:
    return resources.files("producer_api").joinpath("static/dashboard.html").read_text("utf-8")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The dashboard page; it refreshes itself from /dashboard/data every few seconds."""
    return HTMLResponse(dashboard_page(), headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/data", responses=error_responses(503))
async def dashboard_data(state: State) -> JSONResponse:
    """Models (queue depth, workers, KV usage, tokens/s, TTFT p50/p99 over the last 1 and 5
    minutes, a tokens/s series), workers, queues and dead letters, read from Redis now."""
    try:
        snapshot = await read_snapshot(state.redis, state.keys)
    except (RedisError, OSError) as exc:
        log.warning("dashboard data unavailable: %s", exc)
        body = ErrorBody.of(ErrorCode.UNAVAILABLE, "the queue (Redis) cannot be reached")
        retry = {"Retry-After": str(state.settings.retry_after_s)}
        return error_response(body, "/dashboard/data", headers=retry)
    return JSONResponse(snapshot.to_dict(), headers={"Cache-Control": "no-store"})
