"""Incremental detokenization of one sequence, and its stop strings.

Text is produced token by token by decoding a short window of ids (the vLLM prefix/read offset
technique): the window starts at the tokens that produced the last released text, and new text
is released only once it no longer ends in U+FFFD, i.e. a token that stops inside a multi-byte
UTF-8 character waits for the token that completes it. Each step costs one decode of a few
tokens, independent of the output length.

Stop strings may span tokens and steps: text that could be the start of a stop string is held
back until it is resolved, so no emitted text is ever retracted; a matched stop string and
everything after it are dropped; a finish releases what was held back. The other stop
conditions are token-based and decided beside the scheduler (engine.stop); the caller passes
such a finish in with the token that caused it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.stop import Stop
from schemas.chunks import FinishReason
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)

# Prompt tokens decoded in front of the first output tokens, so that decoders which treat the
# start of a text specially (SentencePiece strips the leading space) see the output in context.
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


@dataclass
class TextDelta:
    text: str  # new text safe to emit now
    finish_reason: FinishReason | None = None  # "stop" or "length"
    stop_reason: str | int | None = None  # matched stop string or stop token id (None for EOS)
    # A stop string found in the text of a token that also ended the sequence otherwise wins.


def _decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """tokenizer.decode, calling the Rust tokenizer directly when that gives the same text."""
    if tokenizer is None:  # weight-only models (benchmarks): token ids out, no text
        return lambda ids: ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # HF fast tokenizers decode exactly like this, minus ~15 us of Python per call.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class _WindowDecoder:
    """Turns a token stream into text, decoding only the tokens since the last released text."""

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int]) -> None:
        self._decode = decode
        # _ids[:_read] produced text already (their decode is _prefix_text); the rest is pending.
        self._ids = list(context_ids)
        self._read = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Text of the pending tokens even if it ends inside a character (shown as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or (not final and text.endswith(_INCOMPLETE)):
            return ""
        new_text = text[len(self._prefix_text) :]
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text


class _StopStrings:
    """Finds stop strings in text that grows at the end."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(start, stop string) of the first match to end past text[:new_from], if any.

        "First" is the match that ends earliest, as if the text had arrived one character at
        a time; that is what a token-by-token stream with shorter tokens would have stopped at.
        """
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class IncrementalDetokenizer:
    """Text of one sequence, fed its output tokens as they are sampled; finds stop strings.

    Stop strings count once the output has at least min_tokens tokens. A finish decided by a
    token (engine.stop) comes in with that token: "stop" (EOS or a stop token id) leaves that
    token's text out, "length" keeps it; either releases all text held back. With
    include_stop_str_in_output the matched stop string, and a stop token's text, are kept.

    The deltas' concatenation is the output text as it reads after the prompt; for byte-level
    BPE tokenizers that equals tokenizer.decode(output_ids).
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.params = params
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self._decoder = _WindowDecoder(
            _decode_function(tokenizer, params.skip_special_tokens),
            list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]),
        )
        self._stop_strings = _StopStrings(params.stop)
        self._emitted: list[str] = []  # released text, joined lazily by output_text
        self._held = ""  # decoded but not yet released: may still turn into a stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_text(self) -> str:
        """All text released so far: the concatenation of every delta's text."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def add_tokens(self, token_ids: Sequence[int], stop: Stop | None = None) -> TextDelta:
        """Feed newly sampled tokens; a resumed sequence may feed all its earlier ones at once.

        `stop`: how the last of them ended the sequence (engine.stop.check_stop), if it did."""
        if self.finished:
            logger.debug("tokens added to a finished sequence are ignored")
            return TextDelta("", self.finish_reason, self.stop_reason)
        last = len(token_ids) - 1
        for position, token_id in enumerate(token_ids):
            self._add_token(token_id, stop if position == last else None)
            if self.finished:
                break
        release = len(self._held)
        if not self.finished:
            release -= self._stop_strings.holdback(self._held)
        text, self._held = self._held[:release], self._held[release:]
        if text:
            self._emitted.append(text)
        return TextDelta(text, self.finish_reason, self.stop_reason)

    def _add_token(self, token_id: int, stop: Stop | None) -> None:
        self.num_output_tokens += 1
        past_min_tokens = self.num_output_tokens >= self.params.min_tokens
        if stop is not None and stop.finish_reason == "stop":  # EOS or a stop token id
            if self.params.include_stop_str_in_output:
                self._append(self._decoder.push(token_id), check_stop_strings=False)
            self._append(self._decoder.flush(), past_min_tokens)
            self._finish(stop.finish_reason, stop.stop_reason)
            return
        self._append(self._decoder.push(token_id), past_min_tokens)
        if stop is not None and not self.finished:
            self._append(self._decoder.flush(), past_min_tokens)
            self._finish(stop.finish_reason, stop.stop_reason)

    def _append(self, text: str, check_stop_strings: bool) -> None:
        if not text:
            return
        new_from = len(self._held)
        self._held += text
        if not (check_stop_strings and self._stop_strings):
            return
        match = self._stop_strings.find(self._held, new_from)
        if match is not None:
            start, stop = match
            kept = start + len(stop) if self.params.include_stop_str_in_output else start
            self._held = self._held[:kept]
            self._finish("stop", stop)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        if self.finish_reason is None:  # a stop string found while flushing wins
            self.finish_reason, self.stop_reason = reason, stop_reason
