"""Where a PEFT adapter's per-projection LoRA weights go in the engine's fused layers.

PEFT names a decoder layer's projections as the HF checkpoint does (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj); the engine fuses [q; k; v] into one qkv layer and
[gate; up] into one gate_up layer. A target is one base layer and, in a fused layer, the shard
an HF projection fills (a checkpoint that is fused already, as Phi-3's, names the fused layer).
Outside the decoder layers PEFT may adapt `lm_head` (a plain linear target) and `embed_tokens`
(an embedding target: its A is looked up by token id).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear
from engine.models.interface import CausalLM

# HF projection name -> (the engine layer in ProjectionLayout, the shard; None: the whole layer)
_PROJECTIONS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "qkv_proj": ("qkv", None),
    "o_proj": ("o", None),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "gate_up_proj": ("gate_up", None),
    "down_proj": ("down", None),
}
SUPPORTED_TARGETS = tuple(_PROJECTIONS)
LM_HEAD = "lm_head"
EMBED_TOKENS = "embed_tokens"


@dataclass(frozen=True)
class Target:
    """One HF projection of one decoder layer: the rows [start, stop) of `layer`'s output,
    computed from the `part`-th block of rank columns of the layer's slots (one per shard)."""

    layer: Linear
    part: int
    start: int
    stop: int

    @property
    def in_features(self) -> int:
        return int(self.layer.in_features)

    @property
    def out_features(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EmbeddingTarget:
    """The token embedding: lora_embedding_A is [rank, vocab_size], lora_embedding_B
    [embedding_dim, rank]."""

    layer: VocabEmbedding
    vocab_size: int
    embedding_dim: int


def lm_head_target(model: CausalLM) -> Target:
    head = model.lm_head
    return Target(head, 0, 0, int(head.out_features))


def embedding_target(model: CausalLM) -> EmbeddingTarget | None:
    """None where the model has no plain embedding table to adapt."""
    embedding = model.input_embedding()
    if embedding is None:
        return None
    return EmbeddingTarget(embedding, model.vocab_size, model.hidden_size)


def find_target(model: CausalLM, layer_index: int, projection: str) -> Target | None:
    """The target of HF `projection` in decoder layer `layer_index`; None where the model has
    no such dense layer (a mixture-of-experts MLP, an unknown name, a layer out of range)."""
    where = _PROJECTIONS.get(projection)
    if where is None or not 0 <= layer_index < len(model.decoder_layers):
        return None
    layout = model.projections(layer_index)
    base = {"qkv": layout.qkv, "o": layout.o, "gate_up": layout.gate_up, "down": layout.down}[
        where[0]
    ]
    if base is None:
        return None
    shard = where[1]
    if shard is None:
        return Target(base, 0, 0, base.out_features)
    if not isinstance(base, MergedLinear) or shard >= len(base.shard_sizes):
        return None
    start = base.shard_offset(shard)
    return Target(base, shard, start, start + base.shard_sizes[shard])


def adaptable_layers(model: CausalLM) -> list[Linear]:
    """Every dense projection of every decoder layer, each once: the layers that get slots."""
    layers: dict[int, Linear] = {}
    for index in range(len(model.decoder_layers)):
        for linear in model.projections(index):
            layers[id(linear)] = linear
    return list(layers.values())


def num_parts(layer: Linear) -> int:
    """Blocks of rank columns a layer's slots hold: one per shard of a fused layer."""
    return len(layer.shard_sizes) if isinstance(layer, MergedLinear) else 1
