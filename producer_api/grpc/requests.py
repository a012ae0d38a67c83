"""gRPC request messages -> `schemas.JobRequest`, validated by `schemas` as every other interface
is, with each refusal naming the field of the gRPC message (`num_tokens`, not
`sampling.max_tokens`). The sampling fields are the message's fields named as SamplingParams'
(or named otherwise in `_MESSAGE_FIELDS`); SamplingParams holds their bounds and defaults."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import ValidationError

from producer_api.errors import ApiError
from producer_api.grpc.stubs import inference_pb2 as pb
from producer_api.openai_embeddings import checked_inputs
from producer_api.openai_models import CompletionRequest
from schemas import ErrorCode, JobRequest, SamplingParams
from schemas.errors import error_location, field_path

GenerationRequest = pb.CompletionsRequest | pb.ChatCompletionsRequest
PromptField = Literal["prompt", "prompt_token_ids", "messages"]

# Unset num_tokens of a completion: what /v1/completions does without max_tokens.
COMPLETION_MAX_TOKENS: int = CompletionRequest.model_fields["max_tokens"].default
_DEFAULT_N: int = SamplingParams.model_fields["n"].default

# JobRequest (and SamplingParams) fields whose gRPC field has another name.
_MESSAGE_FIELDS = {
    "model": "model_id",
    "max_tokens": "num_tokens",
    "stop": "stop_sequences",
}
_CONTRACT_FIELDS = {message: contract for contract, message in _MESSAGE_FIELDS.items()}


def message_field(param: str) -> str:
    """A field path of a JobRequest (or a refusal's param) as the gRPC message names it:
    `sampling.max_tokens` -> `num_tokens`, `sampling.stop.3` -> `stop_sequences.3`."""
    parts = param.split(".")
    if parts[0] == "sampling" and len(parts) > 1:
        parts = parts[1:]
    parts[0] = _MESSAGE_FIELDS.get(parts[0], parts[0])
    return ".".join(parts)


def requested_max_tokens(request: GenerationRequest) -> tuple[int | None, str]:
    """num_tokens as given (None when unset: a chat then gets the server's default)."""
    if request.HasField("num_tokens"):
        return request.num_tokens, "num_tokens"
    if isinstance(request, pb.CompletionsRequest):
        return COMPLETION_MAX_TOKENS, "num_tokens"
    return None, "num_tokens"


def requested_n(request: GenerationRequest) -> int:
    return request.n if request.HasField("n") else _DEFAULT_N


def prompt_field(request: GenerationRequest) -> PromptField:
    """The field holding the prompt, named when the prompt is refused."""
    if isinstance(request, pb.ChatCompletionsRequest):
        return "messages"
    return "prompt_token_ids" if request.prompt_token_ids else "prompt"


def job_request(
    request: GenerationRequest, max_tokens: int, *, stream: bool, timeout_s: float
) -> JobRequest:
    """The job `request` asks for, with `max_tokens` resolved and a deadline `timeout_s` from
    now; ApiError (invalid_request, naming the message's field) when schemas refuses it."""
    fields: dict[str, object] = {
        "model": request.model_id,
        "sampling": _sampling(request, max_tokens),
        "stream": stream,
        "priority": request.priority,
        "timeout_s": timeout_s,
    }
    if isinstance(request, pb.ChatCompletionsRequest):
        fields["messages"] = [_message(m) for m in request.messages]  # [] is refused as empty
    elif request.prompt_token_ids:
        fields["prompt_token_ids"] = list(request.prompt_token_ids)
        if request.prompt:
            fields["prompt"] = request.prompt  # refused: exactly one input
    else:
        fields["prompt"] = request.prompt  # "" is refused as an empty prompt
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        raise _invalid(exc) from exc


def _message(message: pb.ChatMessage) -> dict[str, str]:
    entry = {"role": message.role, "content": message.content}
    if message.name:
        entry["name"] = message.name
    return entry


def _sampling(request: GenerationRequest, max_tokens: int) -> dict[str, object]:
    """The SamplingParams fields the message sets (an unset field takes SamplingParams'
    default), with `max_tokens` resolved."""
    fields: dict[str, object] = {}
    for field, value in request.ListFields():
        name = _CONTRACT_FIELDS.get(field.name, field.name)
        if name not in SamplingParams.model_fields:
            continue
        if name == "structured_output":
            fields[name] = _structured_output(value)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            fields[name] = dict(value)
        elif field.is_repeated:
            fields[name] = list(value)
        else:
            fields[name] = value
    fields["max_tokens"] = max_tokens
    return fields


def _structured_output(message: pb.StructuredOutput) -> dict[str, object]:
    kind = message.WhichOneof("constraint")
    if kind == "json_schema":
        try:
            return {"json_schema": json.loads(message.json_schema)}
        except ValueError as exc:
            raise ApiError(
                ErrorCode.INVALID_REQUEST,
                f"structured_output.json_schema: not valid JSON: {exc}",
                "structured_output.json_schema",
            ) from None
    if kind == "choice":
        return {"choice": list(message.choice.choices)}
    if kind == "json_object":
        return {"json_object": message.json_object}
    if kind == "regex":
        return {"regex": message.regex}
    if kind == "grammar":
        return {"grammar": message.grammar}
    return {}  # none set: refused by the schema as "give exactly one"


def _invalid(exc: ValidationError) -> ApiError:
    problems, first = [], None
    for error in exc.errors(include_url=False):
        path = field_path(error_location(error))
        param = None if path is None else message_field(path)
        first = first or param
        problems.append(f"{param}: {error['msg']}" if param else error["msg"])
    return ApiError(ErrorCode.INVALID_REQUEST, "; ".join(problems), first)


def embedding_inputs(request: pb.EmbeddingRequest, limit: int) -> list[tuple[str | list[int], str]]:
    """Each input and the message field it came from (`input.2`, `input_token_ids.0`), checked
    as /v1/embeddings checks them; INVALID_ARGUMENT naming the field otherwise."""
    if request.input and request.input_token_ids:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            "input_token_ids: give input or input_token_ids, not both",
            "input_token_ids",
        )
    field = "input_token_ids" if request.input_token_ids else "input"
    inputs: list[str | list[int]] = (
        [list(ids.token_ids) for ids in request.input_token_ids]
        if request.input_token_ids
        else list(request.input)
    )
    params = [f"{field}.{index}" for index in range(len(inputs))]
    return checked_inputs(inputs, params, field, limit)


def requested_dimensions(request: pb.EmbeddingRequest) -> int | None:
    if not request.HasField("dimensions"):
        return None
    if request.dimensions < 1:
        raise ApiError(ErrorCode.INVALID_REQUEST, "dimensions: must be at least 1", "dimensions")
    return request.dimensions
