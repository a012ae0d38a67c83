"""Token-based stop conditions, checked where the scheduler takes in each sampled token.

Semantics (vLLM): EOS (unless ignore_eos) and stop_token_ids finish with "stop" once the output
has at least min_tokens tokens; max_tokens or prompt + output reaching max_model_len finish
with "length"; a stop on the same token as the length limit reports "stop". Stop strings need
the text, so the detokenizer finds those (engine.detokenizer).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from engine.sequence import Sequence


@dataclass(frozen=True)
class Stop:
    """How a token ended its sequence."""

    finish_reason: Literal["stop", "length"]  # "stop": EOS or a stop token id (text not output)
    stop_reason: int | None = None  # the stop token id; None for EOS and for length


@dataclass(frozen=True)
class StopRules:
    """What every sequence of an engine stops at besides its own sampling params."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    @classmethod
    def of(cls, eos_token_ids: Iterable[int], max_model_len: int) -> StopRules:
        return cls(frozenset(eos_token_ids), max_model_len)


def check_stop(seq: Sequence, rules: StopRules) -> Stop | None:
    """How `seq`'s last token ends it, or None while it goes on."""
    params = seq.params
    token_id = seq.last_token_id
    num_output_tokens = seq.num_output_tokens
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return Stop("stop", token_id)
        if not params.ignore_eos and token_id in rules.eos_token_ids:
            return Stop("stop")
    if num_output_tokens >= params.max_tokens or seq.num_tokens >= rules.max_model_len:
        return Stop("length")
    return None


def append_until_stop(seq: Sequence, token_ids: Iterable[int], rules: StopRules) -> Stop | None:
    """Append tokens one by one, checking each; the first that ends `seq` ends the appending.

    Returns that stop (the tokens appended are then the ones up to and including it)."""
    for token_id in token_ids:
        seq.append_token(token_id)
        stop = check_stop(seq, rules)
        if stop is not None:
            return stop
    return None
