"""The prompt forms vLLM's Python API takes, read into the engine's one form (text or token ids).

A prompt is a string, a list of token ids, `TextPrompt` ({"prompt": text}) or `TokensPrompt`
({"prompt_token_ids": ids}); a call takes one prompt or a list of them, forms mixed. Keys vLLM
uses for what this engine does not do (images, cache salts) are refused by name, not dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from typing import TypedDict, cast

# What vLLM's prompt dicts may also hold, and why it is refused here.
_UNSUPPORTED_KEYS = {
    "multi_modal_data": "inferq serves text-only models",
    "mm_processor_kwargs": "inferq serves text-only models",
    "multi_modal_uuids": "inferq serves text-only models",
    "cache_salt": "the prefix cache takes no per-request salt here",
    "token_type_ids": "only pooling models read token type ids",
}


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer (special tokens added)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids, used as they are."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
EnginePrompt = str | list[int]


def parse_prompt(prompt: PromptType | object) -> EnginePrompt:
    """One prompt in the engine's form; a ValueError names what is wrong with it."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt)
    token_ids = _token_ids(prompt)
    if token_ids is not None:
        return token_ids
    raise ValueError(
        "a prompt is a string, a list of token ids, {'prompt': text} or "
        f"{{'prompt_token_ids': ids}}, not {type(prompt).__name__}"
    )


def parse_prompts(
    prompts: PromptType | SequenceABC[PromptType] | SequenceABC[Mapping[str, object]],
) -> list[EnginePrompt]:
    """One prompt or a list of them (forms may mix), in order."""
    if isinstance(prompts, str | Mapping):
        return [parse_prompt(prompts)]
    token_ids = _token_ids(prompts)
    if token_ids:  # one prompt given as token ids
        return [token_ids]
    return [parse_prompt(item) for item in prompts]


def _parse_dict(prompt: Mapping[str, object]) -> EnginePrompt:
    for key, reason in _UNSUPPORTED_KEYS.items():
        if key in prompt:
            raise ValueError(f"prompt key {key!r} is not supported: {reason}")
    unknown = set(prompt) - {"prompt", "prompt_token_ids"}
    if unknown:
        raise ValueError(
            f"unknown prompt keys {sorted(unknown)}: a prompt dict holds 'prompt' (text) or "
            "'prompt_token_ids'"
        )
    if "prompt_token_ids" in prompt:
        token_ids = _token_ids(prompt["prompt_token_ids"])
        if token_ids is None:
            raise ValueError("prompt_token_ids must be a list of integer token ids")
        return token_ids
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError("a TextPrompt needs 'prompt' as a string")
    return text


def _token_ids(value: object) -> list[int] | None:
    """value as a list of token ids, when it is a sequence of integers."""
    if isinstance(value, str) or not isinstance(value, SequenceABC):
        return None
    items = list(value)
    if not all(_is_token_id(t) for t in items):
        return None
    return cast(list[int], items)


def _is_token_id(value: object) -> bool:
    # bool is an int subclass, but True is no token id
    return isinstance(value, int) and not isinstance(value, bool)
