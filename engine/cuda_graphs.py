"""Decode-only steps replayed from captured CUDA graphs.

A decode step of a small model is dominated by kernel-launch overhead (hundreds of launches of
microsecond kernels), which a graph replays in one call. Graphs are captured once per padded
batch size (1, 2, 4, 8, then every 16 up to max_num_seqs) over static input buffers; a step
copies its inputs into the first rows of those buffers, pads the rest with inert rows (slot -1,
so nothing is written to the cache; context length 1, so attention reads one valid slot), replays
the graph of the next captured size and returns the first rows of its output. Steps with
prefills replay piecewise graphs instead (engine.piecewise_graphs).

The kernels read every length from device memory and the attention launch uses a fixed split
count, so one capture serves every context length up to max_model_len.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from engine.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

_Out = TypeVar("_Out")

StepFn = Callable[[], torch.Tensor]
# Turns a step function into (replay, output): replay() recomputes `output` in place from the
# current contents of the static buffers.
Capture = Callable[[StepFn], tuple[Callable[[], None], torch.Tensor]]
ModelFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: small powers of two, then steps of 16, max_num_seqs last."""
    sizes = [n for n in (1, 2, 4, 8) if n < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


class Recorder(Protocol):
    """Records a step: returns replay, which recomputes the step's outputs in place from the
    current contents of the tensors it read, and those outputs."""

    def __call__(self, step: Callable[[], _Out]) -> tuple[Callable[[], None], _Out]: ...


def cuda_graph_capture(pool: object | None = None) -> Recorder:
    """The real capture: warm up on a side stream (Triton compiles there), then record."""

    def capture(step: Callable[[], _Out]) -> tuple[Callable[[], None], _Out]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = step()
        return graph.replay, output

    return capture


@dataclass
class _Captured:
    replay: Callable[[], None]
    output: torch.Tensor  # [batch_size, hidden]


class DecodeGraphs:
    """Static buffers plus one captured decode step per padded batch size."""

    def __init__(
        self,
        model_fn: ModelFn,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model_fn = model_fn
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        max_bs = self.sizes[-1]

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_bs, dtype=torch.int64)
        self.positions = zeros(max_bs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32)
        # One query token per sequence: cu_seqlens_q is 0, 1, 2, ... for every batch size.
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, _Captured] = {}

    def capture(self, capture: Capture) -> None:
        # Largest first, so smaller graphs reuse the memory pool the largest one reserved.
        for batch_size in reversed(self.sizes):
            replay, output = capture(self._step_fn(batch_size))
            self._graphs[batch_size] = _Captured(replay, output)
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def _step_fn(self, batch_size: int) -> StepFn:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            # The bound the graph must serve; the kernels read the real lengths on the device.
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[self.max_model_len] * batch_size,
        )
        input_ids = self.input_ids[:batch_size]
        positions = self.positions[:batch_size]

        return lambda: self.model_fn(input_ids, positions, meta)

    def fits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (
            bool(self._graphs)
            and meta.is_decode_only
            and meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
            and input_ids.shape[0] == meta.num_seqs
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [num_seqs, hidden] of a decode-only step (check `fits` first)."""
        num_seqs = meta.num_seqs
        batch_size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        width = meta.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens)
        self.block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if batch_size > num_seqs:  # padding rows: write nothing, read one slot of block 0
            self.input_ids[num_seqs:batch_size].zero_()
            self.positions[num_seqs:batch_size].zero_()
            self.slot_mapping[num_seqs:batch_size].fill_(-1)
            self.seq_lens[num_seqs:batch_size].fill_(1)
            self.block_tables[num_seqs:batch_size, 0].zero_()
        captured = self._graphs[batch_size]
        captured.replay()
        return captured.output[:num_seqs]

    @property
    def captured_sizes(self) -> Sequence[int]:
        return sorted(self._graphs)
