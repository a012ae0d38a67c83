"""Prompt logprobs (vLLM's `prompt_logprobs`): the model's log-probability of each prompt token
after the tokens before it, from the hidden states a prefill step computes anyway.

A step's entry computing prompt positions [start, end) scores the tokens at start + 1 .. end
(the last prompt position predicts the first output token, which is the sampler's business).
Chunked prefill scores a prompt chunk by chunk; a recomputed prompt (after preemption) scores
the same positions again with the same values. Sequences that want them skip the prefix cache,
since cached positions are never computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sequence import ScheduledSeq

# Rows of logits made at once: a long prompt's [tokens, vocab] would not fit in memory.
_ROWS_PER_CHUNK = 256


@dataclass(frozen=True)
class PromptSpan:
    """Prompt tokens one step scores for one entry: hidden rows [row, row + count) predict the
    prompt tokens at positions [first_position, first_position + count)."""

    entry: ScheduledSeq
    row: int
    first_position: int
    count: int


@dataclass
class PromptLogprobsChunk:
    """Scores of prompt tokens at positions [first_position, first_position + len(logprobs))."""

    first_position: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def wants_prompt_logprobs(entry: ScheduledSeq) -> bool:
    return entry.seq.params.prompt_logprobs is not None


def prompt_spans(batch: list[ScheduledSeq]) -> list[PromptSpan]:
    """The prompt tokens this step scores, by entry; [] when no entry asks for them."""
    spans: list[PromptSpan] = []
    row = 0
    for entry in batch:
        seq = entry.seq
        start = seq.num_computed_tokens
        if wants_prompt_logprobs(entry):
            # Position p predicts token p + 1; the last prompt position predicts an output token.
            end = min(start + entry.num_new_tokens, seq.num_prompt_tokens - 1)
            if end > start:
                spans.append(PromptSpan(entry, row, start + 1, end - start))
        row += entry.num_new_tokens
    return spans


@torch.inference_mode()
def score_prompts(
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> list[tuple[ScheduledSeq, PromptLogprobsChunk]]:
    """Each span's chunk of prompt logprobs from `hidden` (every row of the step)."""
    chunks = []
    for span in spans:
        seq = span.entry.seq
        first = span.first_position
        targets = seq.token_ids[first : first + span.count]
        top_k = seq.params.prompt_logprobs or 0
        values: list[float] = []
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        for offset in range(0, span.count, _ROWS_PER_CHUNK):
            rows = hidden[span.row + offset : span.row + min(span.count, offset + _ROWS_PER_CHUNK)]
            log_probs = compute_logits(rows)[:, :vocab_size].log_softmax(dim=-1)
            picked = torch.tensor(
                targets[offset : offset + rows.shape[0]], dtype=torch.long, device=rows.device
            )
            values += log_probs.gather(1, picked[:, None]).squeeze(1).tolist()
            if top_k:
                top = log_probs.topk(top_k, dim=-1)
                top_values += top.values.tolist()
                top_ids += top.indices.tolist()
        tops = [list(zip(i, v, strict=True)) for i, v in zip(top_ids, top_values, strict=True)]
        if not top_k:
            tops = [[] for _ in targets]
        chunks.append((span.entry, PromptLogprobsChunk(first, targets, values, tops)))
    return chunks
