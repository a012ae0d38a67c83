"""Finished jobs -> OpenAI response bodies (completions and chat completions), and the parts
every body and stream frame shares: finish reasons, usage, logprobs, the response header."""

from __future__ import annotations

from typing import Any

from producer_api.openai_jobs import chat_tool_plan, completion_prompts
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest
from producer_api.openai_tools import ToolPlan, parse_tool_calls, tool_calls_body
from schemas import Job, Usage
from schemas.chunks import TokenLogprob

# OpenAI knows stop and length, and tool_calls (set where calls were parsed); never
# content_filter.
_FINISH_REASONS = {"stop": "stop", "length": "length"}


def finish_reason(value: str | None) -> str | None:
    return None if value is None else _FINISH_REASONS.get(value, "stop")


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


def echoed_prompts(req: CompletionRequest) -> list[str]:
    """Per prompt, the text `echo` puts before its completions ("" without echo)."""
    prompts = completion_prompts(req)
    return [p if req.echo and isinstance(p, str) else "" for p in prompts]


def _echoed_logprobs(
    req: CompletionRequest, prompt_text: str, job: Job, logprobs: list[TokenLogprob] | None
) -> dict[str, Any] | None:
    """A choice's logprobs object; with echo, the prompt's tokens first, the first of them
    without a logprob (nothing comes before it), as vLLM answers."""
    body = completion_logprobs(logprobs)
    assert job.result is not None
    scored = job.result.prompt_logprobs
    if not (req.echo and body is not None and scored):
        return body
    head = completion_logprobs([item for item in scored if item is not None])
    assert head is not None
    rest = "".join(head["tokens"])
    # The first token's text: what the prompt holds before the scored tokens' texts.
    first = prompt_text[: len(prompt_text) - len(rest)] if prompt_text.endswith(rest) else ""
    offsets = [0, *(len(first) + offset for offset in head["text_offset"])]
    return {
        "tokens": [first, *head["tokens"], *body["tokens"]],
        "token_logprobs": [None, *head["token_logprobs"], *body["token_logprobs"]],
        "top_logprobs": [None, *head["top_logprobs"], *body["top_logprobs"]],
        "text_offset": offsets + [len(prompt_text) + o for o in body["text_offset"]],
    }


def _prompt_logprobs_field(
    req: CompletionRequest | ChatCompletionRequest, job: Job
) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` where the request asked for them: per prompt token None (the
    first) or {token id: {"logprob", "decoded_token"}} of the token and its alternatives."""
    if req.prompt_logprobs is None or job.result is None:
        return {}
    scored = job.result.prompt_logprobs or []
    return {
        "prompt_logprobs": [
            None
            if item is None
            else {
                str(entry.token_id): {"logprob": entry.logprob, "decoded_token": entry.token}
                for entry in (item, *item.top_logprobs)
            }
            for item in scored
        ]
    }


def completion_body(req: CompletionRequest, jobs: list[Job]) -> dict[str, Any]:
    choices = []
    echoed = echoed_prompts(req)
    for prompt_index, job in enumerate(jobs):
        assert job.result is not None
        for choice in job.result.choices:
            choices.append(
                {
                    "index": prompt_index * req.n + choice.index,
                    "text": echoed[prompt_index] + choice.text,
                    "logprobs": _echoed_logprobs(req, echoed[prompt_index], job, choice.logprobs),
                    "finish_reason": finish_reason(choice.finish_reason),
                    "stop_reason": choice.stop_reason,
                    **_prompt_logprobs_field(req, job),
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
        **_prompt_logprobs_field(req, job),
    }
