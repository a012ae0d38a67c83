"""vLLM's utility endpoints: `/tokenize`, `/detokenize` and `/version`.

Tokenizing happens in the API with the tokenizer.json the model's workers advertise (the same
one prompt lengths are counted with); where the API cannot read it, the answer is 404. Chat
messages are refused: their template lives with the worker."""

from __future__ import annotations

from importlib import metadata

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from producer_api.deps import ApiState, Caller, State
from producer_api.errors import ApiError, error_responses
from producer_api.prompt_tokens import PromptTokenizer
from schemas import ErrorCode
from schemas.jobs import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS

router = APIRouter(tags=["openai"])
TOKENIZER_ERRORS = error_responses(400, 401, 404, 503)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    prompt: str = Field(max_length=MAX_PROMPT_CHARS)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    tokens: list[int] = Field(max_length=MAX_PROMPT_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


async def _tokenizer(state: ApiState, model: str) -> tuple[PromptTokenizer, int | None]:
    served = await state.require_model(model, allow_configured=False)
    assert served is not None
    tokenizer = await state.tokenizers.get(served.tokenizer_file)
    if tokenizer is None:
        raise ApiError(
            ErrorCode.NOT_FOUND,
            f"the tokenizer of {model} is not readable from this API host",
            "model",
        )
    return tokenizer, served.max_model_len


@router.post("/tokenize", responses=TOKENIZER_ERRORS)
async def tokenize(body: TokenizeRequest, state: State, caller: Caller) -> TokenizeResponse:
    tokenizer, max_model_len = await _tokenizer(state, body.model)
    ids, strs = await anyio.to_thread.run_sync(
        tokenizer.encode, body.prompt, body.add_special_tokens
    )
    return TokenizeResponse(
        count=len(ids),
        max_model_len=max_model_len,
        tokens=ids,
        token_strs=strs if body.return_token_strs else None,
    )


@router.post("/detokenize", responses=TOKENIZER_ERRORS)
async def detokenize(body: DetokenizeRequest, state: State, caller: Caller) -> DetokenizeResponse:
    tokenizer, _ = await _tokenizer(state, body.model)
    if any(token < 0 for token in body.tokens):
        raise ApiError(ErrorCode.INVALID_TOKEN_ID, "tokens: ids must be non-negative", "tokens")
    return DetokenizeResponse(prompt=await anyio.to_thread.run_sync(tokenizer.decode, body.tokens))


@router.get("/version")
async def version() -> dict[str, str]:
    try:
        return {"version": metadata.version("inferq")}
    except metadata.PackageNotFoundError:
        return {"version": "unknown"}
