"""Encoder models of the BERT family (BERT, RoBERTa, XLM-RoBERTa): bidirectional attention,
token-type ids and learned absolute positions, post-norm blocks. Used by the pooling runner
(embeddings, and the scores of *ForSequenceClassification cross-encoders: dense, tanh and a
linear over the first token's state, BERT's pooler + classifier or RoBERTa's classifier head),
never for generation: there is no KV cache, each batch is padded and attended whole under a
padding mask.

RoBERTa and XLM-R number positions from pad_token_id + 1 (position ids are cumulative over
real tokens, offset past the padding index); BERT numbers them from 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.models.checkpoint import SafetensorsCheckpoint, WeightLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# In place, on the MLP's fresh intermediate: a new tensor of that size (tens of MB at a full
# token budget) costs its page faults again on every call, ~15% of the forward.
_ACTIVATIONS = {
    "gelu": torch.ops.aten.gelu_,
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "relu": torch.relu_,
}
_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta"})
# Checkpoint name prefixes of the bare encoder inside a task model, and tensors it does not use.
_PREFIXES = ("bert.", "roberta.", "model.")
_UNUSED = ("pooler.", "cls.", "lm_head.", "classifier.", "embeddings.position_ids")
# A cross-encoder's head, by its checkpoint names (BERT: pooler + classifier; RoBERTa/XLM-R:
# classifier.dense + classifier.out_proj) -> this module's.
_HEAD_NAMES = {
    "pooler.dense": "head.dense",
    "classifier.dense": "head.dense",
    "classifier.out_proj": "head.out",
    "classifier": "head.out",
}


@dataclass(frozen=True)
class EncoderShape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    activation: str
    pad_token_id: int
    position_offset: bool  # RoBERTa/XLM-R: positions start after pad_token_id

    @classmethod
    def read(cls, hf_config: PretrainedConfig) -> EncoderShape:
        activation = str(hf_config.hidden_act)
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"encoder activation {activation!r} is not implemented")
        kind = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise NotImplementedError(f"position_embedding_type {kind!r} is not implemented")
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            intermediate_size=hf_config.intermediate_size,
            max_position_embeddings=hf_config.max_position_embeddings,
            type_vocab_size=getattr(hf_config, "type_vocab_size", 1) or 1,
            layer_norm_eps=hf_config.layer_norm_eps,
            activation=activation,
            pad_token_id=getattr(hf_config, "pad_token_id", 0) or 0,
            position_offset=hf_config.model_type in _OFFSET_POSITIONS,
        )

    @property
    def max_tokens(self) -> int:
        """The longest input the learned positions cover."""
        offset = self.pad_token_id + 1 if self.position_offset else 0
        return self.max_position_embeddings - offset


class BertEmbeddings(nn.Module):
    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.word_embeddings = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position_embeddings = nn.Embedding(shape.max_position_embeddings, shape.hidden_size)
        self.token_type_embeddings = nn.Embedding(shape.type_vocab_size, shape.hidden_size)
        self.LayerNorm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.shape.position_offset:
            positions = torch.cumsum(mask, dim=1) * mask + self.shape.pad_token_id
        else:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
        hidden = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        return self.LayerNorm(hidden)


class BertLayer(nn.Module):
    """Self-attention (q, k, v fused into one projection at load) and the MLP, each followed by
    residual add and LayerNorm."""

    def __init__(self, shape: EncoderShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.num_heads = shape.num_heads
        self.head_dim = hidden // shape.num_heads
        # Linear: on the CPU each computes through the matmul plan measured for this machine
        # (PoolingRunner tunes it), e.g. oneDNN's or our panel kernels over packed weights.
        self.qkv = Linear(hidden, 3 * hidden)
        self.attention_out = Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=shape.layer_norm_eps)
        self.intermediate = Linear(hidden, shape.intermediate_size)
        self.output = Linear(shape.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=shape.layer_norm_eps)
        self.act = _ACTIVATIONS[shape.activation]

    def forward(self, hidden: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        q, k, v = (
            self.qkv(hidden)
            .view(batch, length, 3, self.num_heads, self.head_dim)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        attended = _attend(q, k, v, attn_mask).transpose(1, 2).reshape(batch, length, width)
        # Residuals added into the projections' fresh outputs, for the same reason.
        hidden = self.attention_norm(self.attention_out(attended).add_(hidden))
        return self.output_norm(self.output(self.act(self.intermediate(hidden))).add_(hidden))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v over [B, heads, L, head_dim]; mask [B, 1, 1, L] is
    0 on real keys and -inf on padding.

    On the CPU as two batched matmuls around a softmax: at an encoder's lengths (tens of
    tokens) the scores are small, and torch's flash kernel for the CPU takes ~1.5x as long
    over its blocks as this. Elsewhere torch's fused kernels."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5).add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class ClassifierHead(nn.Module):
    """A cross-encoder's scores from the first token's state: out(tanh(dense(state)))."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.dense(first_token)))


class BertEncoder(nn.Module):
    """The bare encoder: token ids -> the last layer's token states; with `num_labels`, also a
    cross-encoder's classifier head (`head`)."""

    def __init__(self, shape: EncoderShape, num_labels: int | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.embeddings = BertEmbeddings(shape)
        self.layers = nn.ModuleList(BertLayer(shape) for _ in range(shape.num_layers))
        self.head = None if num_labels is None else ClassifierHead(shape.hidden_size, num_labels)

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    def linear_shapes(self) -> list[tuple[int, int]]:
        """The distinct (out, in) of the layers' linears, the ones a matmul plan computes."""
        shapes = (
            (m.out_features, m.in_features) for m in self.layers.modules() if isinstance(m, Linear)
        )
        return list(dict.fromkeys(shapes))

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """input_ids, token_type_ids, mask: [B, L] (mask 1 on real tokens, 0 on padding) ->
        [B, L, hidden]; padding rows hold garbage the caller drops."""
        hidden = self.embeddings(input_ids, token_type_ids, mask)
        # Broadcast over heads and queries: each query sees every real token of its sequence.
        attn_mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device)
        attn_mask = attn_mask.masked_fill_(mask == 0, float("-inf"))[:, None, None, :]
        for layer in self.layers:
            hidden = layer(hidden, attn_mask)
        return hidden


def _checkpoint_name(name: str, classify: bool) -> str | None:
    """The encoder's name of a checkpoint tensor; None for tensors it does not use."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if classify:
        module, _, param = name.rpartition(".")
        if module in _HEAD_NAMES:
            return f"{_HEAD_NAMES[module]}.{param}"
    if name.startswith(_UNUSED):
        return None
    return name


def _our_name(name: str) -> tuple[str, int | None]:
    """HF's BERT layer names -> (this module's parameter, row shard of the fused qkv or None)."""
    if not name.startswith("encoder.layer."):
        return name, None
    _, _, index, rest = name.split(".", 3)
    renamed = {
        "attention.output.dense": "attention_out",
        "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate",
        "output.dense": "output",
        "output.LayerNorm": "output_norm",
    }
    module, param = rest.rsplit(".", 1)
    for shard, part in enumerate(
        ("attention.self.query", "attention.self.key", "attention.self.value")
    ):
        if module == part:
            return f"layers.{index}.qkv.{param}", shard
    if module not in renamed:
        return f"layers.{index}.{rest}", None
    return f"layers.{index}.{renamed[module]}.{param}", None


def is_cross_encoder(hf_config: PretrainedConfig) -> bool:
    return any(arch.endswith("ForSequenceClassification") for arch in hf_config.architectures or ())


def load_encoder(
    hf_config: PretrainedConfig, model_path: Path, device: torch.device, dtype: torch.dtype
) -> BertEncoder:
    """Build the encoder (with a cross-encoder's head where the config names one) and fill
    every parameter from the folder's safetensors files."""
    shape = EncoderShape.read(hf_config)
    classify = is_cross_encoder(hf_config)
    with torch.device("meta"):
        model = BertEncoder(shape, hf_config.num_labels if classify else None)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    filled: dict[str, set[int | None]] = {name: set() for name in params}
    checkpoint = SafetensorsCheckpoint(model_path)
    hidden = shape.hidden_size
    with torch.no_grad():
        for stored in checkpoint.names():
            name = _checkpoint_name(stored, classify)
            if name is None:
                continue
            target, shard = _our_name(name)
            param = params.get(target)
            if param is None:
                raise WeightLoadError(f"checkpoint tensor {stored} has no place in the encoder")
            destination = (
                param.data if shard is None else param.data[shard * hidden : (shard + 1) * hidden]
            )
            if checkpoint.shape(stored) != tuple(destination.shape):
                raise WeightLoadError(
                    f"{stored}: checkpoint shape {checkpoint.shape(stored)} != "
                    f"model shape {tuple(destination.shape)}"
                )
            checkpoint.read_into(stored, destination)
            filled[target].add(shard)
    missing = [
        name
        for name, shards in filled.items()
        if not shards or (".qkv." in name and len(shards) < 3)
    ]
    if missing:
        raise WeightLoadError(
            f"checkpoint lacks {len(missing)} encoder weights, e.g. {missing[:5]}"
        )
    return model.eval()
