"""`POST /generate`: vLLM's simple endpoint, on the same auth, admission and queue as the rest.

The answer is `{"text": [prompt + completion, ...]}`, one entry per choice (beams best first);
with `stream: true` it is newline-delimited JSON, one `{"text": [...]}` line per chunk with the
texts so far. A beam search streams its final beams only: beams are re-ranked every step, so no
partial beam is an answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer_api.admission import (
    PromptedRequest,
    admit_jobs,
    cancel_jobs,
    check_n,
    job_failure,
)
from producer_api.deps import ApiState, Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.routes.openai import GENERATION_ERRORS, wait_all
from schemas import ErrorCode, Job, JobRequest, JobStatus
from schemas.errors import error_location
from schemas.sampling import sampling_field, sampling_values

router = APIRouter(tags=["generate"], responses=error_responses(401, 503))
NDJSON = "application/x-ndjson"


class GenerateRequest(BaseModel):
    """vLLM's /generate body; `model` may be left out where one model is served."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    # SamplingParams' fields, bounds and defaults; where this body publishes fewer bounds,
    # SamplingParams checks the rest once the job is built.
    n: int = sampling_field("n", bounds="lower")
    best_of: int | None = sampling_field("best_of", None, bounds="lower")
    use_beam_search: bool = sampling_field("use_beam_search")
    length_penalty: float = sampling_field("length_penalty", bounds="none")
    temperature: float = sampling_field("temperature", bounds="lower")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k")
    min_p: float = sampling_field("min_p")
    seed: int | None = sampling_field("seed")
    presence_penalty: float = sampling_field("presence_penalty")
    frequency_penalty: float = sampling_field("frequency_penalty")
    repetition_penalty: float = sampling_field("repetition_penalty")
    max_tokens: int | None = sampling_field("max_tokens", bounds="lower")
    min_tokens: int = sampling_field("min_tokens")
    stop: str | list[str] | None = sampling_field("stop", None, bounds="none")
    stop_token_ids: list[int] | None = sampling_field("stop_token_ids", None)
    include_stop_str_in_output: bool = sampling_field("include_stop_str_in_output")
    ignore_eos: bool = sampling_field("ignore_eos")
    # vLLM's `logprobs` is the number of alternatives; any number asks for logprobs.
    logprobs: int | None = sampling_field("top_logprobs", None)
    prompt_logprobs: int | None = sampling_field("prompt_logprobs", None)
    skip_special_tokens: bool = sampling_field("skip_special_tokens")
    truncate_prompt_tokens: int | None = sampling_field("truncate_prompt_tokens", None)
    bad_words: list[str] | None = sampling_field("bad_words", None)
    allowed_token_ids: list[int] | None = sampling_field("allowed_token_ids", None)
    logit_bias: dict[int, float] | None = sampling_field("logit_bias", None, bounds="none")
    stream: bool = False


def _job_request(
    body: GenerateRequest, model: str, max_tokens: int, timeout_s: float
) -> JobRequest:
    fields = {
        "model": model,
        "prompt": body.prompt,
        "sampling": sampling_values(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs,
        ),
        "stream": body.stream,
        "timeout_s": timeout_s,
    }
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        location = [part for part in error_location(error) if part != "sampling"]
        param = ".".join(str(part) for part in location) or None
        message = f"{param}: {error['msg']}" if param else error["msg"]
        raise ApiError(ErrorCode.INVALID_REQUEST, message, param) from exc


async def _model_of(state: ApiState, body: GenerateRequest) -> str:
    if body.model is not None:
        return body.model
    served = sorted(await state.workers.models())
    if len(served) == 1:
        return served[0]
    configured = state.settings.models
    if not served and len(configured) == 1:
        return configured[0]
    raise ApiError(
        ErrorCode.INVALID_REQUEST,
        "model: required when the server does not serve exactly one model",
        "model",
    )


def _texts(prompt: str, job: Job) -> list[str]:
    assert job.result is not None  # a succeeded job has its result
    return [prompt + choice.text for choice in job.result.choices]


@router.post("/generate", responses=GENERATION_ERRORS)
async def generate(
    body: GenerateRequest, request: Request, state: State, caller: Caller
) -> Response:
    model = await _model_of(state, body)
    check_n(state, body.n, "n")
    check_n(state, body.best_of or body.n, "best_of")

    def build(max_tokens: int) -> Iterator[PromptedRequest]:
        yield _job_request(body, model, max_tokens, state.settings.request_timeout_s), "prompt"

    jobs = await admit_jobs(state, caller, model, (body.max_tokens, "max_tokens"), build)
    if body.stream:
        return StreamingResponse(_lines(state, body, jobs[0]), media_type=NDJSON)
    finished = await wait_all(state, request, jobs)
    return JSONResponse({"text": _texts(body.prompt, finished[0])})


async def _lines(state: ApiState, body: GenerateRequest, job: Job) -> AsyncIterator[bytes]:
    texts = [""] * body.n
    ended = False
    try:
        async for chunk in state.stream_chunks(job.id):
            if chunk.choice >= len(texts):
                texts.extend([""] * (chunk.choice + 1 - len(texts)))
            texts[chunk.choice] += chunk.text
            if chunk.text or chunk.final:
                yield _line({"text": [body.prompt + text for text in texts]})
        ended = True
        final = await state.wait_job(job.id, 0)
        if final.status is not JobStatus.SUCCEEDED:
            error = job_failure(final)
            yield _line({"error": {"code": error.code.value, "message": error.message}})
    finally:
        if not ended:  # the client went away mid-stream
            await cancel_jobs(state, [job])


def _line(payload: dict[str, object]) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode() + b"\n"
