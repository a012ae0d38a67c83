"""A quantization scheme is one class and one registry line: a toy scheme defined here, with no
engine code edited, loads a model through the engine and serves what full precision serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.layers.linear import Linear
from engine.llm import LLM
from engine.quantization.base import QuantizedLinearMethod, WeightSource
from engine.quantization.errors import QuantizationError
from engine.quantization.registry import QUANTIZATION_SCHEMES, Scheme
from kernels import cpu_ops
from kernels.cpu_ops import LinearKind, NativeLinear
from schemas.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29] * 3, [3, 4]]


class TransposedLinear(QuantizedLinearMethod):
    """The toy: the full-precision weight stored transposed, [in, out], and multiplied as such."""

    source = WeightSource.QUANTIZE_AT_LOAD
    layers_quantized = 0
    native_specs = 0  # specs given to the C++ decode stack

    def __init__(self, transposed: torch.Tensor) -> None:
        self.transposed = transposed

    @classmethod
    def quantize(cls, name: str, weight: torch.Tensor, group_size: int) -> TransposedLinear:
        cls.layers_quantized += 1
        return TransposedLinear(weight.t().contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return (self.transposed.shape[1], self.transposed.shape[0])

    def to(self, device: torch.device) -> TransposedLinear:
        return TransposedLinear(self.transposed.to(device))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.transposed
        return out if layer.bias is None else out + layer.bias

    def native_spec(self, layer: Linear, rows: int) -> NativeLinear | None:
        # at::linear multiplies by its weight's transpose: the stored tensor, as a view.
        TransposedLinear.native_specs += 1
        return NativeLinear(LinearKind.ATEN, self.transposed.t(), bias=layer.bias)

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.transposed]


@pytest.fixture
def transposed_scheme(monkeypatch: pytest.MonkeyPatch) -> str:
    """The toy registered as the tables' other schemes are: one line."""
    name = "transposed"
    method = f"{__name__}:TransposedLinear"
    monkeypatch.setitem(QUANTIZATION_SCHEMES, name, Scheme(method, "fp32 weights, transposed"))
    TransposedLinear.layers_quantized = TransposedLinear.native_specs = 0
    return name


def _run(model: Path, quantization: str | None) -> tuple[LLM, list[list[int]], torch.Tensor]:
    llm = LLM(str(model), dtype="float32", quantization=quantization, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs], llm.engine.token_logprobs(PROMPTS[0])


def test_a_scheme_defined_outside_the_engine_serves_what_full_precision_serves(
    tiny_llama_dir: Path, transposed_scheme: str
) -> None:
    full, full_tokens, full_logprobs = _run(tiny_llama_dir, None)
    toy, toy_tokens, toy_logprobs = _run(tiny_llama_dir, transposed_scheme)

    assert toy.engine.quantization == transposed_scheme
    linears = [m for m in toy.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.method, TransposedLinear) for m in linears)
    assert TransposedLinear.layers_quantized == len(linears)
    if cpu_ops.cpu_kernels_available():  # decode steps ran the toy's spec in C++
        assert TransposedLinear.native_specs > 0
    assert toy_tokens == full_tokens
    torch.testing.assert_close(toy_logprobs, full_logprobs, rtol=1e-4, atol=1e-4)
    # The plain weights were freed; the transposed ones count instead: the same bytes (less
    # the greedy screen's bf16 head, which only a full-precision head gets).
    screen = full.engine.runner.greedy_screen
    full_weights = full.engine.weight_bytes - (screen.nbytes if screen is not None else 0)
    assert toy.engine.weight_bytes == full_weights


def test_an_unregistered_scheme_is_refused_naming_the_registered_ones(tiny_llama_dir: Path) -> None:
    with pytest.raises(QuantizationError, match="'transposed' is not supported; supported: int8"):
        LLM(str(tiny_llama_dir), dtype="float32", quantization="transposed")
