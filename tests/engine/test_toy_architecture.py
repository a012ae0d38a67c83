"""A model family defined here, outside the engine, runs through the engine once registered.

The toy family has parallel residual blocks (GPT-J style: one norm per layer, and attention and
MLP both read it and add to the residual stream), which no engine family has. Its weights are
random and saved as safetensors; the engine's greedy tokens must equal those of a plain torch
forward of the same weights written below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig

import engine.models
from engine import LLM, SamplingParams
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.interface import (
    AttentionSpec,
    CausalLM,
    KVCaches,
    ModelDims,
    ProjectionLayout,
    WeightMapping,
)
from engine.models.llama import LlamaAttention, LlamaMLP, LlamaShape

THETA = 10000.0
EPS = 1e-5


class ToyParallelConfig(PretrainedConfig):
    model_type = "toy_parallel"

    def __init__(
        self,
        vocab_size: int = 128,
        width: int = 64,
        mlp_width: int = 96,
        depth: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        context: int = 256,
        **kwargs: object,
    ) -> None:
        self.vocab_size, self.width, self.mlp_width, self.depth = (
            vocab_size,
            width,
            mlp_width,
            depth,
        )
        self.heads, self.kv_heads, self.context = heads, kv_heads, context
        super().__init__(**kwargs)


class ToyParallelBlock(nn.Module):
    def __init__(self, shape: LlamaShape, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.norm = RMSNorm(shape.dims.hidden_size, EPS)
        self.self_attn = LlamaAttention(shape, rotary, backend)
        self.mlp = LlamaMLP(shape.dims.hidden_size, shape.intermediate_size, bias=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        normed = self.norm(hidden)
        attended = self.self_attn(positions, normed, kv_cache, meta, cos_sin)
        return hidden + attended + self.mlp(normed)


class ToyParallelForCausalLM(CausalLM):
    weight_mapping = WeightMapping(
        packed={
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        }
    )

    def __init__(
        self,
        hf_config: ToyParallelConfig,
        backend: AttentionBackend,
        *,
        tp: TensorParallel | None = None,
    ) -> None:
        if tp is not None:
            raise NotImplementedError("the toy family runs on one device")
        dims = ModelDims(hf_config.vocab_size, hf_config.width, hf_config.context, False)
        super().__init__(dims)
        head_dim = hf_config.width // hf_config.heads
        shape = LlamaShape(
            dims=dims,
            num_layers=hf_config.depth,
            intermediate_size=hf_config.mlp_width,
            attention=AttentionSpec(hf_config.heads, hf_config.kv_heads, head_dim),
            rms_norm_eps=EPS,
            rope_theta=THETA,
            rope_scaling=None,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
        )
        self.rotary = RotaryEmbedding(head_dim, hf_config.context, THETA)
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(
            ToyParallelBlock(shape, self.rotary, backend) for _ in range(hf_config.depth)
        )
        self.norm = RMSNorm(dims.hidden_size, EPS)
        self.lm_head = Linear(dims.hidden_size, dims.vocab_size, bias=False)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def attention_spec(self, layer: int) -> AttentionSpec:
        return self.layers[layer].self_attn.spec

    def projections(self, layer: int) -> ProjectionLayout:
        block = self.layers[layer]
        attention, mlp = block.self_attn, block.mlp
        return ProjectionLayout(
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        )

    def tie_weights(self) -> None:
        pass

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        attn_meta: AttentionMetadata,
        sample_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = None if hidden.is_cuda else self.rotary.lookup(positions, hidden.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, attn_meta, cos_sin)
        hidden = self.norm(hidden)
        return hidden if sample_rows is None else hidden.index_select(0, sample_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _random_weights(config: ToyParallelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    head_dim = config.width // config.heads

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) / cols**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(config.width, generator=generator)

    weights = {
        "embed_tokens.weight": torch.randn(config.vocab_size, config.width, generator=generator),
        "norm.weight": norm(),
        "lm_head.weight": matrix(config.vocab_size, config.width),
    }
    for i in range(config.depth):
        prefix = f"layers.{i}."
        weights |= {
            prefix + "norm.weight": norm(),
            prefix + "self_attn.q_proj.weight": matrix(config.heads * head_dim, config.width),
            prefix + "self_attn.k_proj.weight": matrix(config.kv_heads * head_dim, config.width),
            prefix + "self_attn.v_proj.weight": matrix(config.kv_heads * head_dim, config.width),
            prefix + "self_attn.o_proj.weight": matrix(config.width, config.heads * head_dim),
            prefix + "mlp.gate_proj.weight": matrix(config.mlp_width, config.width),
            prefix + "mlp.up_proj.weight": matrix(config.mlp_width, config.width),
            prefix + "mlp.down_proj.weight": matrix(config.width, config.mlp_width),
        }
    return weights


def _reference_logits(
    config: ToyParallelConfig, w: dict[str, torch.Tensor], ids: list[int]
) -> torch.Tensor:
    """The toy model's last-position logits, in plain torch, recomputing the whole prefix."""
    head_dim = config.width // config.heads
    length = len(ids)
    inv_freq = 1.0 / THETA ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [heads, length, head_dim]
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), -1) * sin

    hidden = w["embed_tokens.weight"][torch.tensor(ids)]
    for i in range(config.depth):
        p = f"layers.{i}."
        normed = rms_norm(hidden, w[p + "norm.weight"])

        def heads(name: str, count: int, p: str = p, normed: torch.Tensor = normed):
            projected = normed @ w[p + f"self_attn.{name}_proj.weight"].T
            return projected.view(length, count, head_dim).transpose(0, 1)

        q = rotate(heads("q", config.heads))
        k = rotate(heads("k", config.kv_heads)).repeat_interleave(
            config.heads // config.kv_heads, 0
        )
        v = heads("v", config.kv_heads).repeat_interleave(config.heads // config.kv_heads, 0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attended = attended.transpose(0, 1).reshape(length, config.width)
        gate, up = normed @ w[p + "mlp.gate_proj.weight"].T, normed @ w[p + "mlp.up_proj.weight"].T
        mlp = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        hidden = hidden + attended @ w[p + "self_attn.o_proj.weight"].T + mlp
    return rms_norm(hidden[-1], w["norm.weight"]) @ w["lm_head.weight"].T


def _reference_greedy(
    config: ToyParallelConfig, w: dict[str, torch.Tensor], prompt: list[int], new_tokens: int
) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(_reference_logits(config, w, ids).argmax()))
    return ids[len(prompt) :]


@pytest.fixture
def toy_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    AutoConfig.register(ToyParallelConfig.model_type, ToyParallelConfig, exist_ok=True)
    # This test's registration ends with the test.
    monkeypatch.setattr(engine.models, "_FAMILIES", dict(engine.models._FAMILIES))
    engine.models.register_architecture(
        "ToyParallelForCausalLM", ToyParallelConfig.model_type, ToyParallelForCausalLM
    )
    ToyParallelConfig(architectures=["ToyParallelForCausalLM"]).save_pretrained(tmp_path)
    save_file(_random_weights(ToyParallelConfig()), str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_family_registered_outside_the_engine_generates_its_reference_tokens(
    toy_model_dir: Path,
) -> None:
    config = ToyParallelConfig()
    weights = _random_weights(config)
    prompts = [[5, 17, 99, 3, 64, 2, 41], [7], [100, 1, 50, 25, 12, 6, 3, 90, 44, 8, 11, 70]]
    new_tokens = 12
    llm = LLM(
        str(toy_model_dir),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        block_size=4,
        enforce_eager=True,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, greedy, use_tqdm=False)

    assert type(llm.engine.runner.model) is ToyParallelForCausalLM
    expected = [_reference_greedy(config, weights, p, new_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
