"""A decoder forward cut at its attention calls, for piecewise CUDA graphs.

Everything between two attention calls works row by row (norms, projections, the MLP), so it
can be captured once per padded token count and replayed for any batch of that many tokens.
Attention is what depends on the step's sequences (their lengths, cache blocks, causal
structure); it runs eagerly between the pieces, on the real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.base import AttentionMetadata
from engine.models.interface import KVCaches


@dataclass
class Cut:
    """What a piece hands on: the next layer's attention inputs (q [T, H, D], k and v
    [T, Hkv, D], rotated) and the residual stream the piece after the attention adds to."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    carry: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v, self.carry


class SplitForward(Protocol):
    """A model's forward as pieces around its attention layers: piece 0 embeds and prepares
    layer 0's attention; piece i finishes layer i-1 with its attention output and prepares
    layer i's; the last piece finishes the last layer and applies the final norm."""

    @property
    def num_layers(self) -> int: ...

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Cut: ...

    def piece(
        self, layer: int, attended: torch.Tensor, carry: torch.Tensor, positions: torch.Tensor
    ) -> Cut:
        """Finish layer - 1 with its attention output `attended` [T, H, D], prepare layer's."""
        ...

    def last_piece(self, attended: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        """The final hidden states [T, hidden]."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Layer's attention (storing k and v in its cache): [T, H, D]."""
        ...
