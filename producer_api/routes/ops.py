"""Operations endpoints (no API key needed): liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from producer_api.deps import State
from producer_api.metrics import CONTENT_TYPE, known_models, queue_stats

router = APIRouter(tags=["ops"])

READY_TIMEOUT_S = 2.0


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (says nothing about Redis or workers: see /ready)."""
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "Redis down or no live worker"}})
async def ready(state: State) -> JSONResponse:
    """Ready when Redis answers and at least one worker is alive."""
    body: dict[str, Any] = {"redis": False, "workers": 0, "models": []}
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await state.redis.ping()
            body["redis"] = True
            state.workers.forget()
            served = await state.workers.models()
    except (RedisError, OSError, TimeoutError):
        return JSONResponse({"status": "unavailable", **body}, status_code=503)
    body["workers"] = sum(m.workers for m in served.values())
    body["models"] = sorted(served)
    if not body["workers"]:
        return JSONResponse({"status": "no_workers", **body}, status_code=503)
    return JSONResponse({"status": "ready", **body})


@router.get("/metrics", response_class=Response)
async def metrics(state: State) -> Response:
    """Prometheus text format: requests by route and status, queue length, pending and oldest
    queued age per model, live workers per model, open SSE streams."""
    try:
        served = await state.workers.models()
        models = sorted(set(await known_models(state.redis, state.keys)) | set(served))
        stats = [await queue_stats(state.redis, state.keys, model) for model in models]
        state.metrics.set_queue_stats(stats, {name: m.workers for name, m in served.items()})
    except (RedisError, OSError):
        pass  # still serve the request counters; the queue gauges keep their last values
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
