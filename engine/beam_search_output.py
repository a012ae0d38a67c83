"""`LLM.beam_search`'s result in vLLM's shape: `.sequences[i].text / .tokens / .cum_logprob`.

It is also the request's `RequestOutput` (`.outputs[i]` hold the beams' own tokens and text),
so code written against either shape reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import RequestOutput, TokenLogprob
from schemas.chunks import FinishReason

Decode = Callable[[list[int]], str]


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM's: `tokens` and `text` include the prompt (vLLM decodes the
    whole sequence, special tokens kept); `logprobs` stay empty, as this engine returns no
    per-token logprobs for beams."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class BeamSearchOutput(RequestOutput):
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)

    @classmethod
    def of(cls, output: RequestOutput, decode: Decode | None) -> BeamSearchOutput:
        sequences = []
        for beam in output.outputs:
            tokens = output.prompt_token_ids + beam.token_ids
            sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    cum_logprob=beam.cumulative_logprob or 0.0,
                    text=decode(tokens) if decode is not None else None,
                    finish_reason=beam.finish_reason,
                    stop_reason=beam.stop_reason,
                )
            )
        return cls(
            request_id=output.request_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=output.outputs,
            metrics=output.metrics,
            finished=output.finished,
            sequences=sequences,
        )
