"""OpenAI's embeddings request and response shapes, and each input's job: shared by the live
`POST /v1/embeddings` and the Batch API's `/v1/embeddings` lines, so both run the same jobs."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer_api.errors import ApiError
from schemas import ErrorCode, Job, JobRequest
from schemas.chunks import TokenId
from schemas.jobs import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
from schemas.pooling import PoolingParams

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
    return checked_inputs(inputs, params, "input", limit)


def checked_inputs(
    inputs: list[str | list[int]], params: list[str], field: str, limit: int
) -> list[tuple[str | list[int], str]]:
    """The inputs with their fields (`params`, in the request field `field`), once none is
    empty or too long and there are 1 to `limit` of them; else 400 naming the field."""
    if not inputs:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{field}: give at least one input", field)
    if len(inputs) > limit:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, f"{field}: at most {limit} inputs in one request", field
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
    model: str, item: str | list[int], pooling: PoolingParams, timeout_s: float | None, param: str
) -> JobRequest:
    fields: dict[str, Any] = {"model": model, "pooling": pooling, "timeout_s": timeout_s}
    fields["prompt" if isinstance(item, str) else "prompt_token_ids"] = item
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {exc}", param) from exc


def inputs_job(requests: Sequence[JobRequest]) -> JobRequest:
    """One job of the checked single-input `requests` (same model, pooling and deadline): a
    queue job costs the API, Redis and the worker about the same for one input as for many,
    and the worker still runs each input as its own sequence."""
    first = requests[0]
    if len(requests) == 1:
        return first
    inputs: list[str | list[int]] = []
    for request in requests:
        item = request.prompt if request.prompt is not None else request.prompt_token_ids
        assert item is not None
        inputs.append(item)
    fields = first.model_dump(exclude_none=True, exclude={"prompt", "prompt_token_ids"})
    return JobRequest.model_validate({**fields, "inputs": inputs})


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def job_vectors(jobs: Sequence[Job]) -> list[tuple[list[float], int]]:
    """Each input's vector and prompt token count, in input order, from the succeeded jobs
    of a request's inputs: a job of one input or of several (`inputs`)."""
    pooled: list[tuple[list[float], int]] = []
    for job in jobs:
        result = job.result
        assert result is not None
        if result.embeddings is not None and result.input_tokens is not None:
            pooled.extend(zip(result.embeddings, result.input_tokens, strict=True))
        else:
            assert result.embedding is not None
            pooled.append((result.embedding, result.usage.prompt_tokens))
    return pooled


def embeddings_body(body: EmbeddingRequest, jobs: list[Job]) -> dict[str, Any]:
    """OpenAI's answer for the finished jobs of the request's inputs, in input order."""
    pooled = job_vectors(jobs)
    return vectors_body(body, [vector for vector, _ in pooled], sum(n for _, n in pooled))


def vectors_body(
    body: EmbeddingRequest, vectors: list[list[float]], prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's answer of the request's inputs' `vectors`, in input order."""
    data = [
        {"object": "embedding", "index": index, "embedding": encode_vector(v, body.encoding_format)}
        for index, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": body.model, "usage": usage}
