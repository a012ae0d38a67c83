"""fp8 on the CPU: the kernels, fp8 quantized at load, and published fp8 checkpoint layouts.

What a user relies on: quantization="fp8" runs wherever the engine runs and gives the numbers
of the model its fp8 weights describe (weight-only: that model's greedy tokens; w8a8-fp8: within
fp8's rounding of the activations), and a published fp8 checkpoint loads without a flag.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.llm import LLM
from engine.quantization import fp8_matmul, matmul
from engine.quantization.errors import QuantizationError, QuantizationFormatError
from engine.quantization.fp8_checkpoint import Fp8Checkpoint
from engine.quantization.fp8_matmul import Fp8Kernel, fp8_linear, upcast_bits
from engine.quantization.weights import FP8, QuantizedWeight, dequantize, quantize_fp8
from schemas.sampling import SamplingParams
from tests.quantization.checkpoints import write_fp8_checkpoint

# e4m3 keeps 3 mantissa bits: rounding a value to it moves it by at most half an ulp, 2^-4 of
# it. Quantized activations (the w8a8 kernel) bring each product within that of the exact one.
FP8_ACTIVATION_ROUNDING = 2.0**-4
# The weight-only kernel is the dequantized model's matmul up to fp32 summation order.
FP32_SUMMATION = 1e-5
PROMPTS = [[1, 5, 9, 42, 7], [3, 100, 17]]
STEPS = 8


def _force_kernel(monkeypatch: pytest.MonkeyPatch, kernel: Fp8Kernel) -> None:
    monkeypatch.setattr(matmul, "fp8_kernel", lambda device, dtype: kernel)


def _scaled_mm_runs() -> bool:
    weight = quantize_fp8(torch.randn(16, 32))
    try:
        fp8_linear(torch.randn(2, 32), weight, kernel=Fp8Kernel.SCALED_MM)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(
    not _scaled_mm_runs(), reason="this torch build has no fp8 torch._scaled_mm on the CPU"
)


def _block_weight(out_features: int, in_features: int, group_size: int) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(1)
    data = (torch.randn(out_features, in_features, generator=generator) * 40).to(FP8)
    scales = torch.rand(out_features, in_features // group_size, generator=generator) * 0.01
    return QuantizedWeight(8, out_features, in_features, group_size, data, scales)


# --- kernels -----------------------------------------------------------------------------------


def test_upcast_reads_every_fp8_code_exactly() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = ~codes.float().isnan()
    upcast = upcast_bits(codes).float() * 2.0**120
    assert torch.equal(upcast[finite], codes.float()[finite])


@pytest.mark.parametrize("group_size", [96, 32], ids=["per-channel", "blocks"])
def test_weight_only_kernel_is_the_dequantized_matmul(group_size: int) -> None:
    weight = (
        quantize_fp8(torch.randn(200, 96) * 0.05)
        if group_size == 96
        else _block_weight(200, 96, group_size)
    )
    x, bias = torch.randn(3, 5, 96), torch.randn(200)
    exact = x @ dequantize(weight).T + bias
    got = fp8_linear(x, weight, bias, Fp8Kernel.UPCAST)
    assert got.shape == exact.shape
    torch.testing.assert_close(got, exact, rtol=FP32_SUMMATION, atol=FP32_SUMMATION)
    in_bf16 = fp8_linear(x.bfloat16(), weight, bias.bfloat16(), Fp8Kernel.UPCAST)
    assert in_bf16.dtype == torch.bfloat16
    assert (in_bf16.float() - exact).norm() / exact.norm() < 2.0**-7  # bf16's rounding


@needs_scaled_mm
@pytest.mark.parametrize("static_scale", [None, 0.02], ids=["dynamic", "static"])
def test_w8a8_kernel_is_within_fp8_activation_rounding(static_scale: float | None) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = quantize_fp8(torch.randn(128, 256, generator=generator) * 0.05)
    if static_scale is not None:
        weight.input_scale = torch.tensor([static_scale])
    x = torch.randn(7, 256, generator=generator)
    exact = x @ dequantize(weight).T
    got = fp8_linear(x, weight, kernel=Fp8Kernel.SCALED_MM)
    relative = float((got - exact).norm() / exact.norm())
    assert 0 < relative < FP8_ACTIVATION_ROUNDING  # activations were rounded, within fp8's ulp


def test_without_scaled_mm_the_measured_choice_is_weight_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_fp8_gemm(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("_scaled_mm: fp8 is not supported on this device")

    monkeypatch.setattr(torch, "_scaled_mm", no_fp8_gemm)
    fp8_matmul._measured_kernel.cache_clear()
    try:
        assert fp8_matmul.fp8_kernel(torch.device("cpu"), torch.float32) is Fp8Kernel.UPCAST
    finally:
        fp8_matmul._measured_kernel.cache_clear()


# --- the engine --------------------------------------------------------------------------------


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=True)
    results = []
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        chosen = [step.logprob for step in completion.logprobs]
        results.append((list(completion.token_ids), chosen))
    return results


def _assert_same_model(got: LLM, want: LLM, logprob_tolerance: float) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(
        _greedy(got), _greedy(want), strict=True
    ):
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=0, atol=logprob_tolerance
        )


def _dequantized_folder(source: Path, destination: Path, weights: dict[str, torch.Tensor]) -> Path:
    """source with `weights` (HF name -> fp32) in place of its tensors, unquantized."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in source.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name)
                if tensor.dtype != FP8 and not name.endswith(("_scale", "_scale_inv")):
                    tensors[name] = tensor.float()
    tensors.update(weights)
    save_file(tensors, destination / "model.safetensors")
    config = json.loads((destination / "config.json").read_text())
    config.pop("quantization_config", None)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def _fp8_at_load_reference(source: Path, destination: Path) -> Path:
    """The fp32 model whose weights are quantize_fp8's of every linear of `source` (the
    lm_head too: fp8 quantizes it; the embedding keeps its precision)."""
    weights = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            tensor = f.get_tensor(name)
            if tensor.dim() == 2 and name.endswith(("proj.weight", "lm_head.weight")):
                weights[name] = dequantize(quantize_fp8(tensor))
    return _dequantized_folder(source, destination, weights)


def test_fp8_at_load_is_the_dequantized_model_on_the_cpu(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force_kernel(monkeypatch, Fp8Kernel.UPCAST)
    folder = tiny_model_factory("llama", tie_word_embeddings=False)
    fp8 = LLM(str(folder), dtype="float32", device="cpu", quantization="fp8")
    assert fp8.engine.quantization == "fp8"
    full = LLM(str(folder), dtype="float32", device="cpu")
    assert fp8.engine.weight_bytes < full.engine.weight_bytes / 2
    reference = LLM(str(_fp8_at_load_reference(folder, tmp_path / "ref")), dtype="float32")
    _assert_same_model(fp8, reference, logprob_tolerance=1e-4)


def test_fp8_runs_in_bfloat16_and_with_dummy_weights(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for engine_args in ({"dtype": "bfloat16"}, {"load_format": "dummy"}):
        llm = LLM(str(tiny_llama_dir), device="cpu", quantization="fp8", **engine_args)
        assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4


@needs_scaled_mm
def test_w8a8_fp8_engine_tracks_the_dequantized_model(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _force_kernel(monkeypatch, Fp8Kernel.SCALED_MM)
    folder = tiny_model_factory("llama")
    fp8 = LLM(str(folder), dtype="float32", quantization="fp8", enforce_eager=True)
    reference = LLM(str(_fp8_at_load_reference(folder, tmp_path / "ref")), dtype="float32")
    text = list(range(3, 200))
    # Each layer's activations round within 2^-4 of themselves; over 3 layers the model's
    # perplexity moves by a few percent at most (its log-likelihood by far less).
    assert fp8.perplexity(text) == pytest.approx(reference.perplexity(text), rel=0.05)
    assert fp8.perplexity(text) != reference.perplexity(text)  # activations did round


CHECKPOINTS = {
    "fp8-block-128": {"layout": "fp8-block"},
    "fp8-block-32x64": {"layout": "fp8-block", "block": (32, 64)},
    "compressed-tensors-channel": {"layout": "ct-channel"},
    "compressed-tensors-tensor-static": {"layout": "ct-tensor-static"},
}


@pytest.mark.parametrize("layout", CHECKPOINTS)
def test_fp8_checkpoints_run_as_their_weights_say(
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: str,
) -> None:
    _force_kernel(monkeypatch, Fp8Kernel.UPCAST)
    source = tiny_model_factory("llama", tie_word_embeddings=False)
    written = write_fp8_checkpoint(source, tmp_path / "fp8", **CHECKPOINTS[layout])
    method = str(written.quantization_config["quant_method"])
    quantized = LLM(str(written.folder), dtype="float32")  # the config names the format
    assert quantized.engine.quantization == method
    model = quantized.engine.runner.model
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if "proj" in n)
    reference_folder = _dequantized_folder(written.folder, tmp_path / "ref", written.references)
    reference = LLM(str(reference_folder), dtype="float32")
    _assert_same_model(quantized, reference, logprob_tolerance=1e-4)


def test_fp8_checkpoint_reader_keeps_every_scale(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("llama")
    for name, options in CHECKPOINTS.items():
        written = write_fp8_checkpoint(source, tmp_path / name, **options)
        config = json.loads((written.folder / "config.json").read_text())
        checkpoint = Fp8Checkpoint(written.folder, config["quantization_config"])
        assert checkpoint.quantized_names() == set(written.references)
        assert not any(n.endswith(("_scale", "_scale_inv")) for n in checkpoint.names())
        for weight_name, expected in written.references.items():
            weight = checkpoint.read_quantized(weight_name)
            assert torch.equal(dequantize(weight), expected), (name, weight_name)
            assert (weight.input_scale is not None) == (name.endswith("static"))


def test_unsupported_fp8_checkpoints_fail_naming_what(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    source = tiny_model_factory("llama")
    written = write_fp8_checkpoint(source, tmp_path / "ct", layout="ct-channel")
    config_path = written.folder / "config.json"
    config = json.loads(config_path.read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(num_bits=4, type="int")
    config_path.write_text(json.dumps(config))
    with pytest.raises(QuantizationFormatError, match="4-bit int"):
        LLM(str(written.folder))
    block = write_fp8_checkpoint(source, tmp_path / "block", layout="fp8-block", block=(32, 64))
    config = json.loads((block.folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (block.folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationFormatError, match="weight_scale_inv has shape"):
        LLM(str(block.folder))
    with pytest.raises(QuantizationError, match="already fp8-quantized"):
        LLM(str(block.folder), quantization="int8")


def test_a_worker_started_with_quantization_fp8_runs_fp8(tiny_llama_dir: Path) -> None:
    from cli.flags import SettingsCommand
    from cli.main import build_parser
    from worker.engine_api import build_engine

    argv = ["worker", "--model", str(tiny_llama_dir), "--quantization", "fp8", "--device", "cpu"]
    args = build_parser().parse_args(argv)
    assert isinstance(args.handler, SettingsCommand)
    engine = build_engine(args.handler.flags.settings(args))
    assert engine.quantization == "fp8"
    full = LLM(str(tiny_llama_dir), device="cpu")
    assert 0 < engine.weight_bytes < full.engine.weight_bytes
