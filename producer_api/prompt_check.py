"""The one check of a job's prompt against its model before the job is queued, for every route
that enqueues (jobs, completions, chat, batch lines): token ids inside the vocabulary, and the
prompt plus `max_tokens` inside the context.

The bounds come from the model's workers' heartbeats (`vocab_size`, `max_model_len`,
`tokenizer_file`); a bound nobody advertises (no worker yet) is not checked here, and the worker
decides. Text prompts are counted with the model's tokenizer when the API can load it: a chat's
count is a lower bound (the contents of what the system, the user and tools said; the template
only adds to it), so the API never refuses what a worker would run, and what only templating
makes too long still fails in the worker, as a failed job with the same code."""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from producer_api.errors import ApiError
from producer_api.prompt_tokens import PromptTokenizer, TokenizerCache
from producer_api.workers import ServedModel
from schemas import ErrorCode, JobRequest, SamplingParams

# Roles whose content every chat template keeps (assistant turns may be rewritten, e.g. their
# reasoning dropped): only these count toward the lower bound.
_KEPT_ROLES = frozenset({"system", "user", "tool"})


@dataclass(frozen=True)
class PromptLimits:
    """What a model's workers accept; None where it is not known."""

    context: int | None = None
    vocab_size: int | None = None
    tokenizer: PromptTokenizer | None = None


async def prompt_limits(
    served: ServedModel | None, context: int | None, tokenizers: TokenizerCache
) -> PromptLimits:
    """The limits of a model from its live workers (`served`) and its known context length."""
    if served is None:
        return PromptLimits(context)
    return PromptLimits(context, served.vocab_size, await tokenizers.get(served.tokenizer_file))


async def check_prompt(
    request: JobRequest, limits: PromptLimits, param: str, sampling_prefix: str = ""
) -> None:
    """Raise ApiError (invalid_token_id, context_length_exceeded) naming `param`, the prompt's
    field as the client wrote it, when the job could never run on the model; token ids of the
    sampling fields (logit_bias, allowed_token_ids) are named as `sampling_prefix` + field."""
    if limits.vocab_size is not None:
        _check_sampling_token_ids(request.sampling, limits.vocab_size, sampling_prefix)
    if request.inputs is not None:  # an embedding job of several inputs: each on its own
        for index, item in enumerate(request.inputs):
            field = "prompt" if isinstance(item, str) else "prompt_token_ids"
            one = request.model_copy(update={"inputs": None, field: item})
            await check_prompt(one, limits, f"{param}.{index}")
        return
    ids = request.prompt_token_ids
    if ids is not None:
        _check_vocabulary(ids, limits.vocab_size, param)
        prompt_tokens: int | None = len(ids)
    else:
        prompt_tokens = await _least_prompt_tokens(request, limits)
    truncate = request.sampling.truncate_prompt_tokens
    if prompt_tokens is not None and truncate is not None:
        prompt_tokens = min(prompt_tokens, truncate)
    if prompt_tokens is not None and limits.context is not None:
        if request.pooling is not None:  # an embedding generates nothing: the input alone
            _check_input(prompt_tokens, limits.context, param)
        else:
            _check_context(prompt_tokens, request.sampling.max_tokens, limits.context, param)


def _check_vocabulary(ids: list[int], vocab_size: int | None, param: str) -> None:
    if vocab_size is None:
        return
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ApiError(
                ErrorCode.INVALID_TOKEN_ID,
                f"{param}.{index}: token id {token} is not in this model's vocabulary "
                f"(ids 0 to {vocab_size - 1})",
                f"{param}.{index}",
            )


def _check_sampling_token_ids(sampling: SamplingParams, vocab_size: int, prefix: str) -> None:
    """logit_bias keys and allowed_token_ids inside the vocabulary, as OpenAI and vLLM check."""
    outside = sampling.token_outside_vocabulary(vocab_size)
    if outside is not None:
        field, token = outside
        raise ApiError(
            ErrorCode.INVALID_REQUEST,
            f"{prefix}{field}: token id {token} is not in this model's vocabulary "
            f"(ids 0 to {vocab_size - 1})",
            f"{prefix}{field}",
        )


def _check_context(prompt_tokens: int, max_tokens: int, context: int, param: str) -> None:
    if prompt_tokens + max_tokens > context:
        raise ApiError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"at least {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Shorten the prompt or lower max_tokens.",
            param,
        )


def _check_input(input_tokens: int, context: int, param: str) -> None:
    if input_tokens > context:
        raise ApiError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"{param}: this model embeds at most {context} tokens, the input has at least "
            f"{input_tokens}. Shorten it.",
            param,
        )


async def _least_prompt_tokens(request: JobRequest, limits: PromptLimits) -> int | None:
    """At least how many tokens the text prompt has, or None when it is not worth counting (no
    tokenizer, no context, or too short to matter)."""
    if limits.tokenizer is None or limits.context is None:
        return None
    if request.messages is not None:
        texts = [m.content for m in request.messages if m.role in _KEPT_ROLES]
    else:
        texts = [request.prompt or "", *([request.prompt_pair] if request.prompt_pair else [])]
    # A token covers at least one byte of its text (plus one word-start marker per text at
    # most), so prompts this short fit and are not tokenized here; a tokenizer that broke the
    # rule would only leave the refusal to the worker.
    most = sum(len(text.encode()) + 1 for text in texts)
    output = 0 if request.pooling is not None else request.sampling.max_tokens
    if most + output <= limits.context:
        return None
    tokenizer = limits.tokenizer
    return await anyio.to_thread.run_sync(lambda: sum(tokenizer.count(t) for t in texts))
