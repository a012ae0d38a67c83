"""OpenAI requests -> job requests, and job results / chunks -> OpenAI response bodies."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from producer_api.errors import ApiError
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest, _GenerationFields
from producer_api.openai_structured import structured_output
from producer_api.openai_tools import (
    ToolPlan,
    forced_call_schema,
    parse_tool_calls,
    plan_tools,
    render_tool_calls,
    render_tool_result,
    tool_call_delta,
    tool_call_parser,
    tool_calls_body,
    tools_system_prompt,
)
from producer_api.tool_call_parser import ToolCallParser
from schemas import ErrorCode, Job, JobRequest, TokenChunk, Usage
from schemas.chunks import TokenLogprob
from schemas.errors import error_location, field_path
from schemas.structured import StructuredOutput

# OpenAI knows stop and length, and tool_calls (set where calls were parsed); never
# content_filter.
_FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(value: str | None) -> str | None:
    return None if value is None else _FINISH_REASONS.get(value, "stop")


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


def _sampling(
    req: _GenerationFields,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    constraint: StructuredOutput | None,
) -> dict[str, Any]:
    given = {
        "structured_output": constraint,
        "logit_bias": _logit_bias(req),
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": req.top_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": req.stop_token_ids,
        "skip_special_tokens": req.skip_special_tokens,
        "use_beam_search": req.use_beam_search or None,
        "length_penalty": req.length_penalty,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    return {name: value for name, value in given.items() if value is not None}


def _logit_bias(req: _GenerationFields) -> dict[int, float] | None:
    if not req.logit_bias:
        return None
    try:
        return {int(token_id): bias for token_id, bias in req.logit_bias.items()}
    except ValueError:
        raise ApiError(
            ErrorCode.INVALID_REQUEST, "logit_bias: keys must be token ids", "logit_bias"
        ) from None


def _check_common(req: _GenerationFields) -> None:
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
    if req.echo and req.logprobs is not None:
        raise _unsupported("echo", "echo with logprobs (prompt logprobs)")
    if req.suffix is not None:
        raise _unsupported("suffix", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise _unsupported("best_of", "best_of other than n")


def completion_job(
    req: CompletionRequest, prompt: str | list[int], max_tokens: int, timeout_s: float
) -> JobRequest:
    logprobs = req.logprobs is not None
    fields: dict[str, Any] = {
        "model": req.model,
        "sampling": _sampling(
            req, max_tokens, logprobs, req.logprobs or 0, structured_output(req, None)
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
            "sampling": _sampling(req, max_tokens, req.logprobs, req.top_logprobs or 0, constraint),
            "stream": req.stream,
            "priority": req.priority,
            "timeout_s": timeout_s,
        }
    )


# ---------------------------------------------------------------- responses


def usage_body(usages: list[Usage]) -> dict[str, Any]:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_prompt_tokens for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_text(item: TokenLogprob | Any) -> str:
    return item.token if item.token is not None else f"token_id:{item.token_id}"


def completion_logprobs(
    logprobs: list[TokenLogprob] | None, text_offset: int = 0
) -> dict[str, Any] | None:
    """The legacy completions logprobs object (tokens, token_logprobs, top_logprobs, offsets)."""
    if logprobs is None:
        return None
    tokens, offsets, offset = [], [], text_offset
    for item in logprobs:
        token = _token_text(item)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [
            {_token_text(top): top.logprob for top in item.top_logprobs} for item in logprobs
        ],
        "text_offset": offsets,
    }


def _chat_logprob(item: TokenLogprob | Any) -> dict[str, Any]:
    token = _token_text(item)
    return {"token": token, "logprob": item.logprob, "bytes": list(token.encode())}


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    return {
        "content": [
            {**_chat_logprob(item), "top_logprobs": [_chat_logprob(t) for t in item.top_logprobs]}
            for item in logprobs
        ],
        "refusal": None,
    }


def response_header(
    req: CompletionRequest | ChatCompletionRequest, id_prefix: str, kind: str, job: Job
) -> dict[str, Any]:
    """The fields every response body and stream frame of `job` starts with."""
    return {
        "id": f"{id_prefix}-{job.id}",
        "object": kind,
        "created": int(job.created_at.timestamp()),
        "model": req.model,
        "system_fingerprint": None,
    }


def _echoed(req: CompletionRequest) -> list[str]:
    """Per prompt, the text `echo` puts before its completions ("" without echo)."""
    prompts = completion_prompts(req)
    return [p if req.echo and isinstance(p, str) else "" for p in prompts]


def completion_body(req: CompletionRequest, jobs: list[Job]) -> dict[str, Any]:
    choices = []
    echoed = _echoed(req)
    for prompt_index, job in enumerate(jobs):
        assert job.result is not None
        for choice in job.result.choices:
            choices.append(
                {
                    "index": prompt_index * req.n + choice.index,
                    "text": echoed[prompt_index] + choice.text,
                    "logprobs": completion_logprobs(choice.logprobs),
                    "finish_reason": finish_reason(choice.finish_reason),
                    "stop_reason": choice.stop_reason,
                }
            )
    return {
        **response_header(req, "cmpl", "text_completion", jobs[0]),
        "choices": choices,
        "usage": usage_body([job.result.usage for job in jobs if job.result is not None]),
    }


def _assistant_message(
    text: str, plan: ToolPlan | None, call_id_prefix: str
) -> tuple[dict[str, Any], bool]:
    """The response message, and whether it calls tools."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if plan is None:
        return message, False
    content, calls = parse_tool_calls(text, plan)
    if not calls:
        return message, False
    message["content"] = content
    message["tool_calls"] = tool_calls_body(calls, call_id_prefix)
    return message, True


def chat_body(req: ChatCompletionRequest, job: Job) -> dict[str, Any]:
    assert job.result is not None
    plan = chat_tool_plan(req)
    choices = []
    for choice in job.result.choices:
        message, calls = _assistant_message(choice.text, plan, f"call-{job.id}-{choice.index}")
        reason = finish_reason(choice.finish_reason)
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": chat_logprobs(choice.logprobs),
                "finish_reason": "tool_calls" if calls and reason == "stop" else reason,
                "stop_reason": choice.stop_reason,
            }
        )
    return {
        **response_header(req, "chatcmpl", "chat.completion", job),
        "choices": choices,
        "usage": usage_body([job.result.usage]),
    }


class _StreamChunks:
    """The fields every stream frame of one response shares, and its closing usage frame."""

    def __init__(
        self, req: CompletionRequest | ChatCompletionRequest, id_prefix: str, kind: str, job: Job
    ) -> None:
        self.header = response_header(req, id_prefix, kind, job)
        self.include_usage = req.include_usage
        self.continuous_usage = req.continuous_usage
        # per job (prompt of a request): its prompt's tokens, once its first chunk says
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def count(self, prompt_index: int, chunk: TokenChunk) -> None:
        """Running usage, for continuous_usage_stats."""
        if chunk.prompt_tokens is not None:
            self.prompt_tokens[prompt_index] = chunk.prompt_tokens
        self.completion_tokens += len(chunk.token_ids)

    def _frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        frame: dict[str, Any] = {**self.header, "choices": choices}
        if self.continuous_usage:
            prompt = sum(self.prompt_tokens.values())
            frame["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
            }
        elif self.include_usage:
            frame["usage"] = None
        return frame

    def usage(self, usages: list[Usage]) -> dict[str, Any]:
        return {**self.header, "choices": [], "usage": usage_body(usages)}


class CompletionChunks(_StreamChunks):
    """Stream chunks of `/v1/completions` for one request (all its prompts' jobs)."""

    def __init__(self, req: CompletionRequest, first_job: Job) -> None:
        super().__init__(req, "cmpl", "text_completion", first_job)
        self.n = req.n
        self.offsets: dict[int, int] = {}
        self.echoed = _echoed(req)

    def start(self) -> list[dict[str, Any]]:
        """With echo, each choice's prompt first."""
        frames = []
        for prompt_index, prompt in enumerate(self.echoed):
            for choice in range(self.n if prompt else 0):
                index = prompt_index * self.n + choice
                self.offsets[index] = len(prompt)
                text = {"index": index, "text": prompt, "logprobs": None, "finish_reason": None}
                frames.append(self._frame([text]))
        return frames

    def chunk(self, prompt_index: int, chunk: TokenChunk) -> dict[str, Any]:
        self.count(prompt_index, chunk)
        index = prompt_index * self.n + chunk.choice
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(chunk.text)
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": completion_logprobs(chunk.logprobs, offset),
            "finish_reason": finish_reason(chunk.finish_reason),
        }
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.stop_reason
        return self._frame([choice])


class ChatChunks(_StreamChunks):
    """Stream chunks of `/v1/chat/completions`: a role delta per choice first, then content.
    With tools, each choice's text goes through a tool-call parser: content streams as it is
    known to be content, calls as `tool_calls` deltas; a chunk whose text is all held back
    (a tag not yet complete) makes no frame."""

    def __init__(self, req: ChatCompletionRequest, job: Job) -> None:
        super().__init__(req, "chatcmpl", "chat.completion.chunk", job)
        self.n = req.n
        self.job_id = job.id
        self.plan = chat_tool_plan(req)
        self.parsers: dict[int, ToolCallParser] = {}

    def start(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            self._frame([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
            for i in range(self.n)
        ]

    def chunk(self, prompt_index: int, chunk: TokenChunk) -> dict[str, Any] | None:
        self.count(prompt_index, chunk)
        reason = finish_reason(chunk.finish_reason)
        if self.plan is None:
            delta: dict[str, Any] = (
                {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
            )
        else:
            parser = self.parsers.get(chunk.choice)
            if parser is None:
                parser = self.parsers[chunk.choice] = tool_call_parser(self.plan)
            events = parser.feed(chunk.text)
            if chunk.finish_reason is not None:
                events += parser.finish()
            delta = tool_call_delta(events, f"call-{self.job_id}-{chunk.choice}")
            if parser.calls and reason == "stop":
                reason = "tool_calls"
            if not (delta or reason or chunk.logprobs or self.continuous_usage):
                return None
        choice = {
            "index": chunk.choice,
            "delta": delta,
            "logprobs": chat_logprobs(chunk.logprobs),
            "finish_reason": reason,
        }
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.stop_reason
        return self._frame([choice])
