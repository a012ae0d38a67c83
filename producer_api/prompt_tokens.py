"""Counting prompt tokens in the API with the model's own tokenizer.json (the `tokenizers`
library: no torch, no transformers), where the API can read the file a worker advertises.

A worker names its tokenizer.json in its heartbeat by the path on its own host; an API on the
same host, or sharing the model cache volume, loads it once. Where it cannot, nothing is counted
and the worker decides, as before."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import anyio
from tokenizers import Tokenizer

log = logging.getLogger(__name__)


class PromptTokenizer:
    """A model's tokenizer, used only to count tokens (never to build a job's prompt)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def count(self, text: str) -> int:
        """Tokens of `text` without the special tokens a template or the engine may add."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[str]]:
        """Token ids of `text` and each token's string (the tokenize endpoint's answer)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.tokens

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


class TokenizerCache:
    """Tokenizers by path, each loaded once (off the event loop); a path that cannot be loaded
    is remembered as such and logged once."""

    def __init__(self) -> None:
        self._loaded: dict[str, PromptTokenizer | None] = {}
        self._lock = asyncio.Lock()

    async def get(self, path: str | None) -> PromptTokenizer | None:
        if path is None:
            return None
        if path in self._loaded:
            return self._loaded[path]
        async with self._lock:
            if path not in self._loaded:
                self._loaded[path] = await anyio.to_thread.run_sync(_load, path)
            return self._loaded[path]


def _load(path: str) -> PromptTokenizer | None:
    file = Path(path)
    if not file.is_file():
        log.info("tokenizer %s is not on this host: prompt lengths are left to the workers", path)
        return None
    try:
        tokenizer = Tokenizer.from_file(str(file))
        # Counted whole: a tokenizer.json that truncates (sentence-transformers folders cut at
        # 128 tokens) would hide an input too long for the model.
        tokenizer.no_truncation()
        return PromptTokenizer(tokenizer)
    except Exception as exc:  # a file this tokenizers version cannot read: the worker counts
        log.warning(
            "cannot load tokenizer %s (%s): prompt lengths are left to the workers", path, exc
        )
        return None
