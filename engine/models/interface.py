"""What the engine knows of a model: the `CausalLM` interface every model family implements.

The runner, the loader, tensor parallelism, the KV cache, quantization and the CPU decode stack
read a model through this interface only; a family's HF config fields are read in the family's
own file. Shapes are this rank's (a tensor-parallel shard holds its share of the heads).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.models.split import SplitForward

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


class AttentionKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"  # each token sees the last `window` positions
    NONE = "none"  # the layer attends to nothing (its KV cache entry goes unused)


@dataclass(frozen=True)
class AttentionSpec:
    """One decoder layer's attention as this rank holds it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kind: AttentionKind = AttentionKind.FULL
    window: int | None = None  # tokens, for SLIDING only
    # Multi-head latent attention (DeepSeek): each token's cache entry is one row of this many
    # features (the compressed latent and the shared rope key), not per-head K and V.
    latent_size: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is AttentionKind.SLIDING) != (self.window is not None):
            raise ValueError(f"a window goes with sliding attention only: {self}")

    @property
    def cache_row(self) -> tuple[int, int, int]:
        """What one token takes in this layer's cache: (planes, heads, features per head);
        planes 2 for separate K and V, 1 for a latent row."""
        if self.latent_size is not None:
            return 1, 1, self.latent_size
        return 2, self.num_kv_heads, self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class ProjectionLayout:
    """A decoder layer's linears, iterated in the order a decode step runs them."""

    qkv: MergedLinear  # [q; k; v] rows
    o: Linear
    # A dense MLP's [gate; up] rows and down projection; None for a mixture-of-experts MLP
    # (engine.layers.moe), whose experts are no Linear.
    gate_up: MergedLinear | None
    down: Linear | None

    @property
    def dense_mlp(self) -> bool:
        return self.gate_up is not None and self.down is not None

    def __iter__(self) -> Iterator[Linear]:
        return (p for p in (self.qkv, self.o, self.gate_up, self.down) if p is not None)


@dataclass(frozen=True)
class ExpertTarget:
    """Where one expert's checkpoint projection goes in the stacked expert weights."""

    param: str  # the model parameter holding every expert's (e.g. ...mlp.experts.w13)
    expert: int
    shard: int | None  # the part of a fused [gate; up] parameter, else None


@dataclass(frozen=True)
class WeightMapping:
    """How a checkpoint's tensor names map to the model's parameters."""

    # fused parameter's module name -> the checkpoint projections stacked into it, in row order
    packed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # checkpoint tensors the model does not hold (e.g. a stored rope table)
    ignored_suffixes: tuple[str, ...] = ()
    # checkpoint module name -> the model's (e.g. Mixtral's block_sparse_moe -> mlp)
    renamed: Mapping[str, str] = field(default_factory=dict)
    # an expert's checkpoint projection (experts.N.<name>.weight) -> (stacked parameter, shard)
    experts: Mapping[str, tuple[str, int | None]] = field(default_factory=dict)

    def ignores(self, name: str) -> bool:
        return name.endswith(self.ignored_suffixes)

    def _parts(self, name: str) -> list[str]:
        return [self.renamed.get(part, part) for part in name.split(".")]

    def expert_target(self, name: str) -> ExpertTarget | None:
        """Where a checkpoint name `...experts.N.<projection>.weight` goes; None for others."""
        parts = self._parts(name)
        if len(parts) < 4 or parts[-1] != "weight" or parts[-4] != "experts":
            return None
        stacked = self.experts.get(parts[-2])
        if stacked is None or not parts[-3].isdigit():
            return None
        return ExpertTarget(".".join([*parts[:-3], stacked[0]]), int(parts[-3]), stacked[1])

    def target_of(self, name: str) -> tuple[str, int | None]:
        """A checkpoint name -> (model parameter name, shard of a fused parameter or None)."""
        parts = self._parts(name)
        for i, part in enumerate(parts):
            for fused, sources in self.packed.items():
                if part in sources:
                    return ".".join([*parts[:i], fused, *parts[i + 1 :]]), sources.index(part)
        return ".".join(parts), None


@dataclass(frozen=True)
class ModelDims:
    """The model-wide sizes the engine reads."""

    vocab_size: int  # real tokens (a tensor-parallel lm_head may pad its rows)
    hidden_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float = 0.02  # the scale of dummy weights


class CausalLM(nn.Module, metaclass=abc.ABCMeta):
    """A decoder-only language model as the engine runs it.

    A family subclasses this, is constructed as `Family(hf_config, backend, tp=tp)` (tp: this
    rank's place in a tensor-parallel group; None: the whole model here) and is registered in
    engine.models by its HF architecture name.
    """

    weight_mapping: ClassVar[WeightMapping] = WeightMapping()
    # Whether CUDA decode steps may replay captured graphs: not where the forward plans its
    # gathers on the host every step (multi-head latent attention's torch path).
    cuda_graphs: ClassVar[bool] = True
    lm_head: Linear

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.dims.hidden_size

    @property
    def tie_word_embeddings(self) -> bool:
        return self.dims.tie_word_embeddings

    @property
    @abc.abstractmethod
    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers, in order; the KV cache holds one entry per layer."""

    @abc.abstractmethod
    def attention_spec(self, layer: int) -> AttentionSpec: ...

    @abc.abstractmethod
    def projections(self, layer: int) -> ProjectionLayout: ...

    def input_embedding(self) -> VocabEmbedding | None:
        """The token embedding table, where the model has one LoRA adapters may target."""
        return None

    @abc.abstractmethod
    def tie_weights(self) -> None:
        """Point the lm_head at the embedding where the embeddings are tied (after loading)."""

    @abc.abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_meta: AttentionMetadata,
        sample_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden], or [R, hidden]
        for the rows `sample_rows` [R] int64 names (every token's K/V is stored either way)."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 logits [S, vocab (padded under tensor parallelism)]."""

    def split_forward(self) -> SplitForward | None:
        """The forward cut at its attention calls, for piecewise CUDA graphs of steps with
        prefills (engine.piecewise_graphs); None: such steps run eagerly."""
        return None

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Whether the loader passes over this checkpoint tensor on purpose (e.g. layers a
        checkpoint holds for another use, such as DeepSeek's multi-token prediction)."""
        return False

    def attention_specs(self) -> list[AttentionSpec]:
        return [self.attention_spec(i) for i in range(len(self.decoder_layers))]

    def sliding_window(self) -> int | None:
        """The smallest sliding window of any layer (None: no layer has one)."""
        return min((spec.window for spec in self.attention_specs() if spec.window), default=None)

    def kv_window(self) -> int | None:
        """How many of a sequence's latest positions any layer still reads, where every layer
        has a sliding window (the largest); None where some layer reads the whole context.

        Blocks wholly before a running sequence's last kv_window positions are read by no
        layer again, so they can be freed while it runs."""
        windows = [spec.window for spec in self.attention_specs()]
        if not windows or any(window is None for window in windows):
            return None
        return max(window for window in windows if window is not None)


class ModelFactory(Protocol):
    def __call__(
        self,
        hf_config: PretrainedConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> CausalLM: ...
