"""DeepSeek-V3: pre-norm decoder layers of multi-head latent attention (engine.models.mla, its
compressed latent cache in engine.attention.latent) and, from layer first_k_dense_replace on, a
mixture of routed experts plus shared experts (engine.layers.moe.grouped) whose router scores
by sigmoid and picks its top-k among the best expert groups with a correction bias (noaux_tc);
the first layers have a dense gated MLP.

The released fp8 block-quantized weights load as the fp8 scheme (engine.quantization.fp8),
experts included. Refused at load, by name: tensor parallelism, another router (topk_method,
scoring_func), MoE layers other than every layer past the dense ones (moe_layer_freq), and the
generic fields engine.models.config_checks refuses. The multi-token-prediction layers a checkpoint may hold
past num_hidden_layers are not read, as transformers does not read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.moe import RouterSpec, Scoring, SharedExpertsMoeBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.blocks import LlamaMLP
from engine.models.config_checks import UnsupportedConfigError, refuse_unsupported
from engine.models.decoder import LLAMA_WEIGHTS
from engine.models.interface import (
    AttentionSpec,
    CausalLM,
    KVCaches,
    ModelDims,
    ProjectionLayout,
)
from engine.models.mla import LatentAttention, LatentShape, softmax_scale
from engine.models.qwen2_moe import QWEN_EXPERTS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEEPSEEK_WEIGHTS = replace(
    LLAMA_WEIGHTS,
    packed={
        # Without q_lora_rank the query's down projection is q_proj (renamed below).
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    renamed={"q_proj": "q_a_proj"},
    experts=QWEN_EXPERTS,
)


def refuse_fields(hf_config: PretrainedConfig, supported: dict[str, tuple[object, ...]]) -> None:
    """Refuse a config whose field (where set) has a value outside the supported ones."""
    family = type(hf_config).__name__
    for field, values in supported.items():
        found = getattr(hf_config, field, None)
        if found is not None and found not in values:
            raise UnsupportedConfigError(
                f"{field}={found!r} is not supported for {family} models "
                f"(supported: {', '.join(repr(v) for v in values)})"
            )


def check_config(hf_config: PretrainedConfig, tp: TensorParallel | None) -> None:
    """Refuse, naming the field, what the DeepSeek families do not compute exactly (their
    routers' own fields are checked by each family)."""
    if tp is not None:
        raise NotImplementedError("DeepSeek models (latent attention) are not tensor-parallel yet")
    refuse_unsupported(hf_config)
    refuse_fields(hf_config, {"moe_layer_freq": (1,)})


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, attention: LatentAttention, mlp: nn.Module
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, dims: ModelDims, router: RouterSpec) -> None:
        super().__init__()
        hidden, eps = dims.hidden_size, float(hf_config.rms_norm_eps)
        shape = LatentShape.from_config(hf_config)
        theta, scaling = rope_parameters(hf_config)
        self.rotary_emb = RotaryEmbedding(
            shape.qk_rope_head_dim, dims.max_position_embeddings, theta, scaling
        )
        scale = softmax_scale(shape, scaling)
        first_sparse = hf_config.first_k_dense_replace or 0
        bias = bool(getattr(hf_config, "mlp_bias", False))  # V2's dense and shared MLPs

        def mlp(layer: int) -> nn.Module:
            if layer < first_sparse:
                return LlamaMLP(hidden, hf_config.intermediate_size, bias)
            experts_size = hf_config.moe_intermediate_size
            shared = LlamaMLP(hidden, experts_size * hf_config.n_shared_experts, bias)
            return SharedExpertsMoeBlock(hidden, experts_size, router, shared)

        self.embed_tokens = VocabEmbedding(dims.vocab_size, hidden)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(
                hidden, eps, LatentAttention(shape, hidden, self.rotary_emb, scale), mlp(i)
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rows = output_rows if index == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DeepseekV3ForCausalLM(CausalLM):
    weight_mapping = DEEPSEEK_WEIGHTS
    cuda_graphs: ClassVar[bool] = False  # the latent attention plans its gathers on the host

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        """backend: unused, latent attention layers attend through engine.attention.latent."""
        check_config(hf_config, tp)
        router = self.router_spec(hf_config)
        dims = ModelDims(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            initializer_range=float(getattr(hf_config, "initializer_range", 0.02) or 0.02),
        )
        super().__init__(dims)
        self.model = DeepseekV3Model(hf_config, dims, router)
        self.lm_head = Linear(dims.hidden_size, dims.vocab_size, bias=False)
        self.tie_weights()

    @classmethod
    def router_spec(cls, hf_config: PretrainedConfig) -> RouterSpec:
        """noaux_tc: grouped top-k of sigmoid scores with the correction bias."""
        refuse_fields(hf_config, {"topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",)})
        return RouterSpec(
            hf_config.n_routed_experts,
            hf_config.num_experts_per_tok,
            Scoring.SIGMOID_GROUPED,
            renormalize=bool(hf_config.norm_topk_prob),
            num_groups=hf_config.n_group or 1,
            topk_groups=hf_config.topk_group or 1,
            routed_scaling=float(hf_config.routed_scaling_factor),
        )

    @property
    def decoder_layers(self) -> Sequence[nn.Module]:
        return self.model.layers

    def attention_spec(self, layer: int) -> AttentionSpec:
        return self.model.layers[layer].self_attn.spec

    def projections(self, layer: int) -> ProjectionLayout:
        block = self.model.layers[layer]
        attention, mlp = block.self_attn, block.mlp
        dense = isinstance(mlp, LlamaMLP)
        return ProjectionLayout(
            attention.fused_qkv_a_proj,
            attention.o_proj,
            mlp.gate_up_proj if dense else None,
            mlp.down_proj if dense else None,
        )

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """The multi-token-prediction layers, numbered after the decoder's."""
        parts = name.split(".")
        return (
            len(parts) > 2
            and parts[:2] == ["model", "layers"]
            and parts[2].isdigit()
            and int(parts[2]) >= len(self.model.layers)
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
        return self.lm_head(hidden).float()
