"""The configurable decoder: Llama's blocks with the variations dense families make.

A family (engine.models.qwen3, olmo2, granite, smollm3, phi3) is this decoder with a
`BlockVariant` read from its HF config: QK-norm (per head or over the whole projection), norms
after attention and MLP instead of before, Granite's multipliers, layers without rotary, partial
rotary, another gated activation. Everything else (head_dim, biases, rope scaling, tied
embeddings, windows) is read as for Llama, so an unlisted family of the same pattern loads by
registering its architecture with a variant; a config field that changes the math and is not
implemented is refused (engine.models.config_checks).

Layers whose block is Llama's exactly (pre-norm, no QK-norm, residual multiplier 1, every layer
rotated by the one full-head table, SiLU) run CPU decode steps through the C++ decode stack;
the others keep the Python forward, which computes every variation.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from engine.layers.rotary import (
    IdentityRotary,
    PartialRotary,
    RotaryEmbedding,
    partial_rotary_factor,
)
from engine.models.config_checks import ACTIVATIONS, hidden_activation, refuse_unsupported
from engine.models.interface import (
    AttentionKind,
    AttentionSpec,
    CausalLM,
    KVCaches,
    ProjectionLayout,
)
from engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaShape,
    MlpFactory,
    read_llama_config,
)
from engine.platforms.cpu.decode_stack import CpuDecodeStack, DecoderLayerParts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class QKNorm(enum.Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # RMSNorm over each head's head_dim (Qwen3)
    WHOLE = "whole"  # RMSNorm over the whole q / k projection (OLMo 2)


@dataclass(frozen=True)
class BlockVariant:
    """How a family's decoder layers differ from Llama's."""

    qk_norm: QKNorm = QKNorm.NONE
    post_norms: bool = False  # OLMo 2: norm each sublayer's output, not its input
    activation: str = "silu"
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # scales each sublayer's output before the residual add
    attention_scale: float | None = None  # None: head_dim ** -0.5
    logits_divisor: float = 1.0
    rope_layers: tuple[bool, ...] | None = None  # per layer: rotary applies; None: every layer
    rotary_dim: int | None = None  # partial rotary: features turned per head; None: all
    layer_attention: tuple[AttentionSpec, ...] | None = None  # per layer; None: the shape's

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def llama_block(self) -> bool:
        """Whether every layer computes what the C++ decode stack does."""
        return (
            self.qk_norm is QKNorm.NONE
            and not self.post_norms
            and self.activation in ("silu", "swish")
            and self.residual_multiplier == 1.0
            and self.rope_layers is None
            and self.rotary_dim is None
        )


def layer_attention_specs(
    hf_config: PretrainedConfig, shape: LlamaShape
) -> tuple[AttentionSpec, ...] | None:
    """Per-layer attention from `layer_types` where the config lists them and has a window."""
    kinds = getattr(hf_config, "layer_types", None)
    window = shape.attention.window or getattr(hf_config, "sliding_window", None)
    if not kinds or not window:
        return None
    full = replace(shape.attention, kind=AttentionKind.FULL, window=None)
    sliding = replace(shape.attention, kind=AttentionKind.SLIDING, window=int(window))
    return tuple(sliding if kind == "sliding_attention" else full for kind in kinds)


def read_decoder_config(
    hf_config: PretrainedConfig, handled: frozenset[str] = frozenset()
) -> tuple[LlamaShape, BlockVariant]:
    """The shape and the generic part of the variant (activation, partial rotary, per-layer
    windows); a family adds what its own fields mean."""
    refuse_unsupported(hf_config, handled, ACTIVATIONS)
    shape = read_llama_config(hf_config, allow_partial_rotary=True)
    head_dim = shape.attention.head_dim
    rotary_dim = int(head_dim * partial_rotary_factor(hf_config))
    variant = BlockVariant(
        activation=hidden_activation(hf_config),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        layer_attention=layer_attention_specs(hf_config, shape),
    )
    if variant.layer_attention is not None:
        shape = replace(
            shape, attention=replace(shape.attention, kind=AttentionKind.FULL, window=None)
        )
    return shape, variant


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(LlamaMLP):
    """down(act(gate) * up); SiLU through the fused [gate; up] kernels, others in torch."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: str,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, bias, tp)
        self.act = _ACTIVATIONS.get(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return super().forward(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


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
        self.qk_norm = variant.qk_norm
        eps = shape.rms_norm_eps
        if variant.qk_norm is QKNorm.PER_HEAD:
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        elif variant.qk_norm is QKNorm.WHOLE:
            if tp is not None:
                raise NotImplementedError(
                    "QK-norm over the whole projection (OLMo 2) is not tensor-parallel: each "
                    "rank holds only some heads of the normalized rows"
                )
            self.q_norm = RMSNorm(self.q_size, eps)
            self.k_norm = RMSNorm(self.kv_size, eps)
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
        if not variant.post_norms:
            self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = VariantAttention(shape, variant, rotary_emb, partial, backend, tp)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        if variant.post_norms:
            self.post_feedforward_layernorm = RMSNorm(hidden_size, eps)
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
        if self.post_norms:
            stream = hidden if residual is None else hidden + residual
            attended = self.self_attn(positions, stream, kv_cache, meta, cos_sin, output_rows)
            if output_rows is not None:
                stream = stream.index_select(0, output_rows)
            stream = stream + self.post_attention_layernorm(attended)
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
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
        self.embedding_multiplier = variant.embedding_multiplier
        self.partial_rotary = (
            None
            if variant.rotary_dim is None
            else PartialRotary(
                head_dim, variant.rotary_dim, max_position, shape.rope_theta, shape.rope_scaling
            )
        )
        # The table the backends rotate by: the real one unless q and k arrive turned already.
        self.rotary_emb = (
            RotaryEmbedding(head_dim, max_position, shape.rope_theta, shape.rope_scaling)
            if self.partial_rotary is None
            else IdentityRotary(head_dim, max_position)
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
            rope = variant.uses_rope(i)
            table = (
                self.rotary_emb if rope or self.identity_rotary is None else self.identity_rotary
            )
            layer_shape = (
                shape
                if variant.layer_attention is None
                else replace(shape, attention=variant.layer_attention[i])
            )
            partial = self.partial_rotary if rope else None
            mlp = None if mlp_of is None else mlp_of(i)
            layers.append(
                VariantDecoderLayer(layer_shape, variant, table, partial, backend, tp, mlp)
            )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(dims.hidden_size, shape.rms_norm_eps)
        self.cpu_decode_stack = (
            self._cpu_decode_stack(backend, shape.rms_norm_eps)
            if tp is None
            and isinstance(backend, TorchAttentionBackend)
            and variant.llama_block()
            and all(layer_projections(layer).dense_mlp for layer in self.layers)
            else None
        )

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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
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
            rows = output_rows if index == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, cos_sin, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def layer_projections(layer: VariantDecoderLayer) -> ProjectionLayout:
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):  # a mixture of experts: no dense projections
        return ProjectionLayout(attention.qkv_proj, attention.o_proj, None, None)
    return ProjectionLayout(attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)


class VariantForCausalLM(LlamaForCausalLM):
    """A family: `read_variant` says how its config maps to the decoder's variations;
    `handled_fields` are the math-changing config fields it implements."""

    handled_fields: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        shape, variant = self.read_variant(hf_config)
        CausalLM.__init__(self, shape.dims)
        self.variant = variant
        mlps = self.layer_mlps(hf_config, shape, tp)
        self.model = VariantModel(shape, variant, backend, tp, mlps)  # type: ignore[assignment]
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

    def projections(self, layer: int) -> ProjectionLayout:
        return layer_projections(self.model.layers[layer])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        divisor = self.variant.logits_divisor
        return logits if divisor == 1.0 else logits / divisor
