"""What the engine keeps of each request while it runs: its choices (one sequence each, with
the text made so far) or its beam search, its metrics, and how its output is put together."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.beam_search import BeamSearch
from engine.detokenizer import IncrementalDetokenizer
from engine.lora.request import LoRARequest
from engine.outputs import (
    CompletionOutput,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.sequence import Sequence
from engine.stop import StopRules, append_until_stop
from schemas.sampling import SamplingParams


@dataclass(eq=False)
class ChoiceState:
    seq: Sequence  # holds how the choice finished
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    # Its last delta is out. The scheduler may have finished the sequence a moment earlier in
    # the same step, before its text was made.
    finished: bool = False

    @classmethod
    def start(cls, seq: Sequence, tokenizer: Any | None) -> ChoiceState:
        detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, seq.params)
        return cls(seq=seq, detokenizer=detokenizer, logprobs=[] if seq.params.logprobs else None)

    def replay(self, prior: list[int], rules: StopRules) -> None:
        """Take in the tokens an earlier attempt produced, through the same stop checks."""
        seq = self.seq
        stop = append_until_stop(seq, prior, rules)
        replayed = seq.num_output_tokens
        delta = self.detokenizer.add_tokens(prior[:replayed], stop)
        seq.token_ids.extend(prior[replayed:])  # past its stop: kept, though never output as text
        self.text = self.detokenizer.output_text
        if delta.finish_reason is not None:
            seq.mark_finished(delta.finish_reason, delta.stop_reason)
            self.finished = True

    def delta(
        self,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        output: RequestOutput | None = None,
    ) -> RequestDelta:
        return RequestDelta(
            request_id=self.seq.request_id,
            choice_index=self.seq.choice_index,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=self.seq.finish_reason,
            stop_reason=self.seq.stop_reason,
            output=output,
        )


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    priority: int = 0
    choices: list[ChoiceState] = field(default_factory=list)
    forked: bool = False  # n > 1: children are forked from choice 0 once its prompt is computed
    beam: BeamSearch | None = None  # a beam search request: its beams replace the choices
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # best_of > n: the params as asked (params runs best_of choices); the n best are returned.
    returned: SamplingParams | None = None
    # With prompt_logprobs: each prompt token's, filled in as the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return len(self.choices) == self.params.n and all(c.finished for c in self.choices)

    def new_sequence(self, choice_index: int = 0) -> Sequence:
        return Sequence.from_prompt(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            priority=self.priority,
            choice_index=choice_index,
            arrival_time=self.metrics.arrival_time,
            lora=self.lora,
        )

    def fail(self, reason: str, tokenizer: Any | None) -> None:
        """Finish every choice that has not finished with "error", the unforked ones too."""
        for index in range(len(self.choices), self.params.n):
            self.choices.append(ChoiceState.start(self.new_sequence(index), tokenizer))
        self.forked = True
        for choice in self.choices:
            if not choice.finished:
                choice.seq.mark_finished("error", reason)
                choice.finished = True

    def output(self) -> RequestOutput:
        """The whole output of a finished request, and its finishing time."""
        self.metrics.finished_time = time.monotonic()
        outputs = [
            CompletionOutput(
                index=c.seq.choice_index,
                text=c.text,
                token_ids=c.seq.output_token_ids,
                finish_reason=c.seq.finish_reason,
                stop_reason=c.seq.stop_reason,
                logprobs=c.logprobs,
                cumulative_logprob=(
                    None if c.logprobs is None else sum(item.logprob for item in c.logprobs)
                ),
            )
            for c in self.choices
        ]
        if self.returned is not None:
            outputs = _best_of(outputs, self.returned)
        return self.output_of(outputs)

    def output_of(self, outputs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            metrics=self.metrics,
            finished=True,
            prompt_logprobs=self.prompt_logprobs,
        )


def _best_of(outputs: list[CompletionOutput], returned: SamplingParams) -> list[CompletionOutput]:
    """The returned.n outputs of highest cumulative logprob (vLLM's best_of), best first,
    renumbered; their logprobs only where they were asked for."""
    ranked = sorted(outputs, key=lambda out: -(out.cumulative_logprob or 0.0))[: returned.n]
    for index, out in enumerate(ranked):
        out.index = index
        if not returned.logprobs:
            out.logprobs = None
    return ranked
