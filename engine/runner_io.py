"""The typed seam between the engine and the model runner: what a step asks of each sampling
row (a plain argmax, a draw through the sampler and the logits processors, or the raw logits),
and what the runner gives back (each row's picked tokens, and the logits rows asked for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from engine.prompt_logprobs import PromptLogprobsChunk
from engine.sampler import takes_only_argmax
from engine.sequence import ScheduledSeq, Sequence


class LogitsProcessor(Protocol):
    """Edits the logits rows of the sequences it applies to, in place, before sampling
    (logit bias, grammar masks)."""

    def applies_to(self, seq: Sequence) -> bool: ...

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None: ...


class RowMode(Enum):
    ARGMAX = "argmax"  # the raw logits' argmax, nothing else asked: the runner may screen it
    SAMPLE = "sample"  # logits processors, then the sampler (verifying drafts, if any)
    LOGITS = "logits"  # the raw logits rows go back to the caller (beam search, draft models)


@dataclass(frozen=True)
class SamplingRow:
    """What one sampling entry of a step (one that is caught up and so yields logits) wants."""

    entry: ScheduledSeq
    mode: RowMode

    @property
    def num_logits(self) -> int:
        return self.entry.num_logits


@dataclass
class SamplingBatch:
    """The sampling entries of a step, in the scheduler's order, and the logits processors
    that SAMPLE rows go through."""

    rows: list[SamplingRow] = field(default_factory=list)
    processors: list[LogitsProcessor] = field(default_factory=list)

    @classmethod
    def uniform(cls, scheduled: list[ScheduledSeq], mode: RowMode) -> SamplingBatch:
        """Every sampling entry of `scheduled` in one mode (a draft model, a test)."""
        return cls([SamplingRow(entry, mode) for entry in scheduled if entry.samples])

    @property
    def all_argmax(self) -> bool:
        return bool(self.rows) and all(row.mode is RowMode.ARGMAX for row in self.rows)


def sampling_mode(entry: ScheduledSeq, processors: list[LogitsProcessor]) -> RowMode:
    """ARGMAX where the entry's one token is its raw logits' argmax and nothing else is asked
    of them: no drafts to verify, no processor editing its logits, and a sampler that takes the
    plain argmax (greedy, no penalties, no logprobs, min_tokens reached); else SAMPLE."""
    seq = entry.seq
    if (
        entry.draft_token_ids
        or not takes_only_argmax(seq)
        or any(processor.applies_to(seq) for processor in processors)
    ):
        return RowMode.SAMPLE
    return RowMode.ARGMAX


@dataclass
class TokenPick:
    """The tokens one ARGMAX or SAMPLE row produced, to append in order: one, or a verified
    run of drafts followed by the target's own pick."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def single(
        cls,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> TokenPick:
        return cls([token_id], [logprob], [top_logprobs])


@dataclass
class ModelRunnerOutput:
    """One step's results, in the batch's row order: each ARGMAX and SAMPLE row's picked
    tokens, each LOGITS row's float32 logits ([num_logits, vocab]), and the prompt logprobs
    of the entries that asked for them."""

    picks: list[tuple[ScheduledSeq, TokenPick]] = field(default_factory=list)
    logits: list[tuple[ScheduledSeq, torch.Tensor]] = field(default_factory=list)
    prompt_logprobs: list[tuple[ScheduledSeq, PromptLogprobsChunk]] = field(default_factory=list)
