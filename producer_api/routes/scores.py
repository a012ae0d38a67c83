"""vLLM's `POST /v1/score` and the Cohere/Jina-style `POST /v1/rerank`. For a cross-encoder
(its workers take score jobs) each pair is one score job, scored as sentence-transformers'
CrossEncoder does (the sigmoid of its one logit); for an embedding model each distinct text is
one embedding job (producer_api.routes.embeddings) and a pair's score is the cosine similarity
of its two vectors (a bi-encoder's score)."""

from __future__ import annotations

import math
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from producer_api.admission import check_task, limits_of, model_and_context, submit_all
from producer_api.deps import Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.openai_embeddings import job_vectors
from producer_api.prompt_check import check_prompt
from producer_api.routes.embeddings import embed_inputs
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import ErrorCode, Job, JobKind, JobRequest
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


def _sigmoid(logits: list[float]) -> float:
    if len(logits) != 1:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"model: scores come from one-label cross-encoders (this one has {len(logits)})",
            "model",
        )
    return 1.0 / (1.0 + math.exp(-logits[0]))


async def _pair_scores(
    state: State,
    caller: Caller,
    request: Request,
    model: str,
    firsts: list[tuple[str, str]],
    seconds: list[tuple[str, str]],
) -> tuple[list[float], int] | None:
    """Each pair's cross-encoder score (one score job each) and the prompt tokens they took;
    None where the model's workers are no cross-encoder (they embed, or none beats yet)."""
    served, context = await model_and_context(state, model, allow_configured=False)
    if served is None or JobKind.SCORE not in served.tasks:
        return None
    check_task(served, JobKind.SCORE)
    limits = await limits_of(state, served, context)
    requests = []
    timeout_s = state.settings.request_timeout_s
    for (first, param), (second, _) in zip(firsts, seconds, strict=True):
        fields = {"model": model, "prompt": first, "prompt_pair": second, "pooling": {}}
        job_request = JobRequest.model_validate({**fields, "timeout_s": timeout_s})
        await check_prompt(job_request, limits, param)
        requests.append(job_request)
    jobs = await wait_all(state, request, await submit_all(state, caller, requests))
    scores, tokens = [], 0
    for job in jobs:
        assert job.result is not None and job.result.embedding is not None
        scores.append(_sigmoid(job.result.embedding))
        tokens += job.result.usage.prompt_tokens
    return scores, tokens


async def _vectors(
    state: State, caller: Caller, request: Request, model: str, texts: list[tuple[str, str]]
) -> tuple[dict[str, list[float]], int]:
    """The embedding of every distinct text, and the prompt tokens they took."""
    distinct: dict[str, str] = {}
    for text, param in texts:
        distinct.setdefault(text, param)
    limit = state.settings.max_embedding_inputs
    if len(distinct) > limit:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"at most {limit} distinct texts", "text_2")
    inputs: list[tuple[str | list[int], str]] = list(distinct.items())
    jobs: list[Job] = await embed_inputs(state, caller, request, model, inputs)
    vectors, tokens = {}, 0
    for text, (vector, count) in zip(distinct, job_vectors(jobs), strict=True):
        vectors[text] = vector
        tokens += count
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
    crossed = await _pair_scores(state, caller, request, body.model, firsts, seconds)
    if crossed is not None:
        scores, tokens = crossed
    else:
        vectors, tokens = await _vectors(state, caller, request, body.model, firsts + seconds)
        scores = [
            cosine(vectors[a], vectors[b]) for (a, _), (b, _) in zip(firsts, seconds, strict=True)
        ]
    data = [
        {"index": index, "object": "score", "score": value} for index, value in enumerate(scores)
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
    crossed = await _pair_scores(
        state, caller, request, body.model, query * len(documents), documents
    )
    if crossed is not None:
        scores, tokens = crossed
    else:
        vectors, tokens = await _vectors(state, caller, request, body.model, query + documents)
        scores = [cosine(vectors[body.query], vectors[text]) for text, _ in documents]
    ranked = sorted(
        (
            (score, index, text)
            for index, (score, (text, _)) in enumerate(zip(scores, documents, strict=True))
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
