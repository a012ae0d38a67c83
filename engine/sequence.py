"""A sequence: one choice of one request, with its tokens, progress and KV blocks."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from schemas.chunks import FinishReason
from schemas.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.lora.request import LoRARequest

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SamplerState:
    """What the sampler keeps about one sequence, made on first use; it dies with the sequence."""

    generator: torch.Generator | None = None  # a seeded sequence's own noise stream
    prompt_ids: torch.Tensor | None = None  # the prompt as a CPU tensor, for repetition_penalty
    allowed_ids: torch.Tensor | None = None  # allowed_token_ids inside the vocabulary, on device
    bad_words_ids: list[list[int]] | None = None  # bad_words as token sequences


@dataclass(eq=False)
class SpeculationState:
    """How speculation has gone for one sequence; it dies with the sequence."""

    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step
    num_proposed: int = 0  # draft tokens verified while the acceptance rate is judged
    num_accepted: int = 0
    resume_at_output: int = 0  # speculation stays off until the output is this long
    num_backoffs: int = 0  # times the acceptance rate was judged too low


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0  # lower runs first
    choice_index: int = 0  # which of the request's n choices this is
    arrival_time: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None  # "stop", "length" or "abort" once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    # Prefix-cache bookkeeping, owned by the BlockManager. Hashes depend on tokens only, so they
    # survive preemption; registered blocks are the leading table entries already offered to
    # the cache (reset when the table is freed).
    cache_salt: str | None = None  # keeps caches of different tenants/adapters apart
    lora_id: int = 0  # the LoRA adapter it runs with (engine.lora); 0: the base model
    block_hashes: list[int] = field(default_factory=list)  # chained hash per full block
    num_registered_blocks: int = 0
    sampler_state: SamplerState = field(default_factory=SamplerState)
    spec_state: SpeculationState = field(default_factory=SpeculationState)

    @classmethod
    def from_prompt(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        choice_index: int = 0,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
    ) -> Sequence:
        """A new sequence that has computed nothing yet: one choice of a request."""
        return cls(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            priority=priority,
            choice_index=choice_index,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            cache_salt=None if lora is None else lora.cache_salt,
            lora_id=0 if lora is None else lora.lora_int_id,
        )

    def new_choice(self, choice_index: int, *, with_output: bool) -> Sequence:
        """Another choice of this sequence's request, from its prompt (an n > 1 sibling) or
        from its whole history (a beam's branch); its progress and blocks are the caller's."""
        child = self.shadow(with_output)
        child.priority, child.choice_index = self.priority, choice_index
        child.arrival_time, child.cache_salt = self.arrival_time, self.cache_salt
        child.lora_id = self.lora_id
        return child

    def shadow(self, with_output: bool = True) -> Sequence:
        """A sequence of its own (new id, no blocks, fresh state) holding this one's tokens (or
        only its prompt): a draft model's copy, and what new_choice starts from."""
        token_ids = self.token_ids if with_output else self.prompt_token_ids
        return Sequence(self.request_id, list(token_ids), self.num_prompt_tokens, self.params)

    def extended_view(self, extra_token_ids: list[int]) -> Sequence:
        """This sequence as the sampler sees it with extra tokens appended: the same id and
        sampler state, so penalties, min_tokens and seeded noise read as they will then."""
        view = Sequence(
            self.request_id, self.token_ids + extra_token_ids, self.num_prompt_tokens, self.params
        )
        view.choice_index, view.seq_id = self.choice_index, self.seq_id
        view.sampler_state = self.sampler_state
        return view

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def mark_finished(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Record how the sequence ended; freeing its blocks is the scheduler's part."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason


@dataclass(eq=False)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [num_computed_tokens, +num_new_tokens).

    A speculating sequence computes its last token followed by the proposed draft tokens, and
    yields logits at each of those 1 + len(draft_token_ids) positions for verification."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    # True when this step catches the sequence up to all its tokens, so it yields logits.
    # Fixed when the step is scheduled: it must stay valid after update_after_step advanced
    # num_computed_tokens and after the sampled token was appended.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        caught_up = self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
        self.samples = caught_up == self.seq.num_tokens

    @property
    def num_logits(self) -> int:
        """Rows of logits this entry yields: one per verified position, none mid-prefill."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        """The token ids this step computes (valid until the step's tokens are appended)."""
        start = self.seq.num_computed_tokens
        end = start + self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[start:end] + self.draft_token_ids
