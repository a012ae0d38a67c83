"""Job chunks -> OpenAI stream frames (`chat.completion.chunk`, streamed `text_completion`),
with usage on every frame or in a closing usage frame, as the request's stream_options ask."""

from __future__ import annotations

from typing import Any

from producer_api.openai_jobs import chat_tool_plan
from producer_api.openai_models import ChatCompletionRequest, CompletionRequest
from producer_api.openai_responses import (
    chat_logprobs,
    completion_logprobs,
    echoed_prompts,
    finish_reason,
    response_header,
    usage_body,
)
from producer_api.openai_tools import tool_call_delta, tool_call_parser
from producer_api.tool_call_parser import ToolCallParser
from schemas import Job, TokenChunk, Usage


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
        self.echoed = echoed_prompts(req)

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
