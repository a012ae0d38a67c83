"""A step's model inputs: the scheduled sequences flattened into input ids, positions, cache
slots and block tables (vectorized, once per step). Every rank of a tensor-parallel replica runs
the forward from these; only the driver builds them from sequences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.sequence import ScheduledSeq

ToDevice = Callable[[np.ndarray], torch.Tensor]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to turn into logits; None: all


def _logit_rows(end: int, entry: ScheduledSeq) -> range:
    return range(end - entry.num_logits, end)


def sample_rows_of(batch: list[ScheduledSeq]) -> np.ndarray | None:
    """The flat rows whose hidden states become logits: the last row of each sampling entry,
    the last 1 + k rows of a speculating one; None where every entry is one sampling row."""
    query_lens = [s.num_new_tokens for s in batch]
    if all(s.samples for s in batch) and sum(query_lens) == len(batch):
        return None
    ends = np.cumsum(query_lens)
    rows = [row for end, s in zip(ends.tolist(), batch, strict=True) for row in _logit_rows(end, s)]
    picked: np.ndarray = np.asarray(rows, dtype=np.int64)
    return picked


def prepare_inputs(batch: list[ScheduledSeq], block_size: int, to_device: ToDevice) -> StepInputs:
    """Flatten a step's sequences into model inputs and attention metadata (no mutation)."""
    query_lens = [s.num_new_tokens for s in batch]
    starts = [s.seq.num_computed_tokens for s in batch]
    seq_lens = [start + n for start, n in zip(starts, query_lens, strict=True)]
    token_ids: list[int] = []
    for s in batch:
        token_ids.extend(s.input_token_ids())
    if len(token_ids) != sum(query_lens):
        raise ValueError("a scheduled sequence asks for tokens it does not have")

    num_seqs = len(batch)
    query_lens_np = np.asarray(query_lens, dtype=np.int64)
    cu_query = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens_np, out=cu_query[1:])
    seq_index = np.repeat(np.arange(num_seqs), query_lens_np)
    positions = np.arange(cu_query[-1]) - cu_query[seq_index] + np.asarray(starts)[seq_index]

    blocks_needed = [-(-n // block_size) for n in seq_lens]
    block_tables = np.zeros((num_seqs, max(blocks_needed)), dtype=np.int32)
    for i, (s, needed) in enumerate(zip(batch, blocks_needed, strict=True)):
        table = s.seq.block_table
        if len(table) < needed:
            raise ValueError(
                f"sequence {s.seq.seq_id} needs {needed} KV blocks for {seq_lens[i]} tokens "
                f"but its block table has {len(table)}"
            )
        # FREED entries (before every layer's window: never read) point at block 0.
        block_tables[i, :needed] = np.maximum(table[:needed], 0)
    slots = (
        block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )

    rows = sample_rows_of(batch)
    sample_rows = None if rows is None else to_device(rows)

    meta = AttentionMetadata(
        slot_mapping=to_device(slots),
        query_start_loc=to_device(cu_query.astype(np.int32)),
        seq_lens=to_device(np.asarray(seq_lens, dtype=np.int32)),
        block_tables=to_device(block_tables),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return StepInputs(
        input_ids=to_device(np.asarray(token_ids, dtype=np.int64)),
        positions=to_device(positions),
        attn_meta=meta,
        sample_rows=sample_rows,
    )
