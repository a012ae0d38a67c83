"""The text of single tokens, for logprobs: each id decoded on its own, as vLLM reports them.

A byte-level BPE token like 'Ġthe' reads ' the'; a token holding only part of a UTF-8
character reads as the replacement character, since on its own it is no text."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

_CACHED_TOKENS = 1 << 16  # covers the ids a workload actually emits, bounded in memory


class TokenTexts:
    """id -> text for the ids a logprob entry names, decoded once per id and cached."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._text = None if tokenizer is None else lru_cache(_CACHED_TOKENS)(_decoder(tokenizer))

    def __call__(self, token_ids: Iterable[int]) -> dict[int, str]:
        """The text of each id; empty for a model without a tokenizer (ids are all it has)."""
        if self._text is None:
            return {}
        return {token_id: self._text(token_id) for token_id in token_ids}


def _decoder(tokenizer: Any) -> Callable[[int], str]:
    # Special tokens keep their text (vLLM decodes logprob tokens the same way).
    return lambda token_id: str(tokenizer.decode([token_id], skip_special_tokens=False))
