"""OpenAI's `POST /v1/embeddings`: each input becomes one embedding job on the model's queue
(the same admission, keys, deadlines, cancellation and recovery as generation); the call waits
for them all and answers OpenAI's list, the vectors as floats or base64 (little-endian float32,
as the official client decodes them)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from producer_api.admission import check_task, limits_of, model_and_context, submit_all
from producer_api.auth import Principal
from producer_api.deps import ApiState, Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.openai_embeddings import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_job,
    embeddings_body,
)
from producer_api.prompt_check import check_prompt
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import ErrorCode, Job, JobKind
from schemas.pooling import PoolingParams

router = APIRouter(prefix="/v1", tags=["openai"], responses=error_responses(401, 503))


@router.post("/embeddings", responses=GENERATION_ERRORS)
async def embeddings(
    body: EmbeddingRequest, request: Request, state: State, caller: Caller
) -> JSONResponse:
    inputs = embedding_inputs(body, state.settings.max_embedding_inputs)
    finished = await embed_inputs(state, caller, request, body.model, inputs, body.dimensions)
    return JSONResponse(embeddings_body(body, finished))


async def embed_inputs(
    state: ApiState,
    caller: Principal,
    request: Request,
    model: str,
    inputs: list[tuple[str | list[int], str]],
    dimensions: int | None = None,
) -> list[Job]:
    """Check the model serves embeddings (and `dimensions`), each input against it, queue one
    embedding job per input, and wait for them all (each input's field named on refusal)."""
    served, context = await model_and_context(state, model, allow_configured=False)
    check_task(served, JobKind.EMBEDDING)
    size = served.embedding_size if served is not None else None
    if dimensions is not None and size is not None and dimensions > size:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"dimensions: {dimensions} is more than this model's {size}",
            "dimensions",
        )
    limits = await limits_of(state, served, context)
    pooling = PoolingParams(dimensions=dimensions)
    timeout_s = state.settings.request_timeout_s
    requests = []
    for item, param in inputs:
        job_request = embedding_job(model, item, pooling, timeout_s, param)
        await check_prompt(job_request, limits, param)
        requests.append(job_request)
    jobs = await submit_all(state, caller, requests)
    return await wait_all(state, request, jobs)
