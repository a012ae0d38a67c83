"""OpenAI's `POST /v1/embeddings`: the inputs become one embedding job on the model's queue
(the same admission, keys, deadlines, cancellation and recovery as generation; the worker runs
each input as its own sequence); the call waits for it and answers OpenAI's list, the vectors as
floats or base64 (little-endian float32, as the official client decodes them)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from producer_api.admission import admit_embeddings
from producer_api.auth import Principal
from producer_api.deps import ApiState, Caller, State
from producer_api.errors import error_responses
from producer_api.openai_embeddings import EmbeddingRequest, embedding_inputs, embeddings_body
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import Job

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
    """Queue the inputs' embedding job (admit_embeddings) and wait for it."""
    timeout_s = state.settings.request_timeout_s
    jobs = await admit_embeddings(state, caller, model, inputs, dimensions, timeout_s)
    return await wait_all(state, request, jobs)
