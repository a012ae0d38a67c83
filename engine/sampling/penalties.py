"""Repetition, frequency and presence penalties, and the min_tokens stop-token mask (vLLM semantics).

Counts and presence masks for the whole batch are built with one flat scatter each.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from engine.sequence import Sequence


def uses_penalties(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _scatter_indices(
    flat_ids: torch.Tensor, lengths: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) device tensors for rows concatenated in `flat_ids` (CPU)."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    # Token ids beyond the logits (added tokens the head lacks) cannot be penalised.
    in_vocab = flat_ids < vocab_size
    if not bool(in_vocab.all()):
        rows, flat_ids = rows[in_vocab], flat_ids[in_vocab]
    return rows.to(device, non_blocking=True), flat_ids.to(device, non_blocking=True)


def token_counts(
    flat_ids: torch.Tensor, lengths: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab_size] float32 count of each token id per row; rows concatenated in flat_ids."""
    counts = torch.zeros(len(lengths), vocab_size, dtype=torch.float32, device=device)
    rows, tokens = _scatter_indices(flat_ids, lengths, vocab_size, device)
    if tokens.numel():
        ones = torch.ones(tokens.shape, dtype=counts.dtype, device=device)
        counts.index_put_((rows, tokens), ones, accumulate=True)
    return counts


def token_presence(
    flat_ids: torch.Tensor, lengths: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[rows, vocab_size] bool: does the row contain the token id; rows concatenated in flat_ids."""
    present = torch.zeros(len(lengths), vocab_size, dtype=torch.bool, device=device)
    rows, tokens = _scatter_indices(flat_ids, lengths, vocab_size, device)
    if tokens.numel():
        present[rows, tokens] = True
    return present


def _prompt_tensor(seq: Sequence) -> torch.Tensor:
    """The prompt as a CPU tensor, made once per sequence (the prompt never changes) and kept on
    it; output ids (short, growing) are converted every step."""
    state = seq.sampler_state
    if state.prompt_ids is None:
        state.prompt_ids = torch.tensor(seq.prompt_token_ids, dtype=torch.long)
    return state.prompt_ids


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Penalised copy of `logits` [len(seqs), V], rows aligned with `seqs`.

    repetition_penalty touches tokens seen in prompt or output (positive logits divided,
    the rest multiplied); frequency_penalty subtracts penalty x output count;
    presence_penalty subtracts penalty once for every token present in the output.
    """
    vocab_size, device = logits.shape[1], logits.device
    params = [seq.params for seq in seqs]
    outputs = [seq.output_token_ids for seq in seqs]
    flat_outputs = torch.tensor(list(itertools.chain.from_iterable(outputs)), dtype=torch.long)
    counts = token_counts(flat_outputs, [len(ids) for ids in outputs], vocab_size, device)
    in_output = counts > 0

    def column(values: Iterable[float]) -> torch.Tensor:
        host = torch.tensor(list(values), dtype=logits.dtype)
        return host.to(device, non_blocking=True)[:, None]

    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [_prompt_tensor(seq) for seq in seqs]
        lengths = [len(ids) for ids in prompts]
        seen = in_output | token_presence(torch.cat(prompts), lengths, vocab_size, device)
        penalty = torch.where(seen, column(p.repetition_penalty for p in params), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    else:
        logits = logits.clone()
    if any(p.frequency_penalty != 0.0 for p in params):
        logits -= column(p.frequency_penalty for p in params) * counts
    if any(p.presence_penalty != 0.0 for p in params):
        logits -= column(p.presence_penalty for p in params) * in_output
    return logits


def min_tokens_mask_indices(
    seqs: list[Sequence], eos_token_ids: Iterable[int], vocab_size: int
) -> tuple[list[int], list[int]]:
    """(rows, token ids) to forbid: EOS and stop token ids of rows still short of min_tokens."""
    eos = [t for t in eos_token_ids if t < vocab_size]
    rows: list[int] = []
    tokens: list[int] = []
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens >= seq.params.min_tokens:
            continue
        banned = set(eos)
        banned.update(t for t in seq.params.stop_token_ids if t < vocab_size)
        rows.extend([row] * len(banned))
        tokens.extend(banned)
    return rows, tokens
