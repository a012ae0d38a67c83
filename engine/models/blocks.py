"""The Llama blocks every decoder family is built of: the shape read from an HF config, the
gated MLP and the attention over fused projections.

Projections are fused: qkv_proj holds [q; k; v] rows and gate_up_proj holds [gate; up] rows
(the families' `weight_mapping` tells the loader). Every HF config field the blocks need is
read once, into a `LlamaShape`; engine.models.decoder assembles the blocks into layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.linear import Linear, MergedLinear
from engine.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorSlice,
    balanced_slice,
    split_heads,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.interface import AttentionKind, AttentionSpec, ModelDims

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
        self.softcap: float | None = None  # scores soft-capped before the softmax (Gemma 2)
        # [num_heads] sink logits of the softmax denominators (gpt-oss); None: no sinks
        self.sinks: nn.Parameter | None
        self.register_parameter("sinks", None)

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
            softcap=self.softcap,
            sinks=self._sinks(),
        )
        if out is None:
            q, k, v = self._rotate(positions, qkv, cos_sin)
            out = self.attend(q, k, v, kv_cache, meta)
        return self.output(out, output_rows)

    def rotated_qkv(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D], rotated: what `attend` takes."""
        return self._rotate(positions, self.project_qkv(positions, hidden), cos_sin)

    def _rotate(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k, cos_sin)
        return q, k, v.view(qkv.shape[0], self.num_kv_heads, self.head_dim)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k and v in the cache and attend: [T, H, D]."""
        return self.backend.forward(
            q,
            k,
            v,
            kv_cache[0],
            kv_cache[1],
            meta,
            self.scale,
            window=self.window,
            softcap=self.softcap,
            sinks=self._sinks(),
        )

    def output(self, out: torch.Tensor, output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj of the attention output [T, H, D], for every token or only `output_rows`."""
        out = out.reshape(out.shape[0], self.q_size)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.o_proj(out)

    def _sinks(self) -> torch.Tensor | None:
        return None if self.sinks is None else self.sinks.float()


# The MLP of decoder layer i (a family whose layers differ there, e.g. mixture-of-experts ones,
# give the decoder their own; the default is LlamaMLP everywhere).
MlpFactory = Callable[[int], nn.Module]


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
