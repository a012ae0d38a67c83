"""The dense families beyond Llama and Qwen2, each against transformers' own implementation.

Every family gets a tiny random model built by transformers here (fp32, seed fixed). The engine's
greedy tokens must equal transformers' greedy `generate` for every prompt: run alone, batched
with other requests, with prefills split into chunks, and after a prefix-cache hit, on the CPU
path the engine ships (C++ kernels, and the C++ decode stack where the family's block is
Llama's) and on the plain-torch path (no C++ kernels, eager glue, aten matmuls).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.attention.torch_backend import TorchAttentionBackend
from engine.models import meta_model, model_factory, served_architecture
from engine.models.config_checks import UnsupportedConfigError
from engine.models.interface import AttentionKind
from kernels import cpu_ops
from tests.engine.conftest import TINY_SIZES, _randomize, transformers_greedy

NEW_TOKENS = 12
# Prompt lengths: within one block, across blocks (block size 16), a block boundary exactly.
PROMPT_LENGTHS = [5, 11, 16, 23]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 48,
}
# family -> (transformers class names, config overrides, whether decode runs the C++ stack)
FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "qwen3": ("Qwen3", {"tie_word_embeddings": True}, False),
    "qwen3-gelu-yarn-bias": (
        "Qwen3",
        {
            "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
        False,
    ),
    "olmo2": ("Olmo2", {}, False),
    "granite": (
        "Granite",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.0,
            "tie_word_embeddings": True,
        },
        False,
    ),
    "smollm3": ("SmolLM3", {"num_hidden_layers": 4, "no_rope_layer_interval": 2}, False),
    # Phi-3 with LongRoPE. Every sequence here stays within the original context: transformers'
    # Phi-3 recomputes a sequence's whole cache with the long factors when it outgrows it,
    # which a paged cache does not (see engine.layers.rotary); the long rows are checked below.
    "phi3-longrope": (
        "Phi3",
        {
            "num_attention_heads": 4,  # transformers checks the factors against hidden / heads
            "rope_scaling": LONGROPE,
            "original_max_position_embeddings": 48,
            "max_position_embeddings": 96,
        },
        True,
    ),
    # Phi-4-mini's shape: partial rotary (3/4 of each head), LongRoPE, tied embeddings.
    "phi4-mini-partial": (
        "Phi3",
        {
            "num_attention_heads": 4,
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                **LONGROPE,
                "short_factor": LONGROPE["short_factor"][:6],
                "long_factor": LONGROPE["long_factor"][:6],
            },
            "original_max_position_embeddings": 48,
            "max_position_embeddings": 96,
            "tie_word_embeddings": True,
        },
        False,
    ),
}


# Special tokens inside the tiny vocabulary (some families default to ids of their real one).
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def save_family_model(path: Path, family: str, seed: int = 0) -> Path:
    import transformers as tf

    name, overrides, _ = FAMILIES[family]
    config = getattr(tf, f"{name}Config")(**{**TINY_SIZES, **TOKEN_IDS, **overrides})
    torch.manual_seed(seed)
    model = getattr(tf, f"{name}ForCausalLM")(config).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def plain_torch(tmp_path: Path) -> Iterator[None]:
    """The engine without its C++ kernels (as on a machine that never built them and cannot)."""
    from torch.utils import cpp_extension

    def no_compiler(**_: object) -> None:
        raise RuntimeError("no C++ compiler")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpp_extension, "load", no_compiler)
        patch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no-builds"))
        cpu_ops.cpu_kernels_available.cache_clear()
        try:
            yield
        finally:
            cpu_ops.cpu_kernels_available.cache_clear()


def _check_family(path: Path, expect_stack: bool | None) -> None:
    prompts = _prompts()
    shared = prompts[3][:16] + [(5 * j + 1) % 250 for j in range(9)]  # a block of prompt 3
    reference = transformers_greedy(path, [*prompts, shared], NEW_TOKENS)

    llm = LLM(str(path), dtype="float32")
    if expect_stack is not None:
        assert (llm.engine.runner.model.model.cpu_decode_stack is not None) == expect_stack
    for prompt, expected in zip(prompts, reference[:4], strict=True):
        assert _generate(llm, [prompt]) == [expected], f"prompt of {len(prompt)} tokens alone"
    others = [[(3 * j + 2) % 250 for j in range(n)] for n in (9, 30, 2)]
    assert _generate(llm, [others[0], *prompts, *others[1:]])[1:-2] == reference[:4]
    out = llm.generate([shared], GREEDY, use_tqdm=False)[0]
    assert out.metrics.num_cached_prompt_tokens == 16  # prompt 3's first block
    assert list(out.outputs[0].token_ids) == reference[4]

    chunked = LLM(str(path), dtype="float32", max_num_batched_tokens=8)
    assert _generate(chunked, prompts) == reference[:4]
    assert chunked.engine.stats().num_steps > sum(PROMPT_LENGTHS) // 8


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_matches_transformers(tmp_path: Path, family: str) -> None:
    path = save_family_model(tmp_path / family, family)
    _check_family(path, FAMILIES[family][2] if cpu_ops.cpu_kernels_available() else None)


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "smollm3", "phi4-mini-partial"])
def test_family_greedy_matches_transformers_on_plain_torch(
    tmp_path: Path, family: str, plain_torch: None
) -> None:
    path = save_family_model(tmp_path / family, family)
    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", enforce_eager=True, cpu_matmul="aten")
    assert not cpu_ops.cpu_kernels_available()
    assert _generate(llm, prompts) == transformers_greedy(path, prompts, NEW_TOKENS)


def _config(family: str, **overrides: Any) -> Any:
    import transformers as tf

    name, base, _ = FAMILIES[family]
    return getattr(tf, f"{name}Config")(**{**TINY_SIZES, **TOKEN_IDS, **base, **overrides})


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("qwen3", "attn_logit_softcapping", 30.0),
        ("olmo2", "final_logit_softcapping", 15.0),
        ("qwen3", "embedding_multiplier", 12.0),
        ("qwen3", "hidden_act", "xielu"),
        ("phi3-longrope", "use_qk_norm", True),
    ],
)
def test_a_math_changing_field_the_family_lacks_is_refused_by_name(
    family: str, field: str, value: object
) -> None:
    config = _config(family)
    setattr(config, field, value)
    with pytest.raises(UnsupportedConfigError, match=f"{field}={value!r}"):
        meta_model(config, TorchAttentionBackend())


def test_an_unknown_rope_scaling_is_refused_by_name() -> None:
    config = _config(
        "qwen3", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        meta_model(config, TorchAttentionBackend())


def test_llama_refuses_what_it_does_not_compute() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY_SIZES, hidden_act="gelu")
    with pytest.raises(UnsupportedConfigError, match="hidden_act='gelu'"):
        meta_model(config, TorchAttentionBackend())


@pytest.mark.parametrize(
    ("family", "architecture"),
    [
        ("qwen3", "Qwen3ForCausalLM"),
        ("olmo2", "Olmo2ForCausalLM"),
        ("granite", "GraniteForCausalLM"),
        ("smollm3", "SmolLM3ForCausalLM"),
        ("phi3-longrope", "Phi3ForCausalLM"),
    ],
)
def test_each_family_is_found_by_architecture(
    tmp_path: Path, family: str, architecture: str
) -> None:
    config = AutoConfig.from_pretrained(save_family_model(tmp_path / family, family))
    assert config.architectures == [architecture]
    assert model_factory(config).__name__ == architecture
    assert served_architecture(config) == architecture


def test_phi3_sliding_window_is_each_layers_attention_window() -> None:
    model = meta_model(_config("phi3-longrope", sliding_window=48), TorchAttentionBackend())
    assert {spec.kind for spec in model.attention_specs()} == {AttentionKind.SLIDING}
    assert model.sliding_window() == model.kv_window() == 48  # blocks behind it are given back


def test_longrope_rows_past_the_original_context_are_transformers_long_ones() -> None:
    import transformers as tf

    from engine.layers.rotary import rope_parameters, rope_table

    config = _config("phi3-longrope")
    rotary = tf.Phi3ForCausalLM(config).model.rotary_emb
    theta, scaling = rope_parameters(config)
    ours = rope_table(16, 96, theta, scaling)
    for length in (30, 96):  # within the original context (short factors), past it (long)
        cos, sin = rotary(torch.zeros(1), torch.arange(length)[None])
        expected = torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1)
        rows = slice(0, length) if length <= 48 else slice(48, length)
        torch.testing.assert_close(ours[rows], expected[rows], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "phi3-longrope"])
def test_each_tensor_parallel_rank_loads_its_heads_rows(tmp_path: Path, family: str) -> None:
    """Phi-3's fused checkpoint tensors split per rank like separate q/k/v ones; Qwen3's
    per-head QK-norm weights are whole on every rank."""
    from engine.distributed.group import TensorParallel
    from engine.models.loader import build_model

    path = save_family_model(tmp_path / family, family)
    config = AutoConfig.from_pretrained(path)

    def load(tp: TensorParallel | None) -> torch.nn.Module:
        backend = TorchAttentionBackend()
        cpu = torch.device("cpu")
        return build_model(config, backend, cpu, torch.float32, model_path=path, tp=tp)

    whole = load(None).state_dict()
    spec = meta_model(config, TorchAttentionBackend()).attention_spec(1)
    q, kv = spec.q_size, spec.kv_size
    fused = whole["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = whole["model.layers.1.mlp.gate_up_proj.weight"]
    half = gate_up.shape[0] // 2
    for rank in range(2):
        shard = load(TensorParallel(rank, 2)).state_dict()
        rows = [
            fused[rank * q // 2 : (rank + 1) * q // 2],
            fused[q + rank * kv // 2 : q + (rank + 1) * kv // 2],
            fused[q + kv + rank * kv // 2 : q + kv + (rank + 1) * kv // 2],
        ]
        assert torch.equal(shard["model.layers.1.self_attn.qkv_proj.weight"], torch.cat(rows))
        mlp_rows = [
            gate_up[rank * half // 2 : (rank + 1) * half // 2],
            gate_up[half + rank * half // 2 : half + (rank + 1) * half // 2],
        ]
        assert torch.equal(shard["model.layers.1.mlp.gate_up_proj.weight"], torch.cat(mlp_rows))
        for name, tensor in shard.items():
            if "_norm" in name:
                assert torch.equal(tensor, whole[name]), name


def test_qk_norm_over_the_whole_projection_is_refused_under_tensor_parallelism() -> None:
    from engine.distributed.group import TensorParallel

    with pytest.raises(NotImplementedError, match="not tensor-parallel"):
        meta_model(_config("olmo2"), TorchAttentionBackend(), TensorParallel(0, 2))


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def test_a_qwen3_gguf_runs_its_blocks_as_transformers_runs_them_dequantized(
    tmp_path: Path,
) -> None:
    """A Qwen3 GGUF (Q8_0 projections, f32 norms and embeddings, QK-norm weights included): the
    engine's greedy tokens equal transformers' on the same weights dequantized."""
    import gguf
    import transformers as tf

    path = save_family_model(tmp_path / "qwen3", "qwen3")
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(path / "model.gguf", "qwen3")
    state = {name: t.numpy() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    for name, values in state.items():
        if values.ndim == 2 and name.endswith("proj.weight"):
            blocks = gguf.quants.quantize(values, q8)
            writer.add_tensor(_gguf_name(name), blocks, raw_dtype=q8)
            dequantized = gguf.quants.dequantize(blocks, q8).reshape(values.shape)
            model.get_parameter(name).data.copy_(torch.from_numpy(dequantized))
        else:
            writer.add_tensor(_gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(path)  # the dequantized weights, for transformers' reference

    prompts = _prompts()
    llm = LLM(str(path), dtype="float32", quantization="gguf")
    assert llm.engine.quantization == "gguf"
    assert _generate(llm, prompts) == transformers_greedy(path, prompts, NEW_TOKENS)
