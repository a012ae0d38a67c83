"""Operations endpoints (no API key needed): liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

from producer_api.deps import ApiState, State
from producer_api.load import ModelLoad, WorkerView, read_model_queues
from producer_api.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

router = APIRouter(tags=["ops"])

READY_TIMEOUT_S = 2.0


class ModelReadiness(BaseModel):
    """A served model's load, summed over its live workers (what a vLLM health check shows)."""

    model: str
    workers: int
    running: int = Field(description="requests in the workers' running batches")
    waiting: int = Field(description="requests a worker admitted that do not run yet")
    queued: int = Field(description="jobs in the model's queues no worker took yet")
    kv_cache_usage: float = Field(description="fraction of the workers' KV-cache blocks in use")
    max_model_len: int | None = Field(description="the smallest context among its workers")
    quantization: str | None = Field(
        None,
        description="the weight quantization its workers run (None: full precision; "
        '"mixed": they differ)',
    )


class Readiness(BaseModel):
    status: Literal["ready", "no_workers", "unavailable"]
    redis: bool
    workers: int
    models: list[str]
    load: list[ModelReadiness] = Field(description="per served model")


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up (says nothing about Redis or workers: see /ready)."""
    return {"status": "ok"}


@router.get(
    "/ready",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Redis down or no live worker"}},
)
async def ready(state: State) -> JSONResponse:
    """Ready when Redis answers and at least one worker is alive; with each served model's
    running and waiting requests, queued jobs and KV-cache usage."""
    body = Readiness(status="unavailable", redis=False, workers=0, models=[], load=[])
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await state.redis.ping()
            body.redis = True
            state.workers.forget()
            body.load = await _served_load(state)
    except (RedisError, OSError, TimeoutError):
        return JSONResponse(body.model_dump(), status_code=503)
    body.workers = sum(m.workers for m in body.load)
    body.models = [m.model for m in body.load]
    if not body.workers:
        body.status = "no_workers"
        return JSONResponse(body.model_dump(), status_code=503)
    body.status = "ready"
    return JSONResponse(body.model_dump())


async def _served_load(state: ApiState) -> list[ModelReadiness]:
    now = time.time()
    served = await state.workers.models()
    workers = [WorkerView.of(worker, now) for worker in await state.workers.live()]
    out = []
    for name in sorted(served):
        queues = await read_model_queues(state.redis, state.keys, name)
        load = ModelLoad.of(name, workers, queues, [])
        out.append(
            ModelReadiness(
                model=name,
                workers=load.workers,
                running=load.running,
                waiting=load.waiting,
                queued=load.queued,
                kv_cache_usage=load.kv_usage,
                max_model_len=served[name].max_model_len,
                quantization=served[name].quantization,
            )
        )
    return out


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(state: State) -> Response:
    """Prometheus text format: the API's requests by route and status, open SSE streams, and
    the system's series per model (see `producer_api.system_metrics`), also under vLLM's
    metric names."""
    try:
        await state.metrics.system.refresh(state.redis, state.keys)
    except (RedisError, OSError) as exc:
        # Still serve the request counters; the system's series keep their last values.
        log.debug("metrics: Redis unavailable: %s", exc)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
