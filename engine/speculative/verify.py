"""Verification of draft tokens, exact for greedy and sampled requests.

Each verified position j of a sequence gets the target's own pick x_j from the logits at that
position, through the ordinary sampler: penalties and the min_tokens mask see the output as it
would be with draft[:j] accepted, greedy rows take the argmax, sampled rows draw by the
exponential race. Drafts are accepted while x_j equals draft[j]; the first disagreeing x_j (or
the bonus x_k when all agree) follows them.

Every proposer here proposes a single token per position (a point mass), and for a point-mass
draft this sample-and-compare is rejection sampling itself: the draft d is accepted with
probability p(d), and a rejection emits x ~ p conditioned on x != d, which is the residual
distribution norm(max(0, p - q)). So every emitted token is distributed exactly as the target's.
It also keeps a seeded sequence's noise stream as without speculation, one row per emitted
token (rows drawn for rejected positions are given back), so a seed gives the same tokens with
or without speculation, and a resumed request continues the same stream.
"""

from __future__ import annotations

import torch

from engine.runner_io import TokenPick
from engine.sampler import Sampler
from engine.sampling.penalties import uses_penalties
from engine.sequence import ScheduledSeq, Sequence


def _position_views(seq: Sequence, draft: list[int]) -> list[Sequence]:
    """The sequence as the sampler should see it at each verified position: with draft[:j]
    appended. The sequence itself stands for every position where only params are read."""
    if not draft or not (uses_penalties(seq) or seq.num_output_tokens < seq.params.min_tokens):
        return [seq] * (1 + len(draft))
    return [seq] + [seq.extended_view(draft[:j]) for j in range(1, len(draft) + 1)]


def verify(sampler: Sampler, logits: torch.Tensor, entries: list[ScheduledSeq]) -> list[TokenPick]:
    """Picks of each sampling entry from its rows of `logits` (1 + its drafts each, in order)."""
    views: list[Sequence] = []
    for entry in entries:
        views += _position_views(entry.seq, entry.draft_token_ids)
    saved_streams = {
        row: entry.seq.sampler_state.generator.get_state()
        for row, entry in enumerate(entries)
        if entry.draft_token_ids and entry.seq.sampler_state.generator is not None
    }
    picked = sampler(logits, views)
    results = []
    start = 0
    for row, entry in enumerate(entries):
        draft = entry.draft_token_ids
        choices = picked.token_ids[start : start + 1 + len(draft)]
        accepted = 0
        while accepted < len(draft) and choices[accepted] == draft[accepted]:
            accepted += 1
        end = start + accepted + 1
        results.append(
            TokenPick(
                token_ids=choices[: accepted + 1],
                logprobs=picked.logprobs[start:end],
                top_logprobs=picked.top_logprobs[start:end],
                num_draft_tokens=len(draft),
                num_accepted_tokens=accepted,
            )
        )
        if accepted < len(draft):
            _give_back_noise(entry.seq, saved_streams.get(row), accepted + 1, sampler.vocab_size)
        start += 1 + len(draft)
    return results


def _give_back_noise(
    seq: Sequence, saved: torch.Tensor | None, num_used: int, vocab_size: int
) -> None:
    """Rewind a seeded sequence's noise stream to just past the rows its emitted tokens used."""
    state = seq.sampler_state
    generator = state.generator
    if generator is None or seq.params.greedy:
        return
    if saved is None:
        # Made during this step: made again on the next draw, skipping one row per output token.
        state.generator = None
        return
    generator.set_state(saved)
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
    for _ in range(num_used):
        scratch.exponential_(generator=generator)
