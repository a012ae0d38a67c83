"""Multi-head latent attention (DeepSeek-V2/V3) as a decoder layer's attention.

Each token's hidden state is projected down to a compressed latent of kv_lora_rank features
(normalized by kv_a_layernorm) plus one rope key of qk_rope_head_dim features shared by every
head (kv_a_proj_with_mqa); the queries come from q_proj, or through a low-rank q_a_proj ->
q_a_layernorm -> q_b_proj where q_lora_rank is set. The paged cache keeps only [latent; rope
key] per token (engine.attention.latent); kv_b_proj expands the latents into each head's
no-rope key part and value when attending. Both down projections read the hidden state, so
they are one fused linear here, fused_qkv_a_proj = [q_a_proj (or q_proj); kv_a_proj_with_mqa].

Rotary turns only the rope parts, pairing features (0, 1), (2, 3), ... where rope_interleave
says so (DeepSeek-V3's default) or each half with the other. The softmax scale is
qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared under a scaled rope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.attention.latent import Absorbed, attend_latent, store_latent
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.interface import AttentionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class LatentShape:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_size(self) -> int:
        """Features one token caches per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_down_size(self) -> int:
        """Rows of the query's part of the fused down projection."""
        return self.q_lora_rank or self.num_heads * self.qk_head_dim

    @classmethod
    def from_config(cls, hf_config: PretrainedConfig) -> LatentShape:
        return cls(
            num_heads=hf_config.num_attention_heads,
            q_lora_rank=hf_config.q_lora_rank or None,
            kv_lora_rank=hf_config.kv_lora_rank,
            qk_nope_head_dim=hf_config.qk_nope_head_dim,
            qk_rope_head_dim=hf_config.qk_rope_head_dim,
            v_head_dim=hf_config.v_head_dim,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(shape: LatentShape, rope_scaling: dict[str, Any] | None) -> float:
    scale = shape.qk_head_dim**-0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    if rope_scaling is not None and mscale_all_dim:
        scale *= yarn_mscale(float(rope_scaling["factor"]), float(mscale_all_dim)) ** 2
    return scale


def rotate(
    positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x [T, heads, rope_dim] turned by the rows of cos_sin table [max_position, rope_dim];
    interleaved pairs come out as transformers lays them: the pairs' first features, then
    their second ones."""
    cos, sin = table.index_select(0, positions).to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    first, second = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class LatentAttention(nn.Module):
    def __init__(
        self,
        shape: LatentShape,
        hidden_size: int,
        rotary_emb: RotaryEmbedding,
        scale: float,
    ) -> None:
        super().__init__()
        self.shape = shape
        heads = shape.num_heads
        bias = shape.attention_bias
        self.fused_qkv_a_proj = MergedLinear(
            hidden_size, [shape.q_down_size, shape.latent_size], bias=bias
        )
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if shape.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(shape.q_lora_rank, heads * shape.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * shape.v_head_dim, hidden_size, bias=bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.scale = scale
        self._absorbed: Absorbed | None = None  # from the loaded kv_b_proj, on first use
        self.spec = AttentionSpec(
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=shape.qk_head_dim,
            latent_size=shape.latent_size,
        )

    def expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached rows [S, latent_size] -> keys [S, heads, qk_head_dim], values
        [S, heads, v_head_dim]."""
        shape = self.shape
        latent, rope_key = rows.split([shape.kv_lora_rank, shape.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(rows.shape[0], shape.num_heads, -1)
        key_nope, values = kv.split([shape.qk_nope_head_dim, shape.v_head_dim], dim=-1)
        rope_key = rope_key.unsqueeze(1).expand(-1, shape.num_heads, -1)
        return torch.cat((key_nope, rope_key), dim=-1), values

    def absorbed(self, like: torch.Tensor) -> Absorbed:
        """kv_b_proj's rows split per head, read through the layer itself (a quantized or
        repacked weight included) by projecting the identity; computed once, after loading."""
        if self._absorbed is None:
            shape = self.shape
            identity = torch.eye(shape.kv_lora_rank, dtype=like.dtype, device=like.device)
            rows = self.kv_b_proj(identity).T.reshape(shape.num_heads, -1, shape.kv_lora_rank)
            key_up, value_up = rows.split([shape.qk_nope_head_dim, shape.v_head_dim], dim=1)
            self._absorbed = Absorbed(key_up.contiguous(), value_up.contiguous())
        return self._absorbed

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output after o_proj for every token, or only for `output_rows` (every
        token's latent row is still stored)."""
        shape, tokens = self.shape, hidden.shape[0]
        q, latent = self.fused_qkv_a_proj(hidden).split(
            [shape.q_down_size, shape.latent_size], dim=-1
        )
        if self.q_a_layernorm is not None and self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_layernorm(q.contiguous()))
        q_nope, q_rope = q.reshape(tokens, shape.num_heads, shape.qk_head_dim).split(
            [shape.qk_nope_head_dim, shape.qk_rope_head_dim], dim=-1
        )
        compressed, k_rope = latent.split([shape.kv_lora_rank, shape.qk_rope_head_dim], dim=-1)
        table = self.rotary_emb.cos_sin_cache
        q_rope = rotate(positions, q_rope, table, shape.rope_interleave)
        k_rope = rotate(positions, k_rope.unsqueeze(1), table, shape.rope_interleave)
        rows = torch.cat((self.kv_a_layernorm(compressed.contiguous()), k_rope.squeeze(1)), -1)
        store_latent(rows, kv_cache[0], meta.slot_mapping)
        query = torch.cat((q_nope, q_rope), dim=-1)
        absorbed = self.absorbed(hidden)
        out = attend_latent(query, kv_cache[0], meta, self.expand, absorbed, self.scale)
        out = out.reshape(tokens, shape.num_heads * shape.v_head_dim)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)
