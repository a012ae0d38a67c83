"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral) and the building blocks other families reuse.

Projections are fused: qkv_proj holds [q; k; v] rows and gate_up_proj holds [gate; up] rows
(see `weight_mapping`, used by the loader). Every HF config field the blocks need is read once,
into a `LlamaShape`; a family that is Llama with other config fields (engine.models.qwen2)
reads its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear
from engine.layers.norm import RMSNorm
from engine.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorSlice,
    VocabParallelEmbedding,
    balanced_slice,
    split_heads,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.config_checks import refuse_unsupported
from engine.models.interface import (
    AttentionKind,
    AttentionSpec,
    CausalLM,
    KVCaches,
    ModelDims,
    ProjectionLayout,
    WeightMapping,
)
from engine.platforms.cpu.decode_stack import CpuDecodeStack, DecoderLayerParts

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class LlamaShape:
    """What the Llama blocks read of an HF config."""

    dims: ModelDims
    num_layers: int
    intermediate_size: int
    attention: AttentionSpec  # every layer's, before any tensor-parallel split
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer where layers differ (hybrid local/global attention); empty: `attention` for all.
    layer_attention: tuple[AttentionSpec, ...] = ()

    def for_layer(self, layer: int) -> LlamaShape:
        """This shape with layer's own attention."""
        if not self.layer_attention:
            return self
        return replace(self, attention=self.layer_attention[layer])


def read_llama_config(
    hf_config: PretrainedConfig, allow_partial_rotary: bool = False
) -> LlamaShape:
    """allow_partial_rotary: the caller reads partial_rotary_factor itself (else it is refused)."""
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    # A window applies unless the config turns it off (Qwen2's use_sliding_window).
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    theta, scaling = rope_parameters(hf_config, allow_partial_rotary)
    attention = AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        kind=AttentionKind.SLIDING if window else AttentionKind.FULL,
        window=int(window) if window else None,
    )
    # Configs naming each layer's kind (e.g. Qwen2 windows only layers from max_window_layers).
    layer_types = getattr(hf_config, "layer_types", None) or ()
    layer_attention = (
        tuple(
            attention
            if kind == "sliding_attention"
            else replace(attention, kind=AttentionKind.FULL, window=None)
            for kind in layer_types
        )
        if window
        else ()
    )
    return LlamaShape(
        dims=ModelDims(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            max_position_embeddings=int(hf_config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            initializer_range=float(getattr(hf_config, "initializer_range", 0.02) or 0.02),
        ),
        num_layers=hf_config.num_hidden_layers,
        intermediate_size=hf_config.intermediate_size,
        attention=attention,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        layer_attention=layer_attention,
    )


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj: MergedLinear
        self.down_proj: Linear
        if tp is None:
            self.gate_up_proj = MergedLinear(
                hidden_size, [intermediate_size] * 2, bias=bias, gated=True
            )
            self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        else:
            part = balanced_slice(intermediate_size, tp)
            self.gate_up_proj = ColumnParallelLinear(
                hidden_size, [part, part], bias=bias, gated=True
            )
            columns = TensorSlice(1, part.start, part.length, part.full)
            self.down_proj = RowParallelLinear(columns, hidden_size, tp, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.activated(x))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        spec, hidden_size = shape.attention, shape.dims.hidden_size
        self.scale = spec.head_dim**-0.5
        self.qkv_proj: MergedLinear
        self.o_proj: Linear
        if tp is None:
            self.qkv_proj = MergedLinear(
                hidden_size, [spec.q_size, spec.kv_size, spec.kv_size], bias=shape.qkv_bias
            )
            self.o_proj = Linear(spec.q_size, hidden_size, bias=shape.o_bias)
        else:  # this rank's heads only
            heads = split_heads(spec.num_heads, spec.num_kv_heads, spec.head_dim, tp)
            spec = replace(spec, num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads)
            self.qkv_proj = ColumnParallelLinear(
                hidden_size, [heads.q, heads.kv, heads.kv], bias=shape.qkv_bias
            )
            columns = TensorSlice(1, heads.q.start, heads.q.length, heads.q.full)
            self.o_proj = RowParallelLinear(columns, hidden_size, tp, bias=shape.o_bias)
        self.spec = spec
        # Plain copies for the forward, which reads them per layer and step.
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim, self.q_size, self.kv_size = spec.head_dim, spec.q_size, spec.kv_size
        self.rotary_emb = rotary_emb  # shared by all layers
        self.backend = backend
        self.window = spec.window  # None: full attention

    def project_qkv(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The fused [q; k; v] rows [T, q_size + 2 * kv_size] that `rotary_emb` then rotates
        (families that normalize q and k, or rotate part of them themselves, do so here)."""
        return self.qkv_proj(hidden)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output after o_proj for every token, or only for `output_rows` (every
        token's K/V is still computed and stored)."""
        num_tokens = hidden.shape[0]
        qkv = self.project_qkv(positions, hidden)
        out = self.backend.attend_from_qkv(
            qkv,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.num_heads,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            window=self.window,
        )
        if out is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary_emb(positions, q, k, cos_sin)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(
                q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, window=self.window
            )
        out = out.reshape(num_tokens, self.q_size)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)


# The MLP of decoder layer i (a family whose layers differ there, e.g. mixture-of-experts ones,
# gives LlamaModel its own; the default is LlamaMLP everywhere).
MlpFactory = Callable[[int], nn.Module]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden_size, eps = shape.dims.hidden_size, shape.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = LlamaAttention(shape, rotary_emb, backend, tp)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = (
            mlp
            if mlp is not None
            else LlamaMLP(hidden_size, shape.intermediate_size, shape.mlp_bias, tp)
        )

    def projections(self) -> ProjectionLayout:
        attention, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):  # a mixture of experts: no dense projections
            return ProjectionLayout(attention.qkv_proj, attention.o_proj, None, None)
        return ProjectionLayout(
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
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
        """(MLP output, residual stream) for every token, or only for `output_rows`."""
        # The residual stream is carried separately so each norm can fuse the add.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin, output_rows)
        if output_rows is not None:
            residual = residual.index_select(0, output_rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        shape: LlamaShape,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        mlp_of: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        dims = shape.dims
        self.rotary_emb = RotaryEmbedding(
            shape.attention.head_dim,
            dims.max_position_embeddings,
            shape.rope_theta,
            shape.rope_scaling,
        )
        self.embed_tokens = (
            VocabEmbedding(dims.vocab_size, dims.hidden_size)
            if tp is None
            else VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                shape.for_layer(i),
                self.rotary_emb,
                backend,
                tp=tp,
                mlp=None if mlp_of is None else mlp_of(i),
            )
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(dims.hidden_size, shape.rms_norm_eps)
        # Decode steps on the CPU run their layers in one C++ call (tensor-parallel ranks keep
        # the Python forward: their layers all-reduce between the ops; so do models with a
        # mixture-of-experts MLP, which the C++ stack does not compute).
        dense = all(layer.projections().dense_mlp for layer in self.layers)
        self.cpu_decode_stack = (
            self._cpu_decode_stack(backend, shape.rms_norm_eps)
            if tp is None and dense and isinstance(backend, TorchAttentionBackend)
            else None
        )

    def _cpu_decode_stack(self, backend: TorchAttentionBackend, eps: float) -> CpuDecodeStack:
        parts = [
            DecoderLayerParts(
                layer.input_layernorm, layer.post_attention_layernorm, layer.projections()
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
        """Final hidden states of every token, or only of `output_rows` (in their order)."""
        hidden = self.embed_tokens(input_ids)
        if self.cpu_decode_stack is not None:
            done = self.cpu_decode_stack.run(hidden, positions, kv_caches, meta)
            if done is not None:
                hidden, _ = self.norm(*done)
                return hidden if output_rows is None else hidden.index_select(0, output_rows)
        # On the CPU the cos/sin rows of this step's positions are gathered once for all layers.
        cos_sin = None if hidden.is_cuda else self.rotary_emb.lookup(positions, hidden.dtype)
        residual = None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            # Past the last layer's attention only the wanted rows matter: the rest of a prompt
            # needs its K/V stored, not its hidden states, so o_proj and the MLP skip them.
            rows = output_rows if index == last else None
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, cos_sin, rows)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(CausalLM):
    weight_mapping = WeightMapping(
        packed={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        },
        ignored_suffixes=("rotary_emb.inv_freq",),  # old checkpoints store the rope table
    )

    def __init__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: this rank's place in a tensor-parallel group; None: the whole model here."""
        shape = self.read_config(hf_config)
        super().__init__(shape.dims)
        self.model = LlamaModel(shape, backend, tp, self.layer_mlps(hf_config, shape, tp))
        self.lm_head = (
            Linear(shape.dims.hidden_size, shape.dims.vocab_size, bias=False)
            if tp is None
            else ParallelLMHead(shape.dims.hidden_size, shape.dims.vocab_size, tp)
        )
        self.tie_weights()

    @classmethod
    def read_config(cls, hf_config: PretrainedConfig) -> LlamaShape:
        refuse_unsupported(hf_config)
        return read_llama_config(hf_config)

    @classmethod
    def layer_mlps(
        cls, hf_config: PretrainedConfig, shape: LlamaShape, tp: TensorParallel | None
    ) -> MlpFactory | None:
        """Each layer's MLP where the family's differ from Llama's (None: LlamaMLP in all)."""
        return None

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def attention_spec(self, layer: int) -> AttentionSpec:
        return self.model.layers[layer].self_attn.spec

    def projections(self, layer: int) -> ProjectionLayout:
        return self.model.layers[layer].projections()

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
