"""OpenAI's `POST /v1/embeddings`: each input becomes one embedding job on the model's queue
(the same admission, keys, deadlines, cancellation and recovery as generation); the call waits
for them all and answers OpenAI's list, the vectors as floats or base64 (little-endian float32,
as the official client decodes them)."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer_api.admission import check_task, limits_of, model_and_context, submit_all
from producer_api.deps import Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.prompt_check import check_prompt
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import ErrorCode, JobKind, JobRequest
from schemas.chunks import TokenId
from schemas.jobs import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
from schemas.pooling import PoolingParams

router = APIRouter(prefix="/v1", tags=["openai"], responses=error_responses(401, 503))

Text = str
TokenIds = list[TokenId]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    input: Text | list[Text] | TokenIds | list[TokenIds] = Field(
        description="a text, a list of texts, token ids, or a list of token-id lists"
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None, ge=1, description="keep the first this many dimensions (Matryoshka models)"
    )
    user: str | None = Field(None, max_length=256)


def embedding_inputs(body: EmbeddingRequest, limit: int) -> list[tuple[str | list[int], str]]:
    """Each input and the request field it came from; 400 naming the field for an empty one."""
    given = body.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        inputs: list[str | list[int]] = [given]  # type: ignore[list-item]
        params = ["input"]
    else:
        inputs = list(given)  # type: ignore[arg-type]
        params = [f"input.{index}" for index in range(len(inputs))]
    if not inputs:
        raise ApiError(ErrorCode.INVALID_REQUEST, "input: give at least one input", "input")
    if len(inputs) > limit:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"input: at most {limit} inputs in one request", "input"
        )
    for item, param in zip(inputs, params, strict=True):
        if not item:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: the input is empty", param)
        if isinstance(item, str) and len(item) > MAX_PROMPT_CHARS:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: the input is too long", param)
        if isinstance(item, list) and len(item) > MAX_PROMPT_TOKENS:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: the input is too long", param)
    return list(zip(inputs, params, strict=True))


def embedding_job(
    model: str, item: str | list[int], pooling: PoolingParams, timeout_s: float, param: str
) -> JobRequest:
    fields: dict[str, Any] = {"model": model, "pooling": pooling, "timeout_s": timeout_s}
    fields["prompt" if isinstance(item, str) else "prompt_token_ids"] = item
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {exc}", param) from exc


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


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
    data = []
    prompt_tokens = 0
    for index, job in enumerate(finished):
        result = job.result
        assert result is not None and result.embedding is not None
        prompt_tokens += result.usage.prompt_tokens
        vector = encode_vector(result.embedding, body.encoding_format)
        data.append({"object": "embedding", "index": index, "embedding": vector})
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": body.model, "usage": usage})
