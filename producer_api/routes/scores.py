"""vLLM's `POST /v1/score` and the Cohere/Jina-style `POST /v1/rerank` for embedding models:
each distinct text becomes one embedding job (producer_api.routes.embeddings), and a pair's
score is the cosine similarity of its two vectors (a bi-encoder's score). Cross-encoders score
offline only (`LLM.score`)."""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from producer_api.deps import Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.routes.embeddings import embed_inputs
from producer_api.routes.openai import GENERATION_ERRORS
from schemas import ErrorCode, Job
from schemas.jobs import MAX_PROMPT_CHARS

router = APIRouter(prefix="/v1", tags=["openai"], responses=error_responses(401, 503))

Text = str


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    text_1: Text | list[Text] = Field(
        description="one text (scored against every text_2) or a list"
    )
    text_2: Text | list[Text] = Field(description="the texts paired with text_1, in order")
    user: str | None = Field(None, max_length=256)


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    query: Text
    documents: list[Text] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1, description="the best this many (default: all)")
    return_documents: bool = True
    user: str | None = Field(None, max_length=256)


def _texts(given: Text | list[Text], param: str) -> list[tuple[str, str]]:
    """Each text and its field; 400 naming the field for an empty or over-long one."""
    items = (
        [(given, param)]
        if isinstance(given, str)
        else [(text, f"{param}.{index}") for index, text in enumerate(given)]
    )
    if not items:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"{param}: give at least one text", param)
    for text, field in items:
        if not text or len(text) > MAX_PROMPT_CHARS:
            reason = "the text is empty" if not text else "the text is too long"
            raise ApiError(ErrorCode.INVALID_REQUEST, f"{field}: {reason}", field)
    return items


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0


async def _vectors(
    state: State, caller: Caller, request: Request, model: str, texts: list[tuple[str, str]]
) -> tuple[dict[str, list[float]], int]:
    """The embedding of every distinct text (one job each), and the prompt tokens they took."""
    distinct: dict[str, str] = {}
    for text, param in texts:
        distinct.setdefault(text, param)
    limit = state.settings.max_embedding_inputs
    if len(distinct) > limit:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"at most {limit} distinct texts", "text_2")
    inputs: list[tuple[str | list[int], str]] = list(distinct.items())
    jobs: list[Job] = await embed_inputs(state, caller, request, model, inputs)
    vectors, tokens = {}, 0
    for text, job in zip(distinct, jobs, strict=True):
        assert job.result is not None and job.result.embedding is not None
        vectors[text] = job.result.embedding
        tokens += job.result.usage.prompt_tokens
    return vectors, tokens


@router.post("/score", responses=GENERATION_ERRORS)
async def score(body: ScoreRequest, request: Request, state: State, caller: Caller) -> JSONResponse:
    firsts, seconds = _texts(body.text_1, "text_1"), _texts(body.text_2, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"text_2: {len(seconds)} texts for {len(firsts)} in text_1 (give one text_1, or "
            "as many as text_2)",
            "text_2",
        )
    vectors, tokens = await _vectors(state, caller, request, body.model, firsts + seconds)
    data = [
        {"index": index, "object": "score", "score": cosine(vectors[a], vectors[b])}
        for index, ((a, _), (b, _)) in enumerate(zip(firsts, seconds, strict=True))
    ]
    return JSONResponse(
        {
            "id": f"score-{secrets.token_hex(8)}",
            "object": "list",
            "created": int(time.time()),
            "model": body.model,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


@router.post("/rerank", responses=GENERATION_ERRORS)
async def rerank(
    body: RerankRequest, request: Request, state: State, caller: Caller
) -> JSONResponse:
    query = _texts(body.query, "query")
    documents = _texts(body.documents, "documents")
    vectors, tokens = await _vectors(state, caller, request, body.model, query + documents)
    ranked = sorted(
        (
            (cosine(vectors[body.query], vectors[text]), index, text)
            for index, (text, _) in enumerate(documents)
        ),
        key=lambda item: (-item[0], item[1]),
    )
    results: list[dict[str, Any]] = []
    for relevance, index, text in ranked[: body.top_n or len(ranked)]:
        result: dict[str, Any] = {"index": index, "relevance_score": relevance}
        if body.return_documents:
            result["document"] = {"text": text}
        results.append(result)
    return JSONResponse(
        {
            "id": f"rerank-{secrets.token_hex(8)}",
            "model": body.model,
            "results": results,
            "usage": {"total_tokens": tokens},
        }
    )
