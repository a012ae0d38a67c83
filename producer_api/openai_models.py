"""Request shapes of the OpenAI-compatible endpoints (HTTP-only; the job contract is `schemas`).

Fields OpenAI documents are accepted with OpenAI's meaning; vLLM's extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, allowed_token_ids,
bad_words, include_stop_str_in_output, truncate_prompt_tokens, prompt_logprobs, priority) pass
through to the sampler. Unknown fields are refused (400 naming the field)
rather than silently ignored, except inside messages, where SDKs echo back extra fields.

The sampling fields are SamplingParams' (`sampling_field`): its bounds and descriptions, left
unset (None) where OpenAI leaves them optional, so that the job gets SamplingParams' default.
A few publish fewer bounds than SamplingParams checks once the job is built: max_tokens (the
model's context bounds it, checked on admission), stop and logit_bias (given in OpenAI's form),
length_penalty.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from producer_api.openai_structured import GuidedFields, ResponseFormat
from producer_api.openai_tools import Tool, ToolCallIn, ToolChoice
from schemas.jobs import MAX_MESSAGES, MAX_PRIORITY, MAX_PROMPT_CHARS
from schemas.sampling import MAX_STOP_STRINGS, sampling_field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM: usage so far on every chunk


class GenerationFields(GuidedFields):
    """Fields of both endpoints; the structured-output extras (vLLM's) come from GuidedFields."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=256)
    n: int = sampling_field("n")
    temperature: float | None = sampling_field("temperature", None)
    top_p: float | None = sampling_field("top_p", None)
    presence_penalty: float | None = sampling_field("presence_penalty", None)
    frequency_penalty: float | None = sampling_field("frequency_penalty", None)
    seed: int | None = sampling_field("seed")
    stop: str | list[str] | None = sampling_field(
        "stop", None, bounds="none", description=f"up to {MAX_STOP_STRINGS} stop strings"
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="accepted and ignored")
    logit_bias: dict[str, float] | None = sampling_field(
        "logit_bias", None, bounds="none", description="token id -> bias in [-100, 100]"
    )
    # extensions (vLLM-style)
    top_k: int | None = sampling_field("top_k", None)
    min_p: float | None = sampling_field("min_p", None)
    repetition_penalty: float | None = sampling_field("repetition_penalty", None)
    min_tokens: int | None = sampling_field("min_tokens", None)
    ignore_eos: StrictBool = sampling_field("ignore_eos")
    stop_token_ids: list[int] | None = sampling_field("stop_token_ids", None)
    skip_special_tokens: StrictBool = sampling_field("skip_special_tokens")
    use_beam_search: StrictBool = sampling_field(
        "use_beam_search", description="beam search, n beams kept"
    )
    length_penalty: float | None = sampling_field("length_penalty", None, bounds="none")
    allowed_token_ids: list[int] | None = sampling_field("allowed_token_ids", None)
    bad_words: list[str] | None = sampling_field("bad_words", None)
    include_stop_str_in_output: StrictBool = sampling_field("include_stop_str_in_output")
    truncate_prompt_tokens: int | None = sampling_field("truncate_prompt_tokens", None)
    prompt_logprobs: int | None = sampling_field("prompt_logprobs", None)
    priority: int = Field(0, ge=0, le=MAX_PRIORITY, description="lower runs first")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationFields):
    """`POST /v1/completions`. `prompt` is a string, a list of strings, a list of token ids, or
    a list of token-id lists; each prompt gets `n` choices (choice index = prompt * n + i)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = sampling_field("max_tokens", bounds="lower")
    # OpenAI's completions name the number of alternatives `logprobs`; any number asks for them
    logprobs: int | None = sampling_field("top_logprobs", None)
    echo: StrictBool = Field(False, description="the prompt before the completion (text prompts)")
    best_of: int | None = sampling_field("best_of", None)
    suffix: str | None = Field(None, description="not supported")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None)
    name: str | None = Field(None, min_length=1, max_length=64)
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: which call this answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationFields):
    """`POST /v1/chat/completions`; the worker applies the model's chat template."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = sampling_field("max_tokens", None, bounds="lower")
    max_completion_tokens: int | None = sampling_field("max_tokens", None, bounds="lower")
    logprobs: StrictBool = sampling_field("logprobs")
    top_logprobs: int | None = sampling_field("top_logprobs", None)
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object, or json_schema (enforced by the grammar)"
    )
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function"
    )
    parallel_tool_calls: StrictBool | None = None
