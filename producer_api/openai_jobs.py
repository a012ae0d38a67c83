"""OpenAI requests -> job requests: the checks OpenAI's fields need beyond their own types, and
the `JobRequest` each prompt becomes, validated by `schemas` (a refusal names the OpenAI field).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from producer_api.errors import ApiError
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest, GenerationFields
from producer_api.openai_structured import structured_output
from producer_api.openai_tools import (
    ToolPlan,
    forced_call_schema,
    plan_tools,
    render_tool_calls,
    render_tool_result,
    tools_system_prompt,
)
from schemas import ErrorCode, JobRequest
from schemas.errors import error_location, field_path
from schemas.sampling import sampling_values
from schemas.structured import StructuredOutput


def _unsupported(param: str, what: str) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"{param}: {what} is not supported", param)


def _openai_param(loc: tuple[int | str, ...]) -> str | None:
    """A JobRequest field path as the client named it (sampling.temperature -> temperature)."""
    if loc and loc[0] == "sampling":
        loc = loc[1:]
    elif loc and loc[0] in ("prompt_token_ids", "prompt"):
        loc = ("prompt",)
    return field_path(loc)


def _job_request(fields: dict[str, Any]) -> JobRequest:
    try:
        return JobRequest.model_validate(fields)
    except ValidationError as exc:
        problems, first = [], None
        for error in exc.errors(include_url=False):
            param = _openai_param(error_location(error))
            first = first or param
            problems.append(f"{param}: {error['msg']}" if param else error["msg"])
        raise ApiError(ErrorCode.INVALID_REQUEST, "; ".join(problems), first) from exc


def _logit_bias(req: GenerationFields) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    try:
        return {int(token_id): bias for token_id, bias in req.logit_bias.items()}
    except ValueError:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, "logit_bias: keys must be token ids", "logit_bias"
        ) from None


def _check_common(req: GenerationFields) -> None:
    _logit_bias(req)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, one job each."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(ErrorCode.INVALID_REQUEST, "prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def check_completion(req: CompletionRequest) -> None:
    _check_common(req)
    if req.echo and not all(isinstance(p, str) for p in completion_prompts(req)):
        raise _unsupported("echo", "echo of token-id prompts")
    if req.echo and req.logprobs is not None and req.stream:
        raise _unsupported("echo", "streaming echo with logprobs (prompt logprobs)")
    if req.suffix is not None:
        raise _unsupported("suffix", "suffix")


def echo_prompt_logprobs(req: CompletionRequest) -> int | None:
    if req.echo and req.logprobs is not None:
        return (
            req.logprobs if req.prompt_logprobs is None else max(req.prompt_logprobs, req.logprobs)
        )
    return req.prompt_logprobs


def completion_job(
    req: CompletionRequest, prompt: str | list[int], max_tokens: int, timeout_s: float
) -> JobRequest:
    fields: dict[str, Any] = {
        "model": req.model,
        "sampling": sampling_values(
            req,
            max_tokens=max_tokens,
            # OpenAI's completions name the number of alternatives `logprobs`
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs,
            # echo with logprobs: the prompt's tokens come with theirs too (as vLLM's)
            prompt_logprobs=echo_prompt_logprobs(req),
            structured_output=structured_output(req, None),
            logit_bias=_logit_bias(req),
        ),
        "stream": req.stream,
        "priority": req.priority,
        "timeout_s": timeout_s,
    }
    fields["prompt" if isinstance(prompt, str) else "prompt_token_ids"] = prompt
    return _job_request(fields)


def chat_max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def check_chat(req: ChatCompletionRequest) -> None:
    _check_common(req)
    chat_constraint(req)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, "top_logprobs: requires logprobs=true", "top_logprobs"
        )


def chat_tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    return plan_tools(req.tools, req.tool_choice)


def chat_constraint(req: ChatCompletionRequest) -> StructuredOutput | None:
    """The request's constraint; a forced tool call is one, and excludes any other."""
    constraint = structured_output(req, req.response_format)
    plan = chat_tool_plan(req)
    if plan is None or plan.mode == "auto":
        return constraint
    if constraint is not None:
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            "tool_choice: a forced tool call cannot be combined with another output constraint",
            "tool_choice",
        )
    return StructuredOutput(json_schema=forced_call_schema(plan))


def _chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    plan = chat_tool_plan(req)
    if plan is not None:
        messages.append({"role": "system", "content": tools_system_prompt(plan)})
    for message in req.messages:
        content = message.text()
        if message.tool_calls:
            content = render_tool_calls(content, message.tool_calls)
        if message.role == "tool":
            content = render_tool_result(content)
        role = "system" if message.role == "developer" else message.role
        if role == "system" and messages and messages[-1]["role"] == "system":
            messages[-1]["content"] += "\n\n" + content  # one system turn, tools first
            continue
        entry: dict[str, Any] = {"role": role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    return messages


def chat_job(req: ChatCompletionRequest, max_tokens: int, timeout_s: float) -> JobRequest:
    constraint = chat_constraint(req)
    return _job_request(
        {
            "model": req.model,
            "messages": _chat_messages(req),
            "sampling": sampling_values(
                req,
                max_tokens=max_tokens,
                structured_output=constraint,
                logit_bias=_logit_bias(req),
            ),
            "stream": req.stream,
            "priority": req.priority,
            "timeout_s": timeout_s,
        }
    )
