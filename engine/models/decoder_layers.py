"""The configurable decoder's layer: Llama's attention and block with a `BlockVariant`'s
variations (engine.models.decoder), and the dense projections a layer exposes."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.rotary import PartialRotary, RotaryEmbedding
from engine.models.blocks import GatedMLP, LlamaAttention, LlamaMLP, LlamaShape
from engine.models.interface import ProjectionLayout
from engine.models.variant import BlockVariant, QKNorm


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


def layer_projections(layer: VariantDecoderLayer) -> ProjectionLayout:
    attention, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, LlamaMLP):  # a mixture of experts: no dense projections
        return ProjectionLayout(attention.qkv_proj, attention.o_proj, None, None)
    return ProjectionLayout(attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
