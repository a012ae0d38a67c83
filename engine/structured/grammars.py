"""Grammars from constraints, compiled on a thread pool and cached by constraint.

Building the `Grammar` (parsing a schema, regex or EBNF) is cheap and happens when a request
arrives, so a bad constraint is refused then; compiling it against the vocabulary (the token
mask cache) is the slow part and runs on the pool, off the model step.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from engine.errors import RequestRejectedError
from schemas.structured import StructuredOutput

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512


def build_grammar(constraint: StructuredOutput) -> xgr.Grammar:
    """The constraint as an xgrammar Grammar; RequestRejectedError naming the problem if the
    grammar library refuses it."""
    kind = constraint.kind
    try:
        if constraint.json_schema is not None:
            return xgr.Grammar.from_json_schema(json.dumps(constraint.json_schema))
        if constraint.json_object:
            return xgr.Grammar.builtin_json_grammar()
        if constraint.regex is not None:
            return xgr.Grammar.from_regex(constraint.regex)
        if constraint.choice is not None:
            return xgr.Grammar.from_ebnf(choice_ebnf(constraint.choice))
        assert constraint.grammar is not None
        return xgr.Grammar.from_ebnf(constraint.grammar)
    except RuntimeError as exc:
        # xgrammar prefixes its messages with a timestamp and a source location.
        message = str(exc).strip().splitlines()[0].split(": ", 1)[-1]
        raise RequestRejectedError(f"invalid structured_output.{kind}: {message}") from None


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return f"root ::= {literals}"


class GrammarCache:
    """Compiled grammars by constraint; each compiles once, on the pool, whoever asks first."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # The tokenizer info scans the whole vocabulary: made on the pool too.
        self._compiler: Future[xgr.GrammarCompiler] = self._pool.submit(
            _make_compiler, tokenizer, vocab_size, stop_token_ids
        )
        self._compiled: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()

    def get(self, constraint: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `constraint`, perhaps still compiling. Raises
        RequestRejectedError at once if the constraint does not make a grammar."""
        key = constraint.cache_key()
        future = self._compiled.get(key)
        if future is not None:
            self._compiled.move_to_end(key)
            return future
        grammar = build_grammar(constraint)
        future = self._pool.submit(self._compile, grammar)
        self._compiled[key] = future
        while len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        return self._compiler.result().compile_grammar(grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _make_compiler(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    logger.info("grammar compiler ready: vocab_size=%d", vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1)
