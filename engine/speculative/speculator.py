"""Which sequences speculate this step, how many tokens each, and how speculation has paid.

Before each step the engine asks the speculator to give every decoding sequence its draft
tokens (`SpeculationState.draft_token_ids`); the scheduler budgets 1 + len(draft) tokens for
it; after verification the speculator counts what was accepted. Speculation is off for the
whole step when more sequences decode than `disable_by_batch_size` (the step is compute-bound,
so every rejected token costs what a real one does), and for one sequence a while after its
acceptance rate over a window fell below `min_acceptance_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.sequence import Sequence, SequenceStatus
from engine.speculative.config import SpeculativeConfig

# Draft tokens over which a sequence's acceptance rate is judged: two steps at k = 4, so text
# that does not repeat costs few wide steps. A sequence judged too low goes without
# speculation for BACKOFF_TOKENS output tokens, twice as long after each further failure.
ACCEPTANCE_WINDOW = 8
BACKOFF_TOKENS = 32


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] draft tokens for each decoding sequence seqs[i]."""
        ...


@dataclass
class SpeculationCounts:
    num_drafts: int = 0  # verification steps of one sequence with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.counts = SpeculationCounts()

    def _limit(self, seq: Sequence) -> int:
        """Draft tokens worth proposing: each accepted one plus the bonus must still fit the
        request's max_tokens and the context."""
        state = seq.spec_state
        if seq.num_output_tokens < state.resume_at_output:
            return 0
        room = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        return max(0, min(self.config.num_speculative_tokens, room - 1))

    def propose(self, running: list[Sequence]) -> None:
        """Set the draft tokens of every running sequence that may speculate for the next step."""
        decoding = []
        for seq in filter(may_speculate, running):
            seq.spec_state.draft_token_ids = []
            if (
                seq.status is SequenceStatus.RUNNING
                and seq.num_tokens - seq.num_computed_tokens == 1
            ):
                decoding.append(seq)
        limit_batch = self.config.disable_by_batch_size
        if limit_batch is not None and len(decoding) > limit_batch:
            return
        limits = [self._limit(seq) for seq in decoding]
        chosen = [i for i, limit in enumerate(limits) if limit > 0]
        if not chosen:
            return
        drafts = self.proposer.propose([decoding[i] for i in chosen], [limits[i] for i in chosen])
        for i, draft in zip(chosen, drafts, strict=True):
            decoding[i].spec_state.draft_token_ids = draft[: limits[i]]

    def record(self, seq: Sequence, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification and judge the sequence's acceptance rate over its window."""
        if num_draft_tokens == 0:
            return
        counts = self.counts
        counts.num_drafts += 1
        counts.num_draft_tokens += num_draft_tokens
        counts.num_accepted_tokens += num_accepted_tokens
        state = seq.spec_state
        state.num_proposed += num_draft_tokens
        state.num_accepted += num_accepted_tokens
        if state.num_proposed < ACCEPTANCE_WINDOW:
            return
        if state.num_accepted < self.config.min_acceptance_rate * state.num_proposed:
            state.resume_at_output = seq.num_output_tokens + (BACKOFF_TOKENS << state.num_backoffs)
            state.num_backoffs = min(state.num_backoffs + 1, 5)
        state.num_proposed = state.num_accepted = 0


def may_speculate(seq: Sequence) -> bool:
    """Beams are ranked, not verified; a grammar's mask at each draft position would depend
    on drafts its matcher has not accepted yet."""
    return not (seq.params.use_beam_search or seq.params.structured_output)
