"""The FastAPI app: `create_app(settings)`; one Redis connection pool per process.

python -m uvicorn producer_api.app:create_app --factory --port 8000   # settings from INFERQ_*
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from producer_api.batches import routes as batches_routes
from producer_api.errors import error_response, install_error_handlers
from producer_api.limits import BodySizeLimitMiddleware
from producer_api.metrics import ApiMetrics, RequestMetricsMiddleware
from producer_api.openapi import install_openapi
from producer_api.routes import (
    dashboard,
    embeddings,
    generate,
    jobs,
    lora,
    openai,
    ops,
    scores,
    tokenize,
)
from producer_api.settings import ApiSettings
from producer_api.state import open_state
from schemas import ErrorBody, ErrorCode

log = logging.getLogger(__name__)

API_VERSION = "0.1.0"
MULTIPART_OVERHEAD_BYTES = 64 * 1024


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    settings = settings or ApiSettings()
    metrics = ApiMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with open_state(settings, metrics) as state:
            app.state.inferq = state
            yield

    app = FastAPI(
        title="inferq",
        version=API_VERSION,
        description="Queue-backed LLM inference: a jobs API and an OpenAI-compatible API.",
        lifespan=lifespan,
    )
    install_error_handlers(app, settings.retry_after_s)
    install_openapi(app)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = ErrorBody.of(ErrorCode.INTERNAL_ERROR, "internal error")
        return error_response(body, request.url.path, status=500)

    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(lora.router)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.include_router(embeddings.router)  # OpenAI's /v1/embeddings (embedding jobs)
    app.include_router(scores.router)  # /v1/score, /v1/rerank: cosine of embedding jobs
    app.include_router(generate.router)  # vLLM's simple /generate
    app.include_router(tokenize.router)  # vLLM's /tokenize, /detokenize, /version
    app.include_router(ops.router)
    app.include_router(batches_routes.router)  # Files + Batch API
    app.include_router(dashboard.router)
    # Outermost first: count every response, the body-size refusals included.
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        # A batch file upload: the file plus its multipart envelope.
        path_limits={"/v1/files": settings.max_file_bytes + MULTIPART_OVERHEAD_BYTES},
    )
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app
