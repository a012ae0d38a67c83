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

import torch

from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear
from engine.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSlice,
)
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
    """One HF projection of one decoder layer (or the lm_head): the rows [start, stop) of
    `layer`'s output, computed from the `part`-th block of rank columns of the layer's slots
    (one per shard). Under tensor parallelism a rank keeps `b_rows` of the adapter's lora_B
    (a column-parallel layer's output rows, concatenated) or `a_columns` of its lora_A (a
    row-parallel layer's input columns: the ranks' partial terms are summed by the layer's
    all-reduce)."""

    layer: Linear
    part: int
    start: int
    stop: int
    in_features: int  # of the whole projection, as the adapter holds it
    out_features: int
    b_rows: tuple[TensorSlice, ...] = ()  # (): all
    a_columns: TensorSlice | None = None  # None: all

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the adapter's a [rank, in] and b [out, rank]."""
        if self.a_columns is not None:
            a = a.narrow(1, self.a_columns.start, self.a_columns.length)
        if self.b_rows:
            b = torch.cat([b.narrow(0, rows.start, rows.length) for rows in self.b_rows])
        return a, b


@dataclass(frozen=True)
class EmbeddingTarget:
    """The token embedding: lora_embedding_A is [rank, vocab_size], lora_embedding_B
    [embedding_dim, rank]."""

    layer: VocabEmbedding
    vocab_size: int
    embedding_dim: int


def lm_head_target(model: CausalLM) -> Target:
    head = model.lm_head
    hidden = int(head.in_features)
    if isinstance(head, ParallelLMHead):  # this rank's vocabulary rows (the last padded)
        rows = head.rows
        return Target(head, 0, 0, rows.length, hidden, rows.full, b_rows=(rows,))
    return Target(head, 0, 0, int(head.out_features), hidden, int(head.out_features))


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
    shard, hidden, out = where[1], int(base.in_features), int(base.out_features)
    if isinstance(base, RowParallelLinear):
        return Target(base, 0, 0, out, base.columns.full, out, a_columns=base.columns)
    if shard is None:
        if isinstance(base, ColumnParallelLinear):  # a fused checkpoint projection, sharded
            firsts = [sum(p.full for p in base.parts[:i]) for i in range(len(base.parts))]
            total = sum(p.full for p in base.parts)
            rows = tuple(
                TensorSlice(0, first + p.start, p.length, total)
                for first, p in zip(firsts, base.parts, strict=True)
            )
            return Target(base, 0, 0, out, hidden, total, b_rows=rows)
        return Target(base, 0, 0, out, hidden, out)
    if not isinstance(base, MergedLinear) or shard >= len(base.shard_sizes):
        return None
    start = base.shard_offset(shard)
    stop = start + base.shard_sizes[shard]
    if isinstance(base, ColumnParallelLinear):
        part = base.parts[shard]
        return Target(base, shard, start, stop, hidden, part.full, b_rows=(part,))
    return Target(base, shard, start, stop, hidden, stop - start)


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
