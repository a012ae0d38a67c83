"""The Llama family (Llama 2/3/3.1, SmolLM2, Mistral without sliding window) and Qwen2.

One module serves all of them: they differ only in projection biases (Qwen2 has q/k/v biases),
rope scaling and head sizes, all read from the HF config. Projections are fused: qkv_proj holds
[q; k; v] rows and gate_up_proj holds [gate; up] rows (see packed_modules, used by the loader).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
from engine.platforms.cpu.decode_stack import CpuDecodeStack, DecoderLayerParts

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


def head_dim_of(hf_config: Any) -> int:
    return (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
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
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(hf_config)
        self.scale = self.head_dim**-0.5
        self.qkv_proj: MergedLinear
        self.o_proj: Linear
        if tp is None:
            self.q_size = self.num_heads * self.head_dim
            self.kv_size = self.num_kv_heads * self.head_dim
            self.qkv_proj = MergedLinear(
                hf_config.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias
            )
            self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        else:  # this rank's heads only
            heads = split_heads(self.num_heads, self.num_kv_heads, self.head_dim, tp)
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
            self.q_size, self.kv_size = heads.q.length, heads.kv.length
            self.qkv_proj = ColumnParallelLinear(
                hf_config.hidden_size, [heads.q, heads.kv, heads.kv], bias=qkv_bias
            )
            columns = TensorSlice(1, heads.q.start, heads.q.length, heads.q.full)
            self.o_proj = RowParallelLinear(columns, hf_config.hidden_size, tp, bias=o_bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.backend = backend

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
        qkv = self.qkv_proj(hidden)
        out = self.backend.attend_from_qkv(
            qkv,
            positions,
            self.rotary_emb.cos_sin_cache,
            self.num_heads,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
        )
        if out is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.rotary_emb(positions, q, k, cos_sin)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = out.reshape(num_tokens, self.q_size)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.self_attn = LlamaAttention(hf_config, rotary_emb, backend, qkv_bias, o_bias, tp)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps)
        self.mlp = LlamaMLP(hf_config.hidden_size, hf_config.intermediate_size, mlp_bias, tp)

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
        hf_config: Any,
        backend: AttentionBackend,
        biases: dict[str, bool],
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        theta, scaling = rope_parameters(hf_config)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(hf_config), hf_config.max_position_embeddings, theta, scaling
        )
        self.embed_tokens = (
            VocabEmbedding(hf_config.vocab_size, hf_config.hidden_size)
            if tp is None
            else VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, self.rotary_emb, backend, **biases, tp=tp)
            for _ in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        # Decode steps on the CPU run their layers in one C++ call (tensor-parallel ranks keep
        # the Python forward: their layers all-reduce between the ops).
        self.cpu_decode_stack = (
            self._cpu_decode_stack(backend, hf_config.rms_norm_eps)
            if tp is None and isinstance(backend, TorchAttentionBackend)
            else None
        )

    def _cpu_decode_stack(self, backend: TorchAttentionBackend, eps: float) -> CpuDecodeStack:
        parts = [
            DecoderLayerParts(
                layer.input_layernorm,
                layer.post_attention_layernorm,
                (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                ),
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


class LlamaForCausalLM(nn.Module):
    # Fused parameter -> the checkpoint projections stacked into it, in row order.
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self,
        hf_config: Any,
        backend: AttentionBackend,
        qkv_bias: bool | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        """tp: this rank's place in a tensor-parallel group; None: the whole model here."""
        super().__init__()
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        biases = {
            "qkv_bias": attention_bias if qkv_bias is None else qkv_bias,
            "o_bias": attention_bias,
            "mlp_bias": bool(getattr(hf_config, "mlp_bias", False)),
        }
        self.config = hf_config
        self.model = LlamaModel(hf_config, backend, biases, tp)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = (
            Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
            if tp is None
            else ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size, tp)
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden], or [R, hidden]
        for the rows `output_rows` [R] int64 names (every token's K/V is stored either way)."""
        return self.model(input_ids, positions, kv_caches, attn_meta, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 logits [S, vocab]."""
        return self.lm_head(hidden).float()
