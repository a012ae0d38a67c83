"""How a family's decoder layers differ from Llama's (`BlockVariant`), and the generic part of
reading it from an HF config; engine.models.decoder computes the variations."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from engine.layers.norm import OffsetRMSNorm, RMSNorm
from engine.layers.rotary import partial_rotary_factor
from engine.models.blocks import LlamaShape, read_llama_config
from engine.models.config_checks import ACTIVATIONS, hidden_activation, refuse_unsupported

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class QKNorm(enum.Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # RMSNorm over each head's head_dim (Qwen3, Gemma 3)
    WHOLE = "whole"  # RMSNorm over the whole q / k projection (OLMo 2)


@dataclass(frozen=True)
class BlockVariant:
    """How a family's decoder layers differ from Llama's."""

    qk_norm: QKNorm = QKNorm.NONE
    pre_norms: bool = True  # norm each sublayer's input (OLMo 2 does not)
    post_norms: bool = False  # norm each sublayer's output before the residual add
    offset_norms: bool = False  # Gemma: every RMSNorm scales by (1 + weight), in float32
    activation: str = "silu"
    embedding_multiplier: float = 1.0
    # Gemma rounds the multiplier to the activations' dtype before scaling.
    embedding_multiplier_in_dtype: bool = False
    residual_multiplier: float = 1.0  # scales each sublayer's output before the residual add
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None  # scores s -> cap * tanh(s / cap) (Gemma 2)
    attention_sinks: bool = False  # a learned sink logit per head in the softmax (gpt-oss)
    logits_divisor: float = 1.0
    logits_softcap: float | None = None  # final logits soft-capped likewise (Gemma 2/3)
    rope_layers: tuple[bool, ...] | None = None  # per layer: rotary applies; None: every layer
    rotary_dim: int | None = None  # partial rotary: features turned per head; None: all
    # Sliding-window layers' own (rope theta, scaling) (Gemma 3); None: the shape's.
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def llama_block(self) -> bool:
        """Whether every layer computes what the C++ decode stack does."""
        return (
            self.qk_norm is QKNorm.NONE
            and self.pre_norms
            and not self.post_norms
            and not self.offset_norms
            and self.activation in ("silu", "swish")
            and self.residual_multiplier == 1.0
            and self.attention_softcap is None
            and not self.attention_sinks
            and self.rope_layers is None
            and self.rotary_dim is None
            and self.sliding_rope is None
        )

    def norm(self, size: int, eps: float) -> nn.Module:
        return OffsetRMSNorm(size, eps) if self.offset_norms else RMSNorm(size, eps)


def read_decoder_config(
    hf_config: PretrainedConfig, handled: frozenset[str] = frozenset()
) -> tuple[LlamaShape, BlockVariant]:
    """The shape and the generic part of the variant (activation, partial rotary); a family
    adds what its own fields mean."""
    refuse_unsupported(hf_config, handled, ACTIVATIONS)
    shape = read_llama_config(hf_config, allow_partial_rotary=True)
    head_dim = shape.attention.head_dim
    rotary_dim = int(head_dim * partial_rotary_factor(hf_config))
    variant = BlockVariant(
        activation=hidden_activation(hf_config),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
    )
    return shape, variant
