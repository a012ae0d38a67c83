"""Speculation turns itself off where it does not pay: large batches, low acceptance."""

from __future__ import annotations

from engine.sequence import Sequence, SequenceStatus
from engine.speculative.config import SpeculativeConfig
from engine.speculative.speculator import ACCEPTANCE_WINDOW, BACKOFF_TOKENS, Speculator
from schemas.sampling import SamplingParams


class _FixedGuess:
    """Proposes as many 7s as allowed."""

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        return [[7] * limit for limit in max_tokens]


def _decoding(max_tokens: int = 100) -> Sequence:
    seq = Sequence(
        request_id="r",
        token_ids=[1, 2, 3, 4],
        num_prompt_tokens=3,
        params=SamplingParams(max_tokens=max_tokens),
    )
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def _speculator(**overrides) -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, **overrides)
    return Speculator(config, _FixedGuess(), max_model_len=1000)


def test_a_batch_larger_than_the_limit_does_not_speculate() -> None:
    speculator = _speculator(disable_by_batch_size=2)
    small, large = [_decoding() for _ in range(2)], [_decoding() for _ in range(3)]
    speculator.propose(small)
    assert all(s.spec_state.draft_token_ids == [7] * 4 for s in small)
    speculator.propose(large)
    assert all(s.spec_state.draft_token_ids == [] for s in large)


def test_drafts_stop_short_of_max_tokens() -> None:
    seq = _decoding(max_tokens=3)  # one output token so far: two more, so one draft and a bonus
    _speculator().propose([seq])
    assert seq.spec_state.draft_token_ids == [7]


def test_a_sequence_whose_drafts_are_rejected_stops_speculating_a_while() -> None:
    speculator = _speculator(min_acceptance_rate=0.5)
    seq = _decoding(max_tokens=10_000)
    for _ in range(ACCEPTANCE_WINDOW // 4):
        speculator.propose([seq])
        speculator.record(seq, len(seq.spec_state.draft_token_ids), 0)
        seq.token_ids.append(5)
        seq.num_computed_tokens += 1
    speculator.propose([seq])
    assert seq.spec_state.draft_token_ids == []
    seq.token_ids += [5] * BACKOFF_TOKENS
    seq.num_computed_tokens = seq.num_tokens - 1
    speculator.propose([seq])
    assert seq.spec_state.draft_token_ids == [7] * 4
    stats = speculator.counts
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (ACCEPTANCE_WINDOW, 0)


def test_a_sequence_whose_drafts_are_accepted_keeps_speculating() -> None:
    speculator = _speculator(min_acceptance_rate=0.5)
    seq = _decoding(max_tokens=10_000)
    for _ in range(3 * ACCEPTANCE_WINDOW // 4):
        speculator.propose([seq])
        assert seq.spec_state.draft_token_ids == [7] * 4
        speculator.record(seq, 4, 3)
        seq.token_ids += [7] * 4
        seq.num_computed_tokens = seq.num_tokens - 1
