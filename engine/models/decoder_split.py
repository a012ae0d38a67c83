"""The configurable decoder's forward cut at each layer's attention, for piecewise CUDA
graphs (engine.models.split)."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.models.decoder_layers import VariantDecoderLayer
from engine.models.decoder_stack import VariantModel
from engine.models.interface import KVCaches
from engine.models.split import Cut


class VariantSplitForward:
    """VariantModel's forward cut at each layer's attention (engine.models.split)."""

    def __init__(self, model: VariantModel) -> None:
        self.model = model
        self.layers: list[VariantDecoderLayer] = list(model.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Cut:
        return self._prepare(0, self.model.embed(input_ids), None, positions)

    def piece(
        self, layer: int, attended: torch.Tensor, carry: torch.Tensor, positions: torch.Tensor
    ) -> Cut:
        hidden, residual = self._finish(layer - 1, attended, carry)
        return self._prepare(layer, hidden, residual, positions)

    def last_piece(self, attended: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        hidden, residual = self._finish(len(self.layers) - 1, attended, carry)
        return self.model.norm(hidden, residual)[0]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.layers[layer].self_attn.attend(q, k, v, kv_caches[layer], meta)

    def _prepare(
        self,
        layer: int,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> Cut:
        block = self.layers[layer]
        normed, carry = block.before_attention(hidden, residual)
        q, k, v = block.self_attn.rotated_qkv(positions, normed, None)
        return Cut(q, k, v, carry)

    def _finish(
        self, layer: int, attended: torch.Tensor, carry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.layers[layer]
        return block.after_attention(block.self_attn.output(attended), carry)
