"""OpenAI's `POST /v1/embeddings`: each input becomes one embedding job on the model's queue
(the same admission, keys, deadlines, cancellation and recovery as generation); the call waits
for them all and answers OpenAI's list, the vectors as floats or base64 (little-endian float32,
as the official client decodes them)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from producer_api.admission import check_task, limits_of, model_and_context, submit_all
from producer_api.deps import Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.openai_embeddings import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_job,
    embeddings_body,
)
from producer_api.prompt_check import check_prompt
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import ErrorCode, JobKind
from schemas.pooling import PoolingParams

router = APIRouter(prefix="/v1", tags=["openai"], responses=error_responses(401, 503))


@router.post("/embeddings", responses=GENERATION_ERRORS)
async def embeddings(
    body: EmbeddingRequest, request: Request, state: State, caller: Caller
) -> JSONResponse:
    inputs = embedding_inputs(body, state.settings.max_embedding_inputs)
    served, context = await model_and_context(state, body.model, allow_configured=False)
    check_task(served, JobKind.EMBEDDING)
    size = served.embedding_size if served is not None else None
    if body.dimensions is not None and size is not None and body.dimensions > size:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"dimensions: {body.dimensions} is more than this model's {size}",
            "dimensions",
        )
    limits = await limits_of(state, served, context)
    pooling = PoolingParams(dimensions=body.dimensions)
    timeout_s = state.settings.request_timeout_s
    requests = []
    for item, param in inputs:
        job_request = embedding_job(body.model, item, pooling, timeout_s, param)
        await check_prompt(job_request, limits, param)
        requests.append(job_request)
    jobs = await submit_all(state, caller, requests)
    finished = await wait_all(state, request, jobs)
    return JSONResponse(embeddings_body(body, finished))
