"""SmolLM3: the Llama blocks where some layers have no rotary position embedding (NoPE):
no_rope_layers[i] is 1 where layer i rotates q and k, 0 where it does not (by default every
no_rope_layer_interval-th layer has none)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from engine.models.blocks import LlamaShape
from engine.models.decoder import BlockVariant, VariantForCausalLM, read_decoder_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class SmolLM3ForCausalLM(VariantForCausalLM):
    handled_fields = frozenset({"no_rope_layers"})

    @classmethod
    def read_variant(cls, hf_config: PretrainedConfig) -> tuple[LlamaShape, BlockVariant]:
        shape, variant = read_decoder_config(hf_config, cls.handled_fields)
        flags = hf_config.no_rope_layers
        if flags is None:  # configs saved before transformers filled the list in
            interval = int(hf_config.no_rope_layer_interval)
            flags = [int((i + 1) % interval != 0) for i in range(shape.num_layers)]
        if len(flags) != shape.num_layers:
            raise ValueError(
                f"no_rope_layers has {len(flags)} entries for {shape.num_layers} layers"
            )
        rope_layers = tuple(bool(flag) for flag in flags)
        return shape, replace(variant, rope_layers=None if all(rope_layers) else rope_layers)
