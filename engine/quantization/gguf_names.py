"""GGUF tensor names -> the HF names the loader expects, per GGUF architecture.

llama.cpp's converter renames each family's tensors into one vocabulary (`blk.3.attn_q.weight`)
whose meaning depends on the architecture: `ffn_norm` is Llama's post_attention_layernorm but
Gemma's pre_feedforward_layernorm, `ffn_up` is Phi-3's fused [gate; up]. Each architecture we
read has its table here; a file of any other architecture is refused at load, naming it.

What the converter changed besides names, and is undone on reading:
- `llama` (and Mixtral, which it writes as `llama`): Q and K rows permuted (see gguf.py);
- Gemma 2 and 3: every `*norm.weight` stored as 1 + w (llama.cpp's RMSNorm multiplies by the
  weight, Gemma's by 1 + weight);
- mixture-of-experts layers: every expert's projection stacked into one 3-D tensor
  (`ffn_gate_exps` [experts, intermediate, hidden]); each expert's slice gets its HF name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.quantization.errors import QuantizationFormatError

_GLOBAL_NAMES = MappingProxyType(
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
)
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SANDWICH_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_LAYER = {
    **_LLAMA_LAYER,
    **_SANDWICH_NORMS,
    "ffn_norm": "pre_feedforward_layernorm",
}
_OLMO2_LAYER = {
    name: hf for name, hf in _LLAMA_LAYER.items() if name not in ("attn_norm", "ffn_norm")
} | _SANDWICH_NORMS
_PHI3_LAYER = {**_LLAMA_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{}.w2",
}
_QWEN_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_QWEN_SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


@dataclass(frozen=True)
class ArchitectureNames:
    """One GGUF architecture's tensor names and what its converter did to the values."""

    layer: dict[str, str]  # GGUF layer tensor -> HF module under model.layers.N
    experts: dict[str, str] = field(default_factory=dict)  # stacked -> per-expert ({} = index)
    skipped: frozenset[str] = frozenset({"rope_freqs.weight"})  # recomputed from the config
    permuted_qk: bool = False
    norms_plus_one: bool = False


ARCHITECTURES: dict[str, ArchitectureNames] = {
    "llama": ArchitectureNames(
        {**_LLAMA_LAYER, "ffn_gate_inp": "block_sparse_moe.gate"},
        _MIXTRAL_EXPERTS,
        permuted_qk=True,
    ),
    "qwen2": ArchitectureNames(_LLAMA_LAYER),
    "qwen3": ArchitectureNames(_LLAMA_LAYER),
    "qwen2moe": ArchitectureNames(
        {**_LLAMA_LAYER, "ffn_gate_inp": "mlp.gate", **_QWEN_SHARED_EXPERT}, _QWEN_EXPERTS
    ),
    "qwen3moe": ArchitectureNames({**_LLAMA_LAYER, "ffn_gate_inp": "mlp.gate"}, _QWEN_EXPERTS),
    "phi3": ArchitectureNames(
        _PHI3_LAYER,
        skipped=frozenset(
            {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
        ),
    ),
    "olmo2": ArchitectureNames(_OLMO2_LAYER),
    "gemma2": ArchitectureNames(_GEMMA_LAYER, norms_plus_one=True),
    "gemma3": ArchitectureNames(_GEMMA_LAYER, norms_plus_one=True),
}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)$")


def architecture_names(architecture: str) -> ArchitectureNames:
    names = ARCHITECTURES.get(architecture)
    if names is None:
        raise QuantizationFormatError(
            f"GGUF architecture {architecture!r} is not supported (supported: "
            + ", ".join(sorted(ARCHITECTURES))
            + "); load the model's safetensors instead"
        )
    return names


@dataclass(frozen=True)
class HFName:
    """Where a GGUF tensor goes: one HF name, or one per expert (`{}` in it: the index)."""

    name: str
    stacked_experts: bool = False


def hf_name(names: ArchitectureNames, gguf_name: str) -> HFName | None:
    """The HF name of a GGUF tensor, None for tensors HF models do not have."""
    if gguf_name in names.skipped:
        return None
    layer = _LAYER_TENSOR.match(gguf_name)
    if layer:
        index, part, kind = layer.groups()
        if part in names.layer:
            return HFName(f"model.layers.{index}.{names.layer[part]}.{kind}")
        if part in names.experts and kind == "weight":
            return HFName(f"model.layers.{index}.{names.experts[part]}.weight", True)
    top = _GLOBAL_TENSOR.match(gguf_name)
    if top and top.group(1) in _GLOBAL_NAMES:
        return HFName(f"{_GLOBAL_NAMES[top.group(1)]}.{top.group(2)}")
    raise QuantizationFormatError(f"GGUF tensor {gguf_name!r} has no known HF name")
