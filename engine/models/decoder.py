"""The configurable decoder: Llama's blocks with the variations the families make.

A family (engine.models.llama, qwen3, olmo2, granite, smollm3, phi3, gemma2, gemma3, gpt_oss,
the MoE ones) is this decoder with a `BlockVariant` read from its HF config: QK-norm (per head
or over the whole projection), norms after each sublayer (instead of, or besides, before it),
Gemma's (1 + weight) norms, scaled embeddings, Granite's multipliers, soft-capped attention
scores and logits, attention sinks, layers without rotary, partial rotary, sliding layers with
their own rope base, another gated activation; and with each layer's MLP where it is not the
gated one (`layer_mlps`: mixtures of experts). Everything else (head_dim, biases, rope scaling,
tied embeddings, per-layer windows) is read as for Llama, so an unlisted family of the same
pattern loads by registering its architecture with a variant; a config field that changes the
math and is not implemented is refused (engine.models.config_checks).

Layers whose block is Llama's exactly (pre-norm, no QK-norm, residual multiplier 1, every layer
rotated by the one full-head table, SiLU, no soft-cap or sinks) run CPU decode steps through
the C++ decode stack; the others keep the Python forward, which computes every variation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.parallel import ParallelLMHead
from engine.models.blocks import LlamaShape, MlpFactory
from engine.models.decoder_layers import layer_projections
from engine.models.decoder_split import VariantSplitForward
from engine.models.decoder_stack import VariantModel
from engine.models.interface import (
    AttentionSpec,
    CausalLM,
    KVCaches,
    ProjectionLayout,
    WeightMapping,
)
from engine.models.split import SplitForward
from engine.models.variant import BlockVariant, QKNorm, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Checkpoints with separate q/k/v and gate/up projections, fused on load.
LLAMA_WEIGHTS = WeightMapping(
    packed={
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    ignored_suffixes=("rotary_emb.inv_freq",),  # old checkpoints store the rope table
)


__all__ = ["BlockVariant", "QKNorm", "VariantForCausalLM", "read_decoder_config"]


class VariantForCausalLM(CausalLM):
    """A family: `read_variant` says how its config maps to the decoder's variations;
    `handled_fields` are the math-changing config fields it implements; `layer_mlps` gives
    layers another MLP (the mixture-of-experts families)."""

    weight_mapping = LLAMA_WEIGHTS
    handled_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: this rank's place in a tensor-parallel group; None: the whole model here."""
        shape, variant = self.read_variant(hf_config)
        super().__init__(shape.dims)
        self.variant = variant
        mlps = self.layer_mlps(hf_config, shape, tp)
        self.model = VariantModel(shape, variant, backend, tp, mlps)
        self.lm_head = (
            Linear(shape.dims.hidden_size, shape.dims.vocab_size, bias=False)
            if tp is None
            else ParallelLMHead(shape.dims.hidden_size, shape.dims.vocab_size, tp)
        )
        self.tie_weights()

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        return read_decoder_config(hf_config, cls.handled_fields)

    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> LlamaShape:
        return cls.read_variant(hf_config)[0]

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory | None:
        """Each layer's MLP where the family's differ from the gated MLP (None: that in all)."""
        return None

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def attention_spec(self, layer: int) -> AttentionSpec:
        return self.model.layers[layer].self_attn.spec

    def projections(self, layer: int) -> ProjectionLayout:
        return layer_projections(self.model.layers[layer])

    def input_embedding(self) -> VocabEmbedding:
        return self.model.embed_tokens

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_meta: AttentionMetadata,
        sample_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_meta, sample_rows)

    def split_forward(self) -> SplitForward | None:
        return VariantSplitForward(self.model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.variant.logits_divisor != 1.0:
            logits = logits / self.variant.logits_divisor
        cap = self.variant.logits_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
