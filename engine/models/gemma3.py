"""Gemma 3 (text): local sliding-window layers between global ones, each kind with its own rope.

Where it differs from the Llama blocks: the embedding is scaled by sqrt(hidden_size) (rounded
to the weights' dtype, as the reference does), every RMSNorm multiplies by (1 + weight), q and
k are RMS-normed per head before rotary (QK-norm), each layer's attention output and MLP output
are normed again before their residual add (sandwich norms), the MLP is gelu-tanh(gate) * up,
and attention scales by query_pre_attn_scalar ** -0.5. Layers are local or global by the
config's layer_types (older configs: every sliding_window_pattern-th layer is global); local
layers rotate by rope_local_base_freq's table, global ones by rope_theta's. The optional final
logit soft-capping is applied. Gemma 2 (engine.models.gemma2) runs these blocks without QK-norm
and with its attention scores soft-capped.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.interface import (
    AttentionKind,
    AttentionSpec,
    CausalLM,
    KVCaches,
    ModelDims,
    ProjectionLayout,
    WeightMapping,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaShape:
    """What the Gemma blocks read of an HF config."""

    dims: ModelDims
    intermediate_size: int
    layers: tuple[AttentionSpec, ...]  # each layer's attention
    rms_norm_eps: float
    scale: float  # attention's softmax scale
    rope: dict[str, tuple[float, dict[str, Any] | None]]  # layer kind -> (theta, scaling)
    final_logit_softcapping: float | None
    qk_norm: bool = True  # q and k RMS-normed per head before rotary (Gemma 3)
    attn_logit_softcapping: float | None = None  # attention scores capped (Gemma 2)


def read_gemma3_config(hf_config: PretrainedConfig) -> GemmaShape:
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None) or [
        FULL if (i + 1) % getattr(hf_config, "sliding_window_pattern", 6) == 0 else SLIDING
        for i in range(num_layers)
    ]
    num_heads = hf_config.num_attention_heads
    full = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=hf_config.head_dim,
    )
    window = hf_config.sliding_window
    local = AttentionSpec(
        full.num_heads, full.num_kv_heads, full.head_dim, AttentionKind.SLIDING, int(window)
    )
    params = hf_config.rope_parameters
    if isinstance(params, dict) and SLIDING in params:
        rope = {
            kind: rope_parameters(SimpleNamespace(rope_parameters=params[kind])) for kind in params
        }
    else:  # older configs: rope_theta (global) and rope_local_base_freq
        theta, scaling = rope_parameters(hf_config)
        local_theta = float(getattr(hf_config, "rope_local_base_freq", 10_000.0))
        rope = {FULL: (theta, scaling), SLIDING: (local_theta, None)}
    softcap = getattr(hf_config, "final_logit_softcapping", None)
    attn_softcap = getattr(hf_config, "attn_logit_softcapping", None)
    return GemmaShape(
        dims=ModelDims(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            initializer_range=float(getattr(hf_config, "initializer_range", 0.02) or 0.02),
        ),
        intermediate_size=hf_config.intermediate_size,
        layers=tuple(local if kind == SLIDING else full for kind in layer_types[:num_layers]),
        rms_norm_eps=hf_config.rms_norm_eps,
        scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        rope=rope,
        final_logit_softcapping=float(softcap) if softcap else None,
        attn_logit_softcapping=float(attn_softcap) if attn_softcap else None,
    )


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), computed in float32 as the reference does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        shape: GemmaShape,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden = shape.dims.hidden_size
        self.spec = spec
        self.qkv_proj = MergedLinear(hidden, [spec.q_size, spec.kv_size, spec.kv_size])
        self.o_proj = Linear(spec.q_size, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(spec.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = GemmaRMSNorm(spec.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.softcap = shape.attn_logit_softcapping
        self.rotary_emb = rotary  # shared by the layers of its kind
        self.backend = backend
        self.scale = shape.scale

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        spec, num_tokens = self.spec, hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, spec.num_heads, spec.head_dim))
            k = self.k_norm(k.reshape(num_tokens, spec.num_kv_heads, spec.head_dim))
        q, k = self.rotary_emb(positions, q.reshape(num_tokens, -1), k.reshape(num_tokens, -1))
        v = v.reshape(num_tokens, spec.num_kv_heads, spec.head_dim)
        out = self.backend.forward(
            q.contiguous(),
            k.contiguous(),
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            window=spec.window,
            softcap=self.softcap,
        )
        return self.o_proj(out.reshape(num_tokens, spec.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        shape: GemmaShape,
        spec: AttentionSpec,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        hidden, eps = shape.dims.hidden_size, shape.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(shape, spec, rotary, backend)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = Gemma3MLP(hidden, shape.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class Gemma3Model(nn.Module):
    def __init__(self, shape: GemmaShape, backend: AttentionBackend) -> None:
        super().__init__()
        dims = shape.dims
        head_dim = shape.layers[0].head_dim
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, dims.max_position_embeddings, theta, scaling)
                for kind, (theta, scaling) in shape.rope.items()
            }
        )
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size)
        self.embed_scale = dims.hidden_size**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(shape, spec, self.rotary[SLIDING if spec.window else FULL], backend)
            for spec in shape.layers
        )
        self.norm = GemmaRMSNorm(dims.hidden_size, shape.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        if output_rows is not None:
            hidden = hidden.index_select(0, output_rows)
        return self.norm(hidden)


class Gemma3ForCausalLM(CausalLM):
    weight_mapping = WeightMapping(
        packed={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        },
    )

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        if tp is not None:
            raise NotImplementedError("Gemma does not run under tensor parallelism yet")
        shape = self.read_config(hf_config)
        super().__init__(shape.dims)
        self.model = Gemma3Model(shape, backend)
        self.lm_head = Linear(shape.dims.hidden_size, shape.dims.vocab_size, bias=False)
        self.final_logit_softcapping = shape.final_logit_softcapping
        self.tie_weights()

    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> GemmaShape:
        return read_gemma3_config(hf_config)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def attention_spec(self, layer: int) -> AttentionSpec:
        return self.model.layers[layer].self_attn.spec

    def projections(self, layer: int) -> ProjectionLayout:
        attention, mlp = self.model.layers[layer].self_attn, self.model.layers[layer].mlp
        return ProjectionLayout(
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        )

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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
