"""The token embedding: a plain table, or a quantized one read row by row (a GGUF's Q8_0)."""

from __future__ import annotations

import torch
from torch import nn

from engine.lora.embedding import EmbeddingLoRASlots
from engine.quantization.matmul import quantized_embedding
from engine.quantization.weights import QuantizedWeight


class VocabEmbedding(nn.Embedding):
    quantized: QuantizedWeight | None = None
    # Resident LoRA adapters' terms (engine.lora), added by the model (also past the all-reduce
    # of a vocabulary-parallel table, and before an embedding multiplier).
    lora: EmbeddingLoRASlots | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(ids)
        return quantized_embedding(ids, self.quantized).to(self.weight.dtype)

    def use_quantized(self, weight: QuantizedWeight) -> None:
        """Look rows up in `weight` from now on; the plain table is freed."""
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized table {weight.shape} for a {self.weight.shape} embedding")
        self.quantized = weight.to(self.weight.device)
        self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)
