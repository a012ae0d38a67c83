"""Each step's batch, from the driver rank to the executor ranks: two broadcasts per step.

A fixed header of int64 (what kind of message, and the sizes of the batch) and then, for a
step, one flat int64 payload holding input ids, positions, slot mapping, query start offsets,
sequence lengths, block tables, the rows to sample and the copy-on-write block copies. Both go
over the control group (gloo, host memory), so a step costs no pickling and no device sync on
the executors' side beyond the copies to their device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.distributed.group import TensorParallel

_HEADER_LEN = 6  # kind, tokens, seqs, max blocks per seq, sample rows (-1: all), block copies


class MessageKind(IntEnum):
    STEP = 1
    SHUTDOWN = 2


@dataclass
class StepMessage:
    """One step as the executors need it to run the same forward as the driver."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max blocks]
    sample_rows: torch.Tensor | None  # None: every row samples
    block_copies: list[tuple[int, int]]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def _host_int64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", torch.int64).reshape(-1)


class StepSender:
    """The driver's end."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, message: StepMessage) -> None:
        num_tokens = message.input_ids.shape[0]
        num_seqs = message.num_seqs
        max_blocks = message.block_tables.shape[1] if num_seqs else 0
        num_sampled = -1 if message.sample_rows is None else message.sample_rows.shape[0]
        header = torch.tensor(
            [
                MessageKind.STEP,
                num_tokens,
                num_seqs,
                max_blocks,
                num_sampled,
                len(message.block_copies),
            ],
            dtype=torch.int64,
        )
        self._broadcast(header)
        parts = [
            message.input_ids,
            message.positions,
            message.slot_mapping,
            message.query_start_loc,
            message.seq_lens,
            message.block_tables,
        ]
        if message.sample_rows is not None:
            parts.append(message.sample_rows)
        payload = torch.cat([_host_int64(part) for part in parts])
        if message.block_copies:
            copies = torch.tensor(message.block_copies, dtype=torch.int64).reshape(-1)
            payload = torch.cat([payload, copies])
        if payload.numel():
            self._broadcast(payload)

    def shutdown(self) -> None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = MessageKind.SHUTDOWN
        self._broadcast(header)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.tp.control)


class StepReceiver:
    """An executor's end."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def receive(self) -> StepMessage | None:
        """The next step; None when the driver shuts the replica down."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.tp.control)
        kind, num_tokens, num_seqs, max_blocks, num_sampled, num_copies = header.tolist()
        if kind == MessageKind.SHUTDOWN:
            return None
        sizes = [
            num_tokens,
            num_tokens,
            num_tokens,
            num_seqs + 1 if num_seqs else 0,
            num_seqs,
            num_seqs * max_blocks,
            max(num_sampled, 0),
            2 * num_copies,
        ]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.tp.control)
        ids, positions, slots, starts, seq_lens, tables, rows, copies = payload.split(sizes)
        return StepMessage(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=starts.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            sample_rows=None if num_sampled < 0 else rows,
            block_copies=[tuple(pair) for pair in copies.view(-1, 2).tolist()],  # type: ignore[misc]
        )
