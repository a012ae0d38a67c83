"""Quantized models through the engine: quality against full precision, and the start-up errors.

The default model ships as a Q4_1 GGUF; its fp32 folder is transformers' dequantization of that
file, so "fp32" below is the model the `gguf` path must reproduce up to float error.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.llm import LLM
from engine.quantization.errors import QuantizationError
from schemas.sampling import SamplingParams
from tests.quantization.checkpoints import (
    WrittenCheckpoint,
    write_awq_checkpoint,
    write_gptq_checkpoint,
)

TEXT = (Path(__file__).parents[1] / "data" / "coriolanus_act1.txt").read_text()
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What does CPU stand for?",
    "Give me a tip for learning to cook.",
]


@functools.cache
def _perplexity(model: str, quantization: str | None) -> float:
    llm = LLM(model, dtype="float32", quantization=quantization, enforce_eager=True)
    return llm.perplexity(TEXT)


@pytest.fixture(scope="module")
def fp32_perplexity(default_model_path: Path) -> float:
    return _perplexity(str(default_model_path), None)


def test_the_text_is_a_few_thousand_tokens(default_model_path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    assert len(tokenizer.encode(TEXT).ids) >= 2000


def test_gguf_reproduces_the_dequantized_model(
    default_model_path: Path, fp32_perplexity: float
) -> None:
    gguf = _perplexity(str(default_model_path), "gguf")
    assert gguf == pytest.approx(fp32_perplexity, rel=1e-4)


def test_int8_perplexity_within_one_percent(
    default_model_path: Path, fp32_perplexity: float
) -> None:
    assert _perplexity(str(default_model_path), "int8") == pytest.approx(fp32_perplexity, rel=0.01)


def test_int4_perplexity_within_half_a_percent(
    default_model_path: Path, fp32_perplexity: float
) -> None:
    int4 = _perplexity(str(default_model_path), "int4")
    assert int4 == pytest.approx(fp32_perplexity, rel=0.005)


def test_w8a8_perplexity_within_five_percent(
    default_model_path: Path, fp32_perplexity: float
) -> None:
    # Integer activations (per token, no smoothing) cost quality that weight-only int8 does not:
    # +2.4% measured on this 135M model, the price of its prefill throughput (bench/engine/quantization.py).
    w8a8 = _perplexity(str(default_model_path), "w8a8")
    assert w8a8 == pytest.approx(fp32_perplexity, rel=0.05)
    assert w8a8 != _perplexity(str(default_model_path), "int8")  # the activations did change


def test_fp8_perplexity_within_five_percent(
    default_model_path: Path, fp32_perplexity: float
) -> None:
    # e4m3 keeps 3 mantissa bits: each weight moves by up to 2^-4 of itself (int8 per channel:
    # 1/254 of its row's largest). +2.9% measured on this 135M model (bench/engine/quantization.py).
    fp8 = _perplexity(str(default_model_path), "fp8")
    assert fp8 == pytest.approx(fp32_perplexity, rel=0.05)
    assert fp8 != fp32_perplexity  # the weights did change


NEAR_TIE_NATS = 0.1  # fp32's top two tokens this close: any rounding (bf16 too) may flip it


def test_int8_greedy_outputs_agree_with_fp32(default_model_path: Path) -> None:
    """16 greedy tokens of 8 chat prompts equal fp32's, except where fp32 itself is a near tie:
    there the 135M model's top two tokens are within 0.1 nats, which bf16 flips as well."""
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    replies = {}
    for quantization in (None, "int8"):
        llm = LLM(str(default_model_path), dtype="float32", quantization=quantization)
        replies[quantization] = [
            r.outputs[0] for r in llm.chat(conversations, params, use_tqdm=False)
        ]
    exact = 0
    for full, int8 in zip(replies[None], replies["int8"], strict=True):
        differ = [
            i for i, (a, b) in enumerate(zip(full.token_ids, int8.token_ids, strict=True)) if a != b
        ]
        if not differ:
            exact += 1
            continue
        top_two = full.logprobs[differ[0]].top_logprobs
        assert top_two[0][1] - top_two[1][1] < NEAR_TIE_NATS, (differ[0], top_two)
    assert exact >= 6


def test_gguf_holds_the_files_blocks_not_an_fp32_copy(default_model_path: Path) -> None:
    full = LLM(str(default_model_path), dtype="float32", enforce_eager=True)
    gguf = LLM(str(default_model_path), dtype="float32", quantization="gguf", enforce_eager=True)
    assert gguf.engine.quantization == "gguf"
    # Q4_1 linears (5 bits a weight with scale and minimum) and a Q8_0 embedding (8.5 bits).
    assert gguf.engine.weight_bytes < full.engine.weight_bytes / 5
    model = gguf.engine.runner.model
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if "proj" in n)


def _reference_folder(written: WrittenCheckpoint, destination: Path) -> Path:
    """A full-precision folder of exactly the weights the quantized checkpoint stores."""
    tensors = dict(written.references)
    with safe_open(str(written.folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if not name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
                tensors[name] = f.get_tensor(name).float()
    shutil.copytree(written.folder, destination, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, destination / "model.safetensors")
    config = json.loads((destination / "config.json").read_text())
    del config["quantization_config"]
    (destination / "config.json").write_text(json.dumps(config))
    return destination


@pytest.mark.parametrize(
    "write",
    [
        functools.partial(write_gptq_checkpoint, group_size=64),
        functools.partial(write_gptq_checkpoint, group_size=64, desc_act=True),
        functools.partial(write_awq_checkpoint, group_size=64),
    ],
    ids=["gptq", "gptq-act-order", "awq"],
)
def test_gptq_and_awq_checkpoints_run_as_their_weights_say(
    default_model_path: Path, tmp_path: Path, write: Callable[..., WrittenCheckpoint]
) -> None:
    written = write(default_model_path, tmp_path / "quantized", num_layers=4)
    reference = _reference_folder(written, tmp_path / "reference")
    method = str(written.quantization_config["quant_method"])
    # The checkpoint's config names its format: no flag needed, and the flag is accepted.
    quantized = LLM(str(written.folder), dtype="float32", enforce_eager=True)
    assert quantized.engine.quantization == method
    LLM(str(written.folder), dtype="float32", quantization=method, enforce_eager=True)
    full = LLM(str(reference), dtype="float32", enforce_eager=True)
    text = TEXT[:2000]
    assert quantized.perplexity(text) == pytest.approx(full.perplexity(text), rel=1e-3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = quantized.generate(PROMPTS[:2], params, use_tqdm=False)
    want = full.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_quantized_bfloat16_runs(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for quantization in ("int8", "w8a8", "int4"):
        llm = LLM(str(tiny_llama_dir), dtype="bfloat16", quantization=quantization)
        assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("quantization", "engine_args", "named"),
    [
        ("int3", {}, "int3"),
        ("gptq", {}, "gptq"),
        ("awq", {}, "awq"),
        ("gguf", {}, "gguf"),
        ("compressed-tensors", {}, "compressed-tensors"),
        ("int4", {"dtype": "float16"}, "float16"),
        ("gguf", {"load_format": "dummy"}, "dummy"),
        ("int4", {"quantization_group_size": 48}, "quantization_group_size=48"),
    ],
)
def test_unsupported_settings_fail_at_start_up_naming_the_value(
    tiny_llama_dir: Path, quantization: str, engine_args: dict[str, object], named: str
) -> None:
    with pytest.raises(QuantizationError, match=named) as error:
        LLM(str(tiny_llama_dir), device="cpu", quantization=quantization, **engine_args)
    assert "supported" in str(error.value) or "needs" in str(error.value)


def test_a_quantized_checkpoint_refuses_a_contradicting_flag(
    default_model_path: Path, tmp_path: Path
) -> None:
    written = write_gptq_checkpoint(default_model_path, tmp_path / "gptq", num_layers=1)
    for flag in ("awq", "int8", "gguf"):
        with pytest.raises(QuantizationError, match="gptq"):
            LLM(str(written.folder), quantization=flag)


def test_fp8_matmul_tracks_full_precision() -> None:
    from engine.quantization.fp8_matmul import fp8_kernel, fp8_linear
    from engine.quantization.weights import dequantize, quantize_fp8

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=generator) * 0.05
    x = torch.randn(5, 128, generator=generator)
    quantized = quantize_fp8(weight)
    assert torch.allclose(dequantize(quantized), weight, rtol=0.07, atol=1e-6)
    exact = x @ weight.T
    got = fp8_linear(x, quantized, kernel=fp8_kernel(x.device, x.dtype))
    relative = (got - exact).norm() / exact.norm()
    assert relative < 0.05
