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
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from engine.layers.rotary import IdentityRotary, PartialRotary, RotaryEmbedding
from engine.models.blocks import GatedMLP, LlamaAttention, LlamaMLP, LlamaShape, MlpFactory
from engine.models.interface import (
    AttentionSpec,
    CausalLM,
    KVCaches,
    ProjectionLayout,
    WeightMapping,
)
from engine.models.split import Cut, SplitForward
from engine.models.variant import BlockVariant, QKNorm, read_decoder_config
from engine.platforms.cpu.decode_stack import CpuDecodeStack, DecoderLayerParts

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


class VariantAttention(LlamaAttention):
    """Llama's attention with QK-norm and partial rotary applied to the fused projection before
    the backend rotates (by `rotary_emb`: the identity where this layer turned q and k itself,
    or has no position embedding) and attends."""

    def __init__(
        self,
        shape: LlamaShape,
        variant: BlockVariant,
        rotary_emb: RotaryEmbedding,
        partial: PartialRotary | None,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(shape, rotary_emb, backend, tp)
        if variant.attention_scale is not None:
            self.scale = variant.attention_scale
        self.softcap = variant.attention_softcap
        if variant.attention_sinks:
            if tp is not None:
                raise NotImplementedError("attention sinks (gpt-oss) are not tensor-parallel yet")
            self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.qk_norm = variant.qk_norm
        eps = shape.rms_norm_eps
        if variant.qk_norm is QKNorm.PER_HEAD:
            self.q_norm = variant.norm(self.head_dim, eps)
            self.k_norm = variant.norm(self.head_dim, eps)
        elif variant.qk_norm is QKNorm.WHOLE:
            if tp is not None:
                raise NotImplementedError(
                    "QK-norm over the whole projection (OLMo 2) is not tensor-parallel: each "
                    "rank holds only some heads of the normalized rows"
                )
            self.q_norm = variant.norm(self.q_size, eps)
            self.k_norm = variant.norm(self.kv_size, eps)
        self.partial = partial

    def project_qkv(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.qk_norm is QKNorm.NONE and self.partial is None:
            return qkv
        if self.qk_norm is not QKNorm.NONE:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            rows = (-1, self.head_dim) if self.qk_norm is QKNorm.PER_HEAD else q.shape
            q = self.q_norm(q.reshape(rows)).reshape(q.shape)
            rows = (-1, self.head_dim) if self.qk_norm is QKNorm.PER_HEAD else k.shape
            k = self.k_norm(k.reshape(rows)).reshape(k.shape)
            qkv = torch.cat((q, k, v), dim=-1)
        if self.partial is not None:
            self.partial.rotate_in_place(positions, qkv[:, : self.q_size + self.kv_size])
        return qkv


class VariantDecoderLayer(nn.Module):
    """Norm names as in the checkpoints: pre-norm only (Llama) input_layernorm before attention
    and post_attention_layernorm before the MLP; post-norm only (OLMo 2) post_attention_layernorm
    and post_feedforward_layernorm after them; both (Gemma's sandwich) all four, the MLP's input
    norm then being pre_feedforward_layernorm."""

    def __init__(
        self,
        shape: LlamaShape,
        variant: BlockVariant,
        rotary_emb: RotaryEmbedding,
        partial: PartialRotary | None,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden_size, eps = shape.dims.hidden_size, shape.rms_norm_eps
        self.post_norms = variant.post_norms
        self.residual_multiplier = variant.residual_multiplier
        self.input_layernorm = variant.norm(hidden_size, eps) if variant.pre_norms else None
        self.self_attn = VariantAttention(shape, variant, rotary_emb, partial, backend, tp)
        self.post_attention_layernorm = variant.norm(hidden_size, eps)
        sandwich = variant.pre_norms and variant.post_norms
        self.pre_feedforward_layernorm = variant.norm(hidden_size, eps) if sandwich else None
        if variant.post_norms:
            self.post_feedforward_layernorm = variant.norm(hidden_size, eps)
        self.mlp = (
            mlp
            if mlp is not None
            else GatedMLP(
                hidden_size, shape.intermediate_size, shape.mlp_bias, variant.activation, tp
            )
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's last addition to the residual stream, the stream before it), for every
        token or only `output_rows`; the next norm adds the two."""
        normed, carry = self.before_attention(hidden, residual)
        attended = self.self_attn(positions, normed, kv_cache, meta, cos_sin, output_rows)
        return self.after_attention(attended, carry, output_rows)

    def before_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual stream `after_attention` adds to)."""
        if self.post_norms:
            stream = hidden if residual is None else hidden + residual
            normed = stream if self.input_layernorm is None else self.input_layernorm(stream)
            return normed, stream
        assert self.input_layernorm is not None
        if residual is None:
            return self.input_layernorm(hidden), hidden
        hidden, residual = self.input_layernorm(hidden, residual)
        return hidden, residual

    def after_attention(
        self, attended: torch.Tensor, carry: torch.Tensor, output_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer from the attention's output after o_proj (see forward)."""
        if output_rows is not None:
            carry = carry.index_select(0, output_rows)
        if self.post_norms:
            stream = carry + self.post_attention_layernorm(attended)
            pre_mlp = self.pre_feedforward_layernorm
            mixed = self.mlp(stream if pre_mlp is None else pre_mlp(stream))
            return self.post_feedforward_layernorm(mixed), stream
        hidden = attended
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, carry)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


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


def layer_projections(layer: VariantDecoderLayer) -> ProjectionLayout:
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):  # a mixture of experts: no dense projections
        return ProjectionLayout(attention.qkv_proj, attention.o_proj, None, None)
    return ProjectionLayout(attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)


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
