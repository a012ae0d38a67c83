"""The configurable decoder's layer stack: the embedding, the rotary tables each layer turns
by, the layers and the final norm, with CPU decode steps through the C++ decode stack where
every layer is Llama's exactly (engine.models.decoder)."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.parallel import VocabParallelEmbedding
from engine.layers.rotary import IdentityRotary, PartialRotary, RotaryEmbedding
from engine.models.blocks import LlamaShape, MlpFactory
from engine.models.decoder_layers import VariantDecoderLayer, layer_projections
from engine.models.interface import KVCaches
from engine.models.variant import BlockVariant
from engine.platforms.cpu.decode_stack import CpuDecodeStack, DecoderLayerParts


class VariantModel(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        variant: BlockVariant,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        mlp_of: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        dims, head_dim = shape.dims, shape.attention.head_dim
        max_position = dims.max_position_embeddings
        self.variant = variant
        self.partial_rotary = (
            None
            if variant.rotary_dim is None
            else PartialRotary(
                head_dim, variant.rotary_dim, max_position, shape.rope_theta, shape.rope_scaling
            )
        )
        if self.partial_rotary is not None and variant.sliding_rope is not None:
            raise NotImplementedError("partial rotary with a sliding layers' rope of their own")
        # The table the backends rotate by: the real one unless q and k arrive turned already.
        self.rotary_emb = (
            RotaryEmbedding(head_dim, max_position, shape.rope_theta, shape.rope_scaling)
            if self.partial_rotary is None
            else IdentityRotary(head_dim, max_position)
        )
        self.sliding_rotary = (
            None
            if variant.sliding_rope is None
            else RotaryEmbedding(head_dim, max_position, *variant.sliding_rope)
        )
        num_layers = shape.num_layers
        needs_identity = self.partial_rotary is None and not all(
            variant.uses_rope(i) for i in range(num_layers)
        )
        self.identity_rotary = IdentityRotary(head_dim, max_position) if needs_identity else None
        self.embed_tokens = (
            VocabEmbedding(dims.vocab_size, dims.hidden_size)
            if tp is None
            else VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp)
        )
        layers = []
        for i in range(num_layers):
            layer_shape = shape.for_layer(i)
            rope = variant.uses_rope(i)
            partial = self.partial_rotary if rope else None
            mlp = None if mlp_of is None else mlp_of(i)
            table = self._table(rope, layer_shape.attention.window is not None)
            layers.append(
                VariantDecoderLayer(layer_shape, variant, table, partial, backend, tp, mlp)
            )
        self.layers = nn.ModuleList(layers)
        self.norm = variant.norm(dims.hidden_size, shape.rms_norm_eps)
        # Decode steps on the CPU run their layers in one C++ call (tensor-parallel ranks keep
        # the Python forward: their layers all-reduce between the ops; so do models with a
        # mixture-of-experts MLP, which the C++ stack does not compute).
        self.cpu_decode_stack = (
            self._cpu_decode_stack(backend, shape.rms_norm_eps)
            if tp is None
            and isinstance(backend, TorchAttentionBackend)
            and variant.llama_block()
            and all(layer_projections(layer).dense_mlp for layer in self.layers)
            else None
        )

    def _table(self, rope: bool, sliding: bool) -> RotaryEmbedding:
        if not rope and self.identity_rotary is not None:
            return self.identity_rotary
        if sliding and self.sliding_rotary is not None:
            return self.sliding_rotary
        return self.rotary_emb

    def _cpu_decode_stack(self, backend: TorchAttentionBackend, eps: float) -> CpuDecodeStack:
        parts = [
            DecoderLayerParts(
                layer.input_layernorm,
                layer.post_attention_layernorm,
                layer_projections(layer),
            )
            for layer in self.layers
        ]
        attention = self.layers[0].self_attn
        return CpuDecodeStack(
            parts,
            backend,
            self.rotary_emb,
            attention.num_heads,
            eps,
            attention.scale,
            [layer.self_attn.window or 0 for layer in self.layers],
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        lora = self.embed_tokens.lora
        if lora is not None:
            # Before any multiplier: PEFT scales an adapted embedding's term as the base's.
            hidden = lora.add_to(input_ids, hidden)
        multiplier = self.variant.embedding_multiplier
        if multiplier == 1.0:
            return hidden
        if self.variant.embedding_multiplier_in_dtype:
            return hidden * torch.tensor(multiplier, dtype=hidden.dtype)
        return hidden * multiplier

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every token, or only of `output_rows` (in their order)."""
        hidden = self.embed(input_ids)
        if self.cpu_decode_stack is not None:
            done = self.cpu_decode_stack.run(hidden, positions, kv_caches, meta)
            if done is not None:
                hidden, _ = self.norm(*done)
                return hidden if output_rows is None else hidden.index_select(0, output_rows)
        # On the CPU each table's cos/sin rows of this step are gathered once for all layers.
        lookups: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        residual = None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos_sin = None
            if not hidden.is_cuda:
                table = layer.self_attn.rotary_emb
                cos_sin = lookups.get(id(table))
                if cos_sin is None:
                    cos_sin = lookups[id(table)] = table.lookup(positions, hidden.dtype)
            # Past the last layer's attention only the wanted rows matter: the rest of a prompt
            # needs its K/V stored, not its hidden states, so o_proj and the MLP skip them.
            rows = output_rows if index == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, cos_sin, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden
