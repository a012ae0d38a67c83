"""Each step's batch, from the driver rank to the executor ranks: two broadcasts per step.

A fixed header of int64 (what kind of message, and the sizes of the batch) and then, for a
step, one flat int64 payload holding input ids, positions, slot mapping, query start offsets,
sequence lengths, block tables, the rows to sample, the copy-on-write block copies, and where
LoRA adapters serve: each sequence's adapter id and the adapters the executors must load first
(their requests as JSON bytes, one int64 per byte: rare and small). Both go
over the control group (gloo, host memory), so a step costs no pickling and no device sync on
the executors' side beyond the copies to their device.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.distributed.group import TensorParallel

# kind, tokens, seqs, max blocks per seq, sample rows (-1: all), block copies, whether each
# sequence's LoRA id follows, bytes of new adapters
_HEADER_LEN = 8


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
    lora_ids: torch.Tensor | None = None  # [B] int64, 0 for none; None: no adapter this step
    new_adapters: bytes = b""  # adapters to load before the step (engine.lora.manager)

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
                int(message.lora_ids is not None),
                len(message.new_adapters),
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
        if message.lora_ids is not None:
            payload = torch.cat([payload, _host_int64(message.lora_ids)])
        if message.new_adapters:
            adapters = torch.tensor(list(message.new_adapters), dtype=torch.int64)
            payload = torch.cat([payload, adapters])
        if payload.numel():
            self._broadcast(payload)

    def shutdown(self) -> None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = MessageKind.SHUTDOWN
        self._broadcast(header)
        # Every rank past its last collective before any tears its group down: a rank that
        # exits while a peer still talks to it can abort that peer in gloo's teardown.
        dist.barrier(group=self.tp.control)

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
        kind, num_tokens, num_seqs, max_blocks, num_sampled, num_copies, has_lora, adapter_bytes = (
            header.tolist()
        )
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
            num_seqs if has_lora else 0,
            adapter_bytes,
        ]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.tp.control)
        ids, positions, slots, starts, seq_lens, tables, rows, copies, lora_ids, adapters = (
            payload.split(sizes)
        )
        return StepMessage(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            query_start_loc=starts.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
            sample_rows=None if num_sampled < 0 else rows,
            block_copies=[tuple(pair) for pair in copies.view(-1, 2).tolist()],  # type: ignore[misc]
            lora_ids=lora_ids if has_lora else None,
            new_adapters=bytes(adapters.tolist()),
        )
