"""Phi-3 / Phi-3.5 / Phi-4 (and Phi-4-mini): the Llama blocks, stored fused.

Checkpoints hold qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up] rows) already fused,
which is the layout of the engine's own fused parameters: they load as they are (a
tensor-parallel rank reads its rows of each part, engine.models.loader). Partial rotary
(partial_rotary_factor, Phi-4-mini) and LongRoPE scaling (short / long factors,
engine.layers.rotary) are read from the config like any family's.

Some Phi-3 configs set a sliding_window shorter than the context (Phi-3-mini-4k: 2047 of
4096); its layers report sliding attention and the runner caps the context at the window until
the attention backends compute windows themselves.
"""

from __future__ import annotations

from engine.models.decoder import VariantForCausalLM
from engine.models.interface import WeightMapping


class Phi3ForCausalLM(VariantForCausalLM):
    weight_mapping = WeightMapping(
        packed={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        },
        ignored_suffixes=("rotary_emb.inv_freq",),
    )
