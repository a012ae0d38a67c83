"""From a step's logits to what each sampling row asked for: the argmax rows' tokens, the
sampled rows' tokens after the logits processors (drafts verified), the raw logits rows."""

from __future__ import annotations

import torch

from engine.runner_io import ModelRunnerOutput, RowMode, SamplingBatch, SamplingRow, TokenPick
from engine.sampler import Sampler, argmax
from engine.speculative.verify import verify


def pick_tokens(logits: torch.Tensor, batch: SamplingBatch, sampler: Sampler) -> ModelRunnerOutput:
    """`logits` holds each row's num_logits rows in batch order; processors edit it in place."""
    groups: dict[RowMode, tuple[list[SamplingRow], list[int]]] = {
        mode: ([], []) for mode in RowMode
    }
    start = 0
    for row in batch.rows:
        rows, positions = groups[row.mode]
        rows.append(row)
        positions.extend(range(start, start + row.num_logits))
        start += row.num_logits
    if start != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for a batch that yields {start}")

    def rows_of(mode: RowMode) -> torch.Tensor:
        positions = groups[mode][1]
        if len(positions) == start:
            return logits
        index = torch.tensor(positions, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index)

    argmax_rows, _ = groups[RowMode.ARGMAX]
    argmax_picks: list[TokenPick] = []
    if argmax_rows:
        token_ids = argmax(rows_of(RowMode.ARGMAX)[:, : sampler.vocab_size]).tolist()
        argmax_picks = [TokenPick.single(token_id) for token_id in token_ids]
    sampled_rows, _ = groups[RowMode.SAMPLE]
    sampled_picks: list[TokenPick] = []
    if sampled_rows:
        sampled = rows_of(RowMode.SAMPLE)
        # One logits row per sampled token position: 1 + k for a sequence verifying k drafts.
        row_seqs = [row.entry.seq for row in sampled_rows for _ in range(row.num_logits)]
        for processor in batch.processors:
            processor(sampled, row_seqs)
        sampled_picks = _sample(sampler, sampled, sampled_rows)
    # Back into batch order: each mode's picks are in batch order among that mode's rows.
    by_mode = {RowMode.ARGMAX: iter(argmax_picks), RowMode.SAMPLE: iter(sampled_picks)}
    output = ModelRunnerOutput()
    output.picks = [
        (row.entry, next(by_mode[row.mode])) for row in batch.rows if row.mode in by_mode
    ]
    logits_rows, _ = groups[RowMode.LOGITS]
    if logits_rows:
        wanted = rows_of(RowMode.LOGITS)
        start = 0
        for row in logits_rows:
            output.logits.append((row.entry, wanted[start : start + row.num_logits]))
            start += row.num_logits
    return output


def _sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> list[TokenPick]:
    entries = [row.entry for row in rows]
    if any(entry.draft_token_ids for entry in entries):
        return verify(sampler, logits, entries)
    sampled = sampler(logits, [entry.seq for entry in entries])
    return [
        TokenPick.single(token_id, logprob, top)
        for token_id, logprob, top in zip(
            sampled.token_ids, sampled.logprobs, sampled.top_logprobs, strict=True
        )
    ]
