"""Steps with prefills (mixed prefill + decode, speculative verification) replayed piecewise.

A full-step graph needs every sequence shape fixed at capture, which only decode-only steps
have (engine.cuda_graphs). Here the model's forward is cut at its attention calls
(engine.models.split): the pieces between two attentions work row by row, so each is captured
once per padded token count (16, 32, ... up to a cap) over static buffers, and attention runs
eagerly between the replays, on the step's real tokens and metadata. A step copies its tokens
into the first rows of the static inputs (padding rows: token 0 at position 0, whose results
nothing reads), replays piece 0, then for each layer runs its attention on the first rows of
the piece's outputs, copies the result into the static buffer the next piece reads, and replays
that piece; the first rows of the last piece's output are the step's hidden states.

Nothing here is CUDA-specific: the capture is a `Recorder` (engine.cuda_graphs), the real one
on CUDA, a stand-in that re-runs each piece on the static buffers in the CPU tests.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.cuda_graphs import Recorder
from engine.models.interface import KVCaches
from engine.models.split import Cut, SplitForward

logger = logging.getLogger(__name__)

Replay = Callable[[], None]


def token_sizes(max_tokens: int) -> list[int]:
    """Padded token counts to capture: powers of two from 16, max_tokens last (none if 0)."""
    if max_tokens <= 0:
        return []
    sizes = [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n < max_tokens]
    return [*sizes, max_tokens]


@dataclass
class _Stage:
    """Layer `layer`'s attention on the cut a replayed piece left, then the next piece."""

    cut: Cut
    attended: torch.Tensor  # [size, H, D]: the static input of `replay`
    replay: Replay


@dataclass
class _SizeGraphs:
    first: Replay
    stages: list[_Stage]
    hidden: torch.Tensor  # [size, hidden]: the last piece's output


class PiecewiseGraphs:
    """Static inputs plus the captured pieces of the forward, per padded token count."""

    def __init__(self, split: SplitForward, sizes: Sequence[int], device: torch.device) -> None:
        if not sizes:
            raise ValueError("piecewise graphs need at least one token count to capture")
        self.split = split
        self.sizes = sorted(sizes)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        # Attention outputs, one buffer per output shape shared by every layer and size: a
        # piece reads it before the next layer's attention overwrites it (stream order).
        self._attended: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._graphs: dict[int, _SizeGraphs] = {}

    @property
    def captured_sizes(self) -> Sequence[int]:
        return sorted(self._graphs)

    def capture(self, record: Recorder) -> None:
        # Largest first, so smaller sizes reuse the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture_size(size, record)
        logger.info(
            "captured piecewise graphs (%d pieces each) for token counts %s",
            self.split.num_layers + 1,
            self.sizes,
        )

    def _capture_size(self, size: int, record: Recorder) -> _SizeGraphs:
        split = self.split
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        first, outputs = record(lambda: split.first_piece(input_ids, positions).tensors())
        cut = Cut(*outputs)
        stages: list[_Stage] = []
        hidden = None
        for layer in range(split.num_layers):
            attended = self._attended_buffer(cut.q)[:size]
            if layer + 1 < split.num_layers:
                replay, outputs = record(_next_piece(split, layer + 1, attended, cut, positions))
                stages.append(_Stage(cut, attended, replay))
                cut = Cut(*outputs)
            else:
                replay, (hidden,) = record(_last_piece(split, attended, cut))
                stages.append(_Stage(cut, attended, replay))
        assert hidden is not None  # a model has at least one layer
        return _SizeGraphs(first, stages, hidden)

    def _attended_buffer(self, q: torch.Tensor) -> torch.Tensor:
        key = (tuple(q.shape[1:]), q.dtype)
        buffer = self._attended.get(key)
        if buffer is None:
            shape = (self.sizes[-1], *q.shape[1:])
            buffer = torch.zeros(shape, dtype=q.dtype, device=q.device)
            self._attended[key] = buffer
        return buffer

    def fits(self, input_ids: torch.Tensor) -> bool:
        return bool(self._graphs) and input_ids.shape[0] <= self.sizes[-1]

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of a step of T tokens (check `fits` first). The
        result is a view of a static buffer: read it before the next step runs."""
        num_tokens = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        if size > num_tokens:  # padding rows: computed and never read
            self.input_ids[num_tokens:size].zero_()
            self.positions[num_tokens:size].zero_()
        graphs = self._graphs[size]
        graphs.first()
        for layer, stage in enumerate(graphs.stages):
            cut = stage.cut
            out = self.split.attend(
                layer,
                cut.q[:num_tokens],
                cut.k[:num_tokens],
                cut.v[:num_tokens],
                kv_caches,
                meta,
            )
            stage.attended[:num_tokens].copy_(out.reshape(num_tokens, *stage.attended.shape[1:]))
            stage.replay()
        return graphs.hidden[:num_tokens]


def _next_piece(
    split: SplitForward, layer: int, attended: torch.Tensor, cut: Cut, positions: torch.Tensor
) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: split.piece(layer, attended, cut.carry, positions).tensors()


def _last_piece(
    split: SplitForward, attended: torch.Tensor, cut: Cut
) -> Callable[[], tuple[torch.Tensor]]:
    return lambda: (split.last_piece(attended, cut.carry),)
