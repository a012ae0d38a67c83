"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: tiny random models (fp32, seed
fixed) with multi-head latent attention (with a low-rank query and without), yarn rope with its
mscale on the softmax scale, experts in 4 groups of which 2 are eligible, a correction bias large
enough to change the choice, a dense first layer. Greedy tokens must equal transformers' for
every prompt alone, batched, after a prefix-cache hit and with prefills in chunks; the KV cache
holds one compressed row per token and layer, so a memory budget holds more blocks than a full
per-head K/V cache would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.attention.torch_backend import TorchAttentionBackend
from engine.distributed.group import TensorParallel
from engine.kv_cache import KVCacheSpec
from engine.layers.moe import RouterSpec, Scoring, grouped_topk
from engine.models import meta_model, served_architecture
from engine.models.config_checks import UnsupportedConfigError
from tests.engine.conftest import _randomize, transformers_greedy
from tests.engine.test_model_families import (  # noqa: F401 (plain_torch: a fixture)
    NEW_TOKENS,
    _check_family,
    _generate,
    _prompts,
    plain_torch,
)

DEEPSEEK = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=12,
    v_head_dim=10,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    pad_token_id=0,
    # No end-of-sequence token: transformers' min_new_tokens bans it, while ignore_eos only
    # keeps generating past it, so the two would part where greedy picks it.
    eos_token_id=None,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64,
    },
)


def _config(version: int = 3, **overrides: object) -> object:
    import transformers as tf

    config_class = tf.DeepseekV3Config if version == 3 else tf.DeepseekV2Config
    return config_class(**{**DEEPSEEK, **overrides})


def _save(
    path: Path, bias_scale: float = 0.5, seed: int = 0, version: int = 3, **overrides: object
) -> Path:
    import transformers as tf

    model_class = tf.DeepseekV3ForCausalLM if version == 3 else tf.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = model_class(_config(version, **overrides)).float().eval()
    _randomize(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in (
            model.model.layers[DEEPSEEK["first_k_dense_replace"] :] if version == 3 else ()
        ):
            bias = layer.mlp.gate.e_score_correction_bias  # a buffer: _randomize leaves it 0
            bias.copy_(bias_scale * torch.randn(bias.shape, generator=generator))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("deepseek_v3"))


def test_the_reference_depends_on_the_correction_bias(deepseek_dir: Path, tmp_path: Path) -> None:
    """Parity below means something: transformers' tokens change without the bias."""
    prompts = _prompts()
    unbiased = _save(tmp_path / "unbiased", bias_scale=0.0)
    expected = transformers_greedy(deepseek_dir, prompts, NEW_TOKENS)
    assert transformers_greedy(unbiased, prompts, NEW_TOKENS) != expected


def test_deepseek_v3_matches_transformers(deepseek_dir: Path) -> None:
    _check_family(deepseek_dir, None)


@pytest.mark.usefixtures("plain_torch")
def test_without_a_query_low_rank_and_rope_halves_on_plain_torch(tmp_path: Path) -> None:
    """q_proj instead of q_a/q_b, rope turning halves instead of interleaved pairs, no yarn,
    the engine without its C++ kernels, prefills in chunks."""
    path = _save(
        tmp_path / "no-q-lora",
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    prompts = _prompts()
    llm = LLM(
        str(path), dtype="float32", enforce_eager=True, cpu_matmul="aten", max_num_batched_tokens=8
    )
    assert _generate(llm, prompts) == transformers_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_matches_transformers(tmp_path: Path, topk_method: str) -> None:
    """V2's softmax router (over 2 of 4 expert groups, or all experts), without a query low
    rank as V2-Lite; alone, batched and in chunks."""
    path = _save(tmp_path / "v2", version=2, q_lora_rank=None, topk_method=topk_method)
    prompts = _prompts()
    expected = transformers_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)
    assert type(llm.engine.runner.model).__name__ == "DeepseekV2ForCausalLM"
    assert [_generate(llm, [prompt])[0] for prompt in prompts] == expected
    assert _generate(llm, prompts) == expected


def test_multi_token_prediction_layers_are_not_read(tmp_path: Path) -> None:
    """A checkpoint with a layer past num_hidden_layers (where DeepSeek keeps its MTP module)
    loads as transformers loads it: without that layer."""
    path = _save(tmp_path / "mtp", num_hidden_layers=4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    prompts = _prompts()[:2]
    llm = LLM(str(path), dtype="float32")
    assert _generate(llm, prompts) == transformers_greedy(path, prompts, NEW_TOKENS)


def test_the_kv_cache_holds_one_compressed_row_per_token_and_layer(deepseek_dir: Path) -> None:
    """kv_lora_rank + qk_rope_head_dim features per token and layer, not 2 * heads * head_dim:
    the same memory budget holds that many times more blocks."""
    config = _config()
    model = meta_model(config, TorchAttentionBackend())
    spec = KVCacheSpec.for_model(model, 16, torch.float32)
    latent = DEEPSEEK["kv_lora_rank"] + DEEPSEEK["qk_rope_head_dim"]
    layers = DEEPSEEK["num_hidden_layers"]
    assert spec.bytes_per_block == layers * 16 * latent * 4
    full_kv = 2 * DEEPSEEK["num_attention_heads"] * (DEEPSEEK["qk_nope_head_dim"] + 8)
    budget = 1 << 20
    llm = LLM(str(deepseek_dir), dtype="float32", kv_cache_memory=budget)
    runner = llm.engine.runner
    assert runner.num_kv_blocks == budget // (layers * 16 * latent * 4)
    assert runner.num_kv_blocks > 5 * (budget // (layers * 16 * full_kv * 4))
    assert tuple(runner.kv_cache.tensor.shape) == (layers, 1, runner.num_kv_blocks, 16, 1, latent)
    assert served_architecture(config) == "DeepseekV3ForCausalLM"


def test_grouped_routing_equals_transformers_router() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = _config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=generator))
    x = torch.randn(32, DEEPSEEK["hidden_size"], generator=generator)
    logits, expected_weights, expected_ids = router(x)
    spec = RouterSpec(16, 4, Scoring.SIGMOID_GROUPED, True, 4, 2, 2.5)
    weights, ids = grouped_topk(logits, router.e_score_correction_bias, spec)
    order, expected_order = ids.argsort(dim=-1), expected_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    groups = ids // 4  # each token's experts come from at most topk_group groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_what_changes_the_math_is_refused_by_name(overrides: dict, named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        meta_model(_config(**overrides), TorchAttentionBackend())


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        ({"norm_topk_prob": True}, "norm_topk_prob=True"),
    ],
)
def test_what_v2_does_not_compute_is_refused_by_name(overrides: dict, named: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=named):
        meta_model(_config(2, **overrides), TorchAttentionBackend())


def test_tensor_parallelism_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="not tensor-parallel"):
        meta_model(_config(), TorchAttentionBackend(), TensorParallel(0, 2))


def test_weight_only_int8_quantizes_the_latent_projections_and_the_experts(tmp_path: Path) -> None:
    """Sizes that int8's groups of 32 divide; its greedy start follows full precision."""
    path = _save(
        tmp_path / "int8", kv_lora_rank=32, q_lora_rank=32, v_head_dim=16, qk_nope_head_dim=24
    )
    prompt = _prompts()[2]
    full = _generate(LLM(str(path), dtype="float32"), [prompt])[0]
    llm = LLM(str(path), dtype="float32", quantization="int8")
    model = llm.engine.runner.model
    assert model.model.layers[1].self_attn.kv_b_proj.is_quantized
    assert model.model.layers[1].mlp.experts.quantized is not None
    assert _generate(llm, [prompt])[0][:2] == full[:2]


def test_the_released_config_builds_with_a_576_feature_cache_row() -> None:
    """DeepSeek-V3's released sizes (transformers' defaults) and its config.json's rope and
    router fields and its fp8 quantization_config, on the meta device."""
    from transformers import DeepseekV3Config

    released = dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=163840,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
    )
    model = meta_model(DeepseekV3Config(**released), TorchAttentionBackend())
    spec = KVCacheSpec.for_model(model, 16, torch.bfloat16)
    assert (spec.planes, spec.num_kv_heads, spec.head_dim) == (1, 1, 512 + 64)
    assert spec.bytes_per_block == 61 * 16 * 576 * 2
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    meta_model(DeepseekV3Config(**released, quantization_config=fp8), TorchAttentionBackend())


def test_an_fp8_block_checkpoint_loads_experts_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The released layout (fp8 weights, weight_scale_inv per 128x128 block, the router and
    lm_head unquantized) on a tiny config: the model its weights describe, greedy and logprobs."""
    import re

    from safetensors.torch import load_file, save_file

    from engine.quantization import matmul
    from engine.quantization.fp8_matmul import Fp8Kernel

    # Weight-only, whatever an earlier measurement in this process chose: w8a8 also rounds the
    # activations (a tiny config's blocks cover whole rows, so _scaled_mm would suit them).
    monkeypatch.setattr(matmul, "fp8_kernel", lambda device, dtype: Fp8Kernel.UPCAST)

    from schemas.sampling import SamplingParams
    from tests.quantization.checkpoints import write_fp8_checkpoint

    source = _save(tmp_path / "full")
    every_projection = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
    written = write_fp8_checkpoint(
        source, tmp_path / "fp8", layout="fp8-block", linears=every_projection
    )
    assert any(".experts." in name for name in written.references)
    reference = tmp_path / "reference"
    reference.mkdir()
    tensors = {
        name: tensor.float()
        for name, tensor in load_file(written.folder / "model.safetensors").items()
        if not name.endswith("_scale_inv") and tensor.dtype != torch.float8_e4m3fn
    }
    save_file({**tensors, **written.references}, reference / "model.safetensors")
    config = json.loads((written.folder / "config.json").read_text())
    del config["quantization_config"]
    (reference / "config.json").write_text(json.dumps(config))
    fp8 = LLM(str(written.folder), dtype="float32")
    assert fp8.engine.quantization == "fp8"
    assert fp8.engine.runner.model.model.layers[1].mlp.experts.quantized is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    prompts = _prompts()[:2]
    got = fp8.generate(prompts, params, use_tqdm=False)
    want = LLM(str(reference), dtype="float32").generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        ours_lp = torch.tensor([step.logprob for step in ours.outputs[0].logprobs])
        theirs_lp = torch.tensor([step.logprob for step in theirs.outputs[0].logprobs])
        torch.testing.assert_close(ours_lp, theirs_lp, rtol=0, atol=1e-4)


def test_forked_samples_copy_the_latent_blocks_they_write(deepseek_dir: Path) -> None:
    """n=2 of a prompt ending mid-block: both samples share its blocks and copy the partial one
    on write (the one-plane latent layout); each equals transformers' greedy tokens."""
    from engine import SamplingParams

    prompt = _prompts()[3]  # 23 tokens: one full block and a partial one
    expected = transformers_greedy(deepseek_dir, [prompt], NEW_TOKENS)[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    out = LLM(str(deepseek_dir), dtype="float32").generate([prompt], params, use_tqdm=False)[0]
    assert [list(sample.token_ids) for sample in out.outputs] == [expected, expected]
